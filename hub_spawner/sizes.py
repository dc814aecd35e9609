"""Human sizes at the Hub's edges (config, REST API), with JupyterHub's own semantics.

Parsing is delegated to :class:`jupyterhub.traitlets.ByteSpecification`, the trait behind
``Spawner.mem_limit``: an integer is bytes; a string is a number followed by K, M, G or T
(powers of 1024), e.g. ``"512M"``, ``"1.5G"``. On top of it we refuse what a budget can
never be: booleans, zero, negatives, NaN and infinities.
"""

from __future__ import annotations

import math

from jupyterhub.traitlets import ByteSpecification
from traitlets import TraitError

from jupyter_vgpu.units import format_bytes as format_size  # noqa: F401 - re-exported

_spec = ByteSpecification()


def parse_size(value: object, *, field: str = "size") -> int:
    """Bytes for ``value`` (an int of bytes, or a string like ``"4G"``).

    Raises:
        ValueError: ``value`` is not a size, or is zero or negative. The message names
            ``field`` and says what is accepted.
    """
    accepted = f"{field} must be a positive number of bytes or a string like '512M', '4G' (K, M, G, T)"
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise ValueError(f"{accepted}; got {value!r}")
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"{accepted}; got {value!r}")
    if isinstance(value, str):
        value = value.strip()
        if value.isdigit():
            value = int(value)
    try:
        size = _spec.validate(None, value)
    except (TraitError, TypeError, IndexError, OverflowError):
        raise ValueError(f"{accepted}; got {value!r}") from None
    if size <= 0:
        raise ValueError(f"{accepted}; got {value!r}")
    return size

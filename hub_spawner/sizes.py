"""Human sizes at the Hub's edges (config, REST API), with JupyterHub's own semantics.

A size is a whole number of bytes (a JSON integer, or a string of ASCII digits), or a
string of ASCII digits with an optional decimal part and one of K, M, G, T (powers of
1024: ``"512M"``, ``"1.5G"``), converted by
:class:`jupyterhub.traitlets.ByteSpecification`, the trait behind ``Spawner.mem_limit``.
Nothing else: no fractions of a byte (``1.5``, ``"4294967296.7"``), no floats at all
(``1024.0``), no exponents, no underscores (``"1_0G"``), no other digits than 0-9, no
booleans, and nothing below a minimum the caller names (the Hub's is
``VGPUHub.min_memory_limit``). Messages name the field and never carry Python's own
wording.
"""

from __future__ import annotations

import re

from jupyterhub.traitlets import ByteSpecification

from jupyter_vgpu.slice import MAX_BYTES
from jupyter_vgpu.units import format_bytes as format_size

__all__ = ["MAX_BYTES", "format_size", "parse_size"]

_spec = ByteSpecification()
_BYTES = re.compile(r"[0-9]{1,19}", re.ASCII)
_UNIT = re.compile(r"[0-9]{1,15}(?:\.[0-9]{1,9})?[KMGT]", re.ASCII)


def _shown(value: object) -> str:
    text = repr(value) if isinstance(value, str) else str(value)
    return text if len(text) <= 40 else text[:39] + "…"


def parse_size(value: object, *, field: str = "size", minimum: int = 1) -> int:
    """Bytes for ``value`` (an int of bytes, or a string like ``"4G"`` or ``"4294967296"``).

    Args:
        value: the decoded JSON value (or a config value).
        field: the name shown in messages.
        minimum: the smallest size accepted, bytes (>= 1).

    Returns:
        The size, bytes, from ``minimum`` to :data:`MAX_BYTES`.

    Raises:
        ValueError: ``value`` is not a size of that form, or is below ``minimum`` or
            above :data:`MAX_BYTES`; the message names ``field`` and says what is
            accepted.
    """
    accepted = (
        f"{field} must be a whole number of bytes or a string like '512M' or '4G' "
        "(digits 0-9, then K, M, G or T)"
    )
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        kind = "a number with a fraction" if isinstance(value, float) else type(value).__name__
        if value is None or isinstance(value, bool):
            kind = "true or false" if isinstance(value, bool) else "null"
        shown = f" ({_shown(value)})" if isinstance(value, float) else ""
        raise ValueError(f"{accepted}; got {kind}{shown}")
    if isinstance(value, str):
        text = value.strip()
        if _BYTES.fullmatch(text):
            size = int(text)
        elif _UNIT.fullmatch(text):
            size = int(_spec.validate(None, text))
        else:
            raise ValueError(f"{accepted}; got {_shown(value)}")
    else:
        size = value
    if size > MAX_BYTES:
        raise ValueError(f"{field} must be at most {MAX_BYTES} bytes")
    if size < minimum:
        raise ValueError(f"{field} must be at least {format_size(minimum)}; got {_shown(value)}")
    return size

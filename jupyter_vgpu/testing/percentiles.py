"""The one rule every benchmark and model takes its percentiles by.

Percentiles are NumPy's default, linear interpolation between the two nearest ranks
(``numpy.percentile(values, q)``, ``method="linear"``; the same as
``statistics.quantiles(values, n=100, method="inclusive")``): for ``n`` sorted values
the ``q``-th percentile sits at rank ``q / 100 * (n - 1)``, and a rank between two
values takes the straight line between them. The 50th is the median. For 32 cells the
95th sits at rank 29.45: 0.45 of the way from the third largest to the second largest,
where the rule before this one (the value at ``int(0.95 * (n - 1))``) took the third
largest itself.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

#: Said wherever a results file records what its percentiles mean.
RULE = "numpy.percentile, linear interpolation (NumPy's default)"


def percentile(values: Iterable[float], q: float) -> float:
    """The ``q``-th percentile (0-100) of ``values`` by linear interpolation
    (``numpy.percentile``'s default).

    Raises:
        ValueError: no values, or ``q`` outside 0-100.
    """
    data = np.asarray(list(values), dtype=float)
    if data.size == 0:
        raise ValueError("no values")
    if not 0 <= q <= 100:
        raise ValueError(f"q must be within 0-100, not {q}")
    return float(np.percentile(data, q))


def percentile_or_none(values: Iterable[float], q: float) -> float | None:
    """:func:`percentile`, or None where there are no values (a run that measured nothing)."""
    data = list(values)
    return percentile(data, q) if data else None

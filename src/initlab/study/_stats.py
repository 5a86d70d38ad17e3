"""Order statistics shared by the study's aggregation and plots: :func:`quantile`.

Kept apart so :mod:`initlab.study.aggregate` and :mod:`initlab.study.plots` both import it without
importing each other.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

__all__ = ["quantile"]


def quantile(values: Iterable[float], q: float) -> float:
    """The ``q`` quantile (linear interpolation, as ``numpy.quantile``), exact with ``+inf``."""
    xs = sorted(values)
    if not xs:
        raise ValueError("quantile of no values")
    if not 0.0 <= q <= 1.0:
        raise ValueError(f"q must be in [0, 1], got {q}")
    pos = q * (len(xs) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    frac = pos - lo
    a, b = xs[lo], xs[hi]
    if frac == 0.0 or a == b:
        return a
    if math.isinf(b):  # a < b = inf: any positive weight on b gives inf
        return math.inf
    return a + (b - a) * frac

"""The one percentile function of the project: the gateway's rolling windows and the load tester's
reports use it, so a p99 means the same thing in ``/stats`` and in a loadtest report.

Dependency-free on purpose: ``loadtest`` imports it without importing the gateway's app.
"""

from __future__ import annotations

import math
from collections.abc import Iterable


def percentile(values: Iterable[float], p: float) -> float | None:
    """The ``p``-th percentile (0 <= p <= 100) of ``values``, in any order; None when there are none.

    Linear interpolation between the two closest ranks (numpy's default, "linear"): p=0 is the
    minimum, p=100 the maximum, p=50 of [1, 2, 3, 4] is 2.5.
    """
    ordered = sorted(values)  # linear on already sorted input (timsort)
    if not ordered:
        return None
    pos = (len(ordered) - 1) * min(100.0, max(0.0, p)) / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)

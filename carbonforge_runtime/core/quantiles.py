"""The project's one quantile convention: nearest rank.

The q-quantile of n values (0 <= q <= 1) is the value at 1-based rank ``ceil(q * n)`` (at least 1)
of the sorted values: the smallest value that at least a fraction q of the values do not exceed.
It is always one of the values (no interpolation), p100 is the maximum and p0 the minimum. Every
percentile the project prints or exports uses it: the Prometheus guard percentiles, the replay
summary, and ``trace summarize`` (whose sketch applies the same rank to its buckets). Pure.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

#: Slack for q * n computed in floating point (0.9 * 30 is 27.000000000000004, whose ceiling is 28).
_EPSILON = 1e-9


def nearest_rank(q: float, count: int) -> int:
    """The 0-based index, among ``count`` sorted values, of the ``q``-quantile."""
    if count <= 0:
        raise ValueError("no values")
    q = min(max(q, 0.0), 1.0)
    return min(max(math.ceil(q * count - _EPSILON), 1), count) - 1


def quantile(values: Sequence[float], q: float) -> float | None:
    """The ``q``-quantile of ``values`` (0 <= q <= 1); ``None`` when there are none."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[nearest_rank(q, len(ordered))]

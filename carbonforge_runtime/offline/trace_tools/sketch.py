"""A mergeable quantile sketch with a relative error bound (log-bucketed histogram).

Exact percentiles over an unbounded stream need every value in memory, so the trace tools
keep a histogram whose bucket edges grow geometrically instead:

* a positive value ``x`` above :data:`MIN_VALUE` falls in bucket ``i = ceil(log(x) / log(GAMMA))``,
  which covers ``(GAMMA**(i-1), GAMMA**i]``, with ``GAMMA = (1 + ALPHA) / (1 - ALPHA)``;
* a bucket is reported as ``2 * GAMMA**i / (GAMMA + 1)``, which is within ``ALPHA`` (1 %)
  of every value the bucket can hold; the estimate is then clamped to the exact minimum and
  maximum, which only brings it closer;
* values at or below :data:`MIN_VALUE` (one microsecond; zero queue waits, clock jitter
  below zero) share one bucket reported as ``0.0``: absolute error at most ``MIN_VALUE`` for
  non-negative values (a negative value, which only clock skew produces, reads as zero).

The rank convention is the project's nearest rank (:mod:`carbonforge_runtime.core.quantiles`):
for ``n`` values sorted ascending, the ``q``-quantile is the value of 1-based rank ``ceil(q * n)``;
the maximum is exact. The memory is a
few hundred buckets at most per sketch, whatever the number of values, and two sketches
merge by adding their bucket counts (the merged sketch answers as if it had seen both streams).
"""

from __future__ import annotations

import math
from array import array
from collections import Counter
from collections.abc import Iterable, Sequence

from carbonforge_runtime.core.quantiles import nearest_rank

#: Relative accuracy of every quantile above MIN_VALUE.
ALPHA = 0.01
GAMMA = (1.0 + ALPHA) / (1.0 - ALPHA)
_INV_LOG_GAMMA = 1.0 / math.log(GAMMA)
_MIDPOINT = 2.0 * GAMMA / (GAMMA + 1.0)
#: Values at or below this go to the zero bucket (absolute error at most this much).
MIN_VALUE = 1e-6


class QuantileSketch:
    """Counts of values per geometric bucket, plus exact count, sum, minimum and maximum.

    A sketch that is no longer being filled can be packed (:meth:`pack`) into two flat arrays (about a
    tenth of the memory); adding to or merging into it unpacks it again.
    """

    __slots__ = ("_live", "_packed", "count", "max", "min", "total", "zeros")

    def __init__(self) -> None:
        self._live: Counter[int] | None = Counter()
        self._packed: tuple[array[int], array[int]] | None = None
        self.zeros = 0
        self.count = 0
        self.total = 0.0
        self.min = math.inf
        self.max = -math.inf

    @property
    def buckets(self) -> Counter[int]:
        """Bucket index -> count, unpacked for updating."""
        if self._live is None:
            indexes, counts = self._packed or (array("i"), array("q"))
            self._live = Counter(dict(zip(indexes, counts, strict=True)))
            self._packed = None
        return self._live

    def pack(self) -> None:
        if self._live is not None:
            indexes = sorted(self._live)
            self._packed = (array("i", indexes), array("q", map(self._live.__getitem__, indexes)))
            self._live = None

    def _sorted_items(self) -> Iterable[tuple[int, int]]:
        if self._live is None and self._packed is not None:
            return zip(self._packed[0], self._packed[1], strict=True)
        live = self._live or Counter()
        return ((index, live[index]) for index in sorted(live))

    def add_many(self, values: Sequence[float]) -> None:
        """Add a batch of finite numbers (the loop runs in C: keep batches large)."""
        if not values:
            return
        positive = list(filter(MIN_VALUE.__lt__, values))
        self.zeros += len(values) - len(positive)
        if positive:
            self.buckets.update(map(math.ceil, map(_INV_LOG_GAMMA.__mul__, map(math.log, positive))))
        self.count += len(values)
        self.total += sum(values)
        low, high = min(values), max(values)
        if low < self.min:
            self.min = low
        if high > self.max:
            self.max = high

    def add(self, value: float) -> None:
        self.add_many((value,))

    def merge(self, other: QuantileSketch) -> None:
        self.buckets.update(dict(other._sorted_items()))
        self.zeros += other.zeros
        self.count += other.count
        self.total += other.total
        self.min = min(self.min, other.min)
        self.max = max(self.max, other.max)

    @classmethod
    def merged(cls, sketches: Iterable[QuantileSketch]) -> QuantileSketch:
        result = cls()
        for sketch in sketches:
            result.merge(sketch)
        return result

    def quantile(self, q: float) -> float | None:
        """The ``q``-quantile (0 <= q <= 1), within ALPHA relative error; None when empty."""
        if self.count == 0:
            return None
        if q >= 1.0:
            return self.max
        rank = nearest_rank(q, self.count)
        if rank < self.zeros:
            return min(max(0.0, self.min), self.max)
        seen = self.zeros
        for index, count in self._sorted_items():
            seen += count
            if seen > rank:
                # the bucket's midpoint 2 * GAMMA**index / (GAMMA + 1), from its lower bound, which is
                # below a value it holds: GAMMA**index itself overflows for values near the largest float
                estimate = GAMMA ** (index - 1) * _MIDPOINT
                return min(max(estimate, self.min), self.max)
        return self.max  # not reached: the counts add up to self.count

    def quantiles(self, qs: Sequence[float]) -> list[float | None]:
        return [self.quantile(q) for q in qs]

    @property
    def mean(self) -> float | None:
        return self.total / self.count if self.count else None


def exact_quantile(values: Sequence[float], q: float) -> float:
    """The same rank convention over a sorted copy (reference for tests and small inputs)."""
    ordered = sorted(values)
    return ordered[nearest_rank(q, len(ordered))]

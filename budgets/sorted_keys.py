"""Distinct keys in order, with the first key above any given one: a list of short sorted buckets.

What the grant pass asks of a group's young heads (budgets/queue_index.py): add a key, remove one,
the lowest key, and the lowest key above the pass's cursor. One sorted list shifts every pointer
after the spot on each insert or removal (20,000 young heads: 80 KB of memory moved per change, on
average); ``sortedcontainers.SortedList``, used here before, splits its list into sublists of
up to 2,000 and still moved ~6 KB per change, a memory copy that was a quarter of the extra
first-level cache misses of a cycle at 100,000 waiting tenants over one at 10 (cachegrind;
docs/benchmarks.md, "Short buckets"). Here buckets hold ``load // 2`` to ``2 * load`` keys (32 to
128 by default; fewer in the only bucket), so a change moves O(``load``) pointers, plus, on a
split or a merge, one entry of ``maxes`` (each bucket's highest key, which says which bucket a key
belongs to). Each operation is two binary searches in C; there is no positional index to keep.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right, insort
from typing import Any, Generic, Protocol, TypeVar


class _Ordered(Protocol):
    def __lt__(self, other: Any, /) -> bool: ...


K = TypeVar("K", bound=_Ordered)

__all__ = ["SortedKeys"]

LOAD = 64  # the default ``load`` (docs/benchmarks.md, "Short buckets": 32 and 128 measured too)


class SortedKeys(Generic[K]):
    """Distinct keys in increasing order: ``add``, ``remove``, ``first``, ``after``; O(log n)
    comparisons and O(``load``) pointers moved per change (a split or a merge included), plus one
    entry of ``maxes`` (n / ``load`` long) when buckets split or merge."""

    __slots__ = ("buckets", "load", "maxes", "n")

    def __init__(self, load: int = LOAD) -> None:
        self.load = load  # buckets split above 2 * load keys, join below load // 2
        self.buckets: list[list[K]] = []
        self.maxes: list[K] = []  # maxes[i] is buckets[i][-1]
        self.n = 0

    def __len__(self) -> int:
        return self.n

    def __iter__(self) -> Any:
        for bucket in self.buckets:
            yield from bucket

    def first(self) -> K | None:
        """The lowest key (None when empty)."""
        buckets = self.buckets
        return buckets[0][0] if buckets else None

    def after(self, key: Any) -> K | None:
        """The lowest key above ``key`` (None when there is none)."""
        maxes = self.maxes
        pos = bisect_right(maxes, key)
        if pos == len(maxes):
            return None
        bucket = self.buckets[pos]
        return bucket[bisect_right(bucket, key)]

    def add(self, key: K) -> None:
        """Insert ``key``, which is not held."""
        maxes, buckets = self.maxes, self.buckets
        self.n += 1
        if not maxes:
            buckets.append([key])
            maxes.append(key)
            return
        pos = bisect_right(maxes, key)
        if pos == len(maxes):  # above every key: the last bucket's new highest
            pos -= 1
            bucket = buckets[pos]
            bucket.append(key)
            maxes[pos] = key
        else:
            bucket = buckets[pos]
            insort(bucket, key)
        load = self.load
        if len(bucket) > 2 * load:
            upper = bucket[load:]
            del bucket[load:]
            buckets.insert(pos + 1, upper)
            maxes.insert(pos + 1, upper[-1])
            maxes[pos] = bucket[-1]

    def remove(self, key: K) -> None:
        """Take out ``key``, which is held (KeyError otherwise)."""
        maxes, buckets = self.maxes, self.buckets
        pos = bisect_left(maxes, key)
        if pos < len(maxes):
            bucket = buckets[pos]
            i = bisect_left(bucket, key)
            if i < len(bucket) and bucket[i] == key:
                del bucket[i]
                self.n -= 1
                if len(bucket) < self.load // 2 and len(buckets) > 1:
                    self._merge(pos)
                elif not bucket:  # (the only bucket)
                    del buckets[pos]
                    del maxes[pos]
                elif i == len(bucket):
                    maxes[pos] = bucket[-1]
                return
        raise KeyError(key)

    def _merge(self, pos: int) -> None:
        # A short bucket joins a neighbour (the next one, or the previous for the last), and the
        # joined bucket splits again if that made it too long: every bucket stays LOAD // 2 or more.
        buckets, maxes = self.buckets, self.maxes
        if pos == len(buckets) - 1:
            pos -= 1
        low, high = buckets[pos], buckets[pos + 1]
        low.extend(high)
        del buckets[pos + 1]
        del maxes[pos + 1]
        if len(low) > 2 * self.load:
            half = len(low) // 2
            upper = low[half:]
            del low[half:]
            buckets.insert(pos + 1, upper)
            maxes.insert(pos + 1, upper[-1])
        maxes[pos] = low[-1]

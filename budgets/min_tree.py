"""The lowest of a changing set of keys, with a bound on every operation: a tournament tree.

Why not a heap with lazy deletion (what budgets/ used before): a lazy heap leaves an entry behind
each time a member's key changes or the member leaves, and drops it only when it reaches the top.
That is cheap on average and unbounded at the worst moment: when N members' keys rose together (a
saturated pool serving N backlogged tenants in turn) their N outdated entries surface together, and
one call walks all of them (measured: grant passes of 235–355 ms and enqueues of 204–234 ms at
100,000 waiting tenants, docs/benchmarks.md, "Every step bounded"). A rebuild when stale entries
pile up is the same walk at another time.

Here every key sits in a numbered *slot* (a leaf of a complete binary tree over ``2 * capacity``
list cells; cell ``capacity + slot`` is the slot's key, cell ``i`` below ``capacity`` the lower of
cells ``2i`` and ``2i + 1``, cell 1 the lowest of all). A change rewrites the path from its leaf to
the root and stops where a cell's value does not change: a key that rises without having been the
lowest below its parent costs one step, a departing lowest key ``log2(capacity)`` steps (17 at
100,000). Capacity doubles when the slots run out: the old tree becomes the left half of the new
one, copied level by level in C (~1 ms at 100,000, once per power of two); freed slots are reused
and never given back.

An empty slot holds ``top``, a key above every real key (``math.inf``, ``(math.inf,)``); ``lowest``
returns ``top`` when the tree is empty.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable
from typing import Any, Generic, Protocol, TypeVar


class _Ordered(Protocol):
    def __lt__(self, other: Any, /) -> bool: ...


K = TypeVar("K", bound=_Ordered)

__all__ = ["MinMap", "MinTree", "MostlyInOrder"]


class MinTree(Generic[K]):
    """Keys in slots; ``lowest`` in O(1), ``add`` / ``change`` / ``remove`` in O(log n) at worst."""

    __slots__ = ("cap", "cells", "free", "n", "top")

    def __init__(self, top: K) -> None:
        self.top = top
        self.cap = 1
        self.cells: list[K] = [top, top]
        self.free: list[int] = [0]
        self.n = 0

    def __len__(self) -> int:
        return self.n

    def lowest(self) -> K:
        return self.cells[1]

    def add(self, key: K) -> int:
        """Put ``key`` in a free slot; returns the slot."""
        free = self.free
        if not free:
            self._grow()
        slot = free.pop()
        self.n += 1
        self.change(slot, key)
        return slot

    def remove(self, slot: int) -> None:
        self.change(slot, self.top)
        self.n -= 1
        self.free.append(slot)

    def change(self, slot: int, key: K) -> None:
        cells = self.cells
        i = self.cap + slot
        cells[i] = key
        m = key  # the value just written at cell i: its parent's is the lower of it and i's sibling
        while i > 1:
            s = cells[i ^ 1]
            if s < m:
                m = s
            i >>= 1
            was = cells[i]
            if was is m or was == m:  # the cells above were made from this value: unchanged too
                return
            cells[i] = m

    def lowest_except(self, slot: int) -> K:
        """The lowest key in any slot but ``slot``."""
        cells = self.cells
        i = self.cap + slot
        if cells[i] != cells[1]:
            return cells[1]
        m = self.top
        while i > 1:  # the siblings along the path cover every other leaf once
            s = cells[i ^ 1]
            if s < m:
                m = s
            i >>= 1
        return m

    def keys(self) -> list[K]:
        """Every key held, in slot order (tests, debugging)."""
        top, cap = self.top, self.cap
        return [k for k in self.cells[cap : 2 * cap] if k != top]

    def _grow(self) -> None:
        # Doubling adds an empty right half under a new root: the old tree is the left half as it
        # is. Level d of the old tree (cells [2^d, 2^(d+1))) becomes the first half of level d + 1,
        # the rest is ``top``, and the root keeps its value: slice copies, no comparison.
        old, cap = self.cells, self.cap
        cells = [self.top] * (4 * cap)
        cells[1] = old[1]
        lo = 1
        while lo <= cap:
            cells[2 * lo : 3 * lo] = old[lo : 2 * lo]
            lo *= 2
        self.cells, self.cap = cells, 2 * cap
        self.free.extend(range(2 * cap - 1, cap - 1, -1))  # popped from the end: lowest slot first


N = TypeVar("N", bound=Hashable)


class MinMap(MinTree[K], Generic[N, K]):
    """A :class:`MinTree` by name: each name has one key. (A subclass rather than a wrapper: a
    name's change is one call to ``change``, as the policy makes a dozen per grant.)"""

    __slots__ = ("slots",)

    def __init__(self, top: K) -> None:
        super().__init__(top)
        self.slots: dict[N, int] = {}

    def set(self, name: N, key: K) -> None:
        slot = self.slots.get(name)
        if slot is None:
            free = self.free
            if not free:
                self._grow()
            slot = free.pop()
            self.n += 1
            self.slots[name] = slot
        self.change(slot, key)

    def discard(self, name: N) -> None:
        slot = self.slots.pop(name, None)
        if slot is not None:
            self.change(slot, self.top)
            self.n -= 1
            self.free.append(slot)

    def lowest_other(self, name: N) -> K:
        """The lowest key of a name other than ``name`` (``top`` when there is none)."""
        slot = self.slots.get(name)
        if slot is None:
            return self.cells[1]
        return self.lowest_except(slot)


class MostlyInOrder(Generic[N, K]):
    """A :class:`MinMap` for keys that mostly come in increasing order (enqueue times, deadlines).

    Keys at or above the last one taken in go to a FIFO (an ``OrderedDict``: adding, taking out
    and reading the front are O(1), where a tree's lowest key costs a walk of its height to take
    out, seventeen cold steps at 100,000); the rest to a tree. Each name holds one key: adding a
    name that is there moves it.
    """

    __slots__ = ("fifo", "last", "tree")

    def __init__(self, top: K) -> None:
        self.fifo: OrderedDict[N, K] = OrderedDict()
        self.last = top  # at least the FIFO's last key (keys leave the FIFO without moving it)
        self.tree: MinMap[N, K] = MinMap(top)

    def __len__(self) -> int:
        return len(self.fifo) + self.tree.n

    def __bool__(self) -> bool:
        return bool(self.fifo) or bool(self.tree.slots)

    def add(self, name: N, key: K) -> None:
        fifo = self.fifo
        if name in fifo or name in self.tree.slots:  # (the FIFO would keep its old place)
            self.discard(name)
        if not fifo or not key < self.last:
            fifo[name] = key
            self.last = key
        else:
            self.tree.set(name, key)

    def discard(self, name: N) -> None:
        if self.fifo.pop(name, None) is None:
            self.tree.discard(name)

    def lowest(self) -> K:
        """The lowest key (``top`` when empty)."""
        low = self.tree.cells[1]
        if self.fifo:
            first = next(iter(self.fifo.values()))
            if not low < first:
                return first
        return low

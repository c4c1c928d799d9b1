"""What makes a grant pass cheap: the waiting heads indexed so that the pass touches only what can change.

Derived state only: everything here is a function of the waiting tickets, the counters, the
tokens in flight and the highest ``now`` a pass has seen, kept in step by budgets/policy.py at every
change of those. It never decides anything by itself; the spec of the pass is the policy's docstring.

- Each ``(tier, tenant)`` queue's head is a :class:`Head`, ranked by ``(counter, rank_seq, tenant)``
  where ``rank_seq`` is the lowest seq in that queue: the head's own seq in FIFO order, possibly
  an earlier ticket's under ``shortest_first`` (the policy docstring says why). A head blocked by a private pool (its
  tenant's own budget) is *parked*: it is in no group, and it is checked again only when a private
  pool it names changes (``private_changed``). Every other head is *active* in exactly one
  :class:`Group`: the heads of one tier that name the same shared pools.
- A head is *young* or *old* (policy docstring: old once it has waited ``backfill_limit_s``, made
  so when it becomes head or by ``promote`` at the start of a pass). In its group an active head is
  young or old too. Young heads are in a sorted list by ``(counter, rank_seq, tenant)`` (the pass
  walks them from its cursor), and counted per cost, with a small heap of the costs there are (the
  pass asks "can any young head of this group fit?" of the lowest cost; a head leaving young takes
  its count out at once). Old heads are in a heap by ``(counter, rank_seq, tenant)`` (the lowest one
  either fits or holds the group's pools, so nothing but the minimum is ever needed). Young heads,
  parked or not, are also ordered by enqueue time for ``promote``: in a FIFO while they come in that
  order (a new ticket that is head at once, enqueued at the latest ``now``), in a heap when not (a
  successor, enqueued earlier behind its queue's head); ``promote`` takes the lower of the two
  fronts. With a hundred thousand waiting tenants each new ticket is a head, and a heap pop there
  walked seventeen levels of cold tuples: the FIFO's is one.
- Heaps are lazy: an entry whose head left, moved or changed rank stays until it reaches the top
  and is dropped there; a heap is rebuilt when stale entries outnumber live ones three to one. Heap
  entries hold names and numbers, never a head (the head is looked up by ``(tier, tenant)``): such
  tuples are no work for the garbage collector once it has seen them.

Redis keeps the same structures in sorted sets (budgets/redis/lua/lib.lua).
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass

from sortedcontainers import SortedList

from budgets.types import BudgetLayout, Demand

Key = tuple[float, int, str]  # (counter, rank_seq, tenant): the rank of a head inside its tier


@dataclass(slots=True)
class Ticket:
    seq: int
    demand: Demand
    enqueued_at: float


class Group:
    """Active heads of one tier whose demands name the same shared pools (``pools``, sorted)."""

    __slots__ = (
        "cost_heap",
        "costs",
        "heads",
        "limits",
        "limits_of",
        "n_old",
        "n_young",
        "old",
        "pools",
        "tier",
        "young",
    )

    def __init__(self, tier: str, pools: tuple[str, ...], heads: dict[tuple[str, str], Head]) -> None:
        self.tier = tier
        self.pools = pools
        self.heads = heads  # the index's, to tell live heap entries from stale ones
        self.young: SortedList = SortedList()  # Key of each young head
        # cost -> young heads with that cost (0: none left, the cost still in cost_heap); cost_heap
        # is a heap of the keys of costs: one entry per distinct cost, so as many as there are heads
        # at worst and far fewer where costs repeat (the same prompt and max_tokens, a benchmark),
        # small and hot in the caches there, where a lazy entry per head meant a cold pop per head
        # leaving young.
        self.costs: dict[int, int] = {}
        self.cost_heap: list[int] = []
        self.old: list[Key] = []  # heap of Key of old heads, lazy
        self.n_old = 0
        self.n_young = 0  # len(young), read on every pass without SortedList's Python-level __len__
        # (pool, limit for this tier) of each pool, under the layout ``limits_of`` (the pass's room)
        self.limits: tuple[tuple[str, int], ...] = ()
        self.limits_of: BudgetLayout | None = None

    def __bool__(self) -> bool:
        return self.n_young > 0 or self.n_old > 0

    def lowest_old(self) -> Key | None:
        """The lowest-ranked old head's key (stale entries dropped on the way)."""
        old, heads, tier = self.old, self.heads, self.tier
        while old:
            key = old[0]
            head = heads.get((tier, key[2]))
            if head is not None and head.group is self and head.old and head.key == key:
                return key
            heapq.heappop(old)
        return None

    def lowest_young_cost(self) -> int | None:
        heap, costs = self.cost_heap, self.costs
        while heap:
            cost = heap[0]
            if costs[cost]:
                return cost
            heapq.heappop(heap)
            del costs[cost]
        return None

    def add_cost(self, cost: int) -> None:
        """A young head with ``cost`` joined the group (call after counting it in ``n_young``)."""
        costs = self.costs
        n = costs.get(cost)
        if n is not None:
            costs[cost] = n + 1
            return
        costs[cost] = 1
        heapq.heappush(self.cost_heap, cost)
        if len(costs) > 64 and len(costs) > 3 * self.n_young:  # costs no young head has piled up
            self.costs = {c: k for c, k in costs.items() if k}
            self.cost_heap = list(self.costs)
            heapq.heapify(self.cost_heap)

    def drop_cost(self, cost: int) -> None:
        """A young head with ``cost`` left the group, or young."""
        self.costs[cost] -= 1

    def push_old(self, key: Key) -> None:
        old = self.old
        heapq.heappush(old, key)
        if len(old) > 64 and len(old) > 3 * self.n_old:
            self.old = [k for k in old if self._is_old(k)]
            heapq.heapify(self.old)

    def _is_old(self, key: Key) -> bool:
        head = self.heads.get((self.tier, key[2]))
        return head is not None and head.group is self and head.old and head.key == key


@dataclass(slots=True, eq=False)
class Head:
    tier: str
    tenant: str
    ticket: Ticket
    shared: tuple[str, ...]  # the demand's shared pools, sorted: its group
    private: tuple[str, ...]  # the demand's private pools
    group: Group | None = None  # None while parked (or after removal)
    key: Key | None = None
    old: bool = False
    rank_seq: int = 0  # the lowest seq of its queue (module docstring)


class QueueIndex:
    """Heads of every ``(tier, tenant)`` FIFO, grouped for the grant pass (module docstring)."""

    __slots__ = ("age", "age_in_order", "groups", "heads", "private", "split")

    def __init__(self) -> None:
        self.heads: dict[tuple[str, str], Head] = {}
        self.groups: dict[str, dict[tuple[str, ...], Group]] = {}  # tier -> shared pools -> group
        # private pool -> the head naming it, or a list of them (a tenant's own budget: one head per
        # tier, so nearly always one head and no container to make, drop and collect per head)
        self.private: dict[str, Head | list[Head]] = {}
        # young heads as (enqueued_at, seq, tier, tenant), lazy: an entry is live while that queue's
        # head is that ticket and young (under shortest_first a ticket can be head, be displaced, and
        # be head again: its two entries are equal, and the second finds it old and is dropped).
        # Entries that come in order go to the FIFO ``age_in_order``, the rest to the heap ``age``.
        self.age: list[tuple[float, int, str, str]] = []
        self.age_in_order: deque[tuple[float, int, str, str]] = deque()
        # demand pools -> (shared pools sorted, private pools) under the indexed layout
        self.split: dict[tuple[str, ...], tuple[tuple[str, ...], tuple[str, ...]]] = {}

    # ---- heads ----

    def add(
        self,
        tier: str,
        tenant: str,
        ticket: Ticket,
        layout: BudgetLayout,
        counter: float,
        in_flight: Mapping[str, int],
        now: float,
        old: bool = False,
        rank_seq: int | None = None,
    ) -> Head:
        """Index the new head of a queue: old if ``old`` or if it has waited ``backfill_limit_s`` by
        ``now``; ranked with ``rank_seq`` (the queue's lowest seq; default the ticket's own)."""
        names = ticket.demand.pools
        split = self.split.get(names)
        if split is None:
            # One entry per pool set (a tenant's demands share theirs): bounded by the heads there
            # are, so that thousands of waiting tenants do not recompute theirs on every new head.
            if len(self.split) > 4096 and len(self.split) > 2 * len(self.heads):
                self.split.clear()
            pools = layout.pools
            shared = tuple(sorted(n for n in names if pools[n].shared))
            split = self.split[names] = (shared, tuple(n for n in names if not pools[n].shared))
        head = Head(tier, tenant, ticket, split[0], split[1])
        head.rank_seq = ticket.seq if rank_seq is None else rank_seq
        head.old = old or now - ticket.enqueued_at >= layout.policy.backfill_limit_s
        if not head.old:
            entry = (ticket.enqueued_at, ticket.seq, tier, tenant)
            in_order = self.age_in_order
            if not in_order or in_order[-1] <= entry:
                in_order.append(entry)
            else:
                heapq.heappush(self.age, entry)
            n = len(self.age) + len(in_order)
            if n > 64 and n > 3 * len(self.heads):
                self._rebuild_age()
        self.heads[(tier, tenant)] = head
        private = split[1]
        if private:
            naming = self.private
            for name in private:
                was = naming.get(name)
                if was is None:
                    naming[name] = head
                elif isinstance(was, list):
                    was.append(head)
                else:
                    naming[name] = [was, head]
            if not private_ok(head, layout, in_flight):
                return head
        self._activate(head, counter)
        return head

    def remove(self, head: Head) -> None:
        if head.group is not None:
            self._deactivate(head)
        del self.heads[(head.tier, head.tenant)]
        naming = self.private
        for name in head.private:
            was = naming[name]
            if was is head:
                del naming[name]
            elif isinstance(was, list):
                was.remove(head)
                if len(was) == 1:
                    naming[name] = was[0]

    def reposition(self, tenant: str, counter: float) -> None:
        """The tenant's counter changed: move its active heads to their new rank."""
        heads = self.heads
        for tier in self.groups:  # (the tiers with active heads: a handful)
            head = heads.get((tier, tenant))
            if head is not None and head.key is not None:
                self._rerank(head, (counter, head.key[1], head.key[2]))

    def reseq(self, head: Head, rank_seq: int) -> None:
        """The lowest seq of the head's queue changed (shortest_first: an earlier ticket left while
        this head stays): rank it with the new one. Its age class stays."""
        head.rank_seq = rank_seq
        if head.key is not None:
            self._rerank(head, (head.key[0], rank_seq, head.key[2]))

    @staticmethod
    def _rerank(head: Head, new: Key) -> None:
        """Give an active head its new rank key in its group (old heads: a fresh heap entry)."""
        group, key = head.group, head.key
        if group is None or key is None or new == key:
            return  # inactive, or the same rank: a second heap entry would only be a duplicate
        head.key = new
        if head.old:
            group.push_old(new)  # the old entry is stale now
        else:
            group.young.remove(key)
            group.young.add(new)

    def private_changed(
        self,
        pool: str,
        layout: BudgetLayout,
        counters: Mapping[str, float],
        in_flight: Mapping[str, int],
        freed: bool,
    ) -> None:
        """Tokens in flight on private ``pool`` went down (``freed``) or up: wake or park the heads
        that name it. (Tokens freed can only wake parked heads, tokens taken only park active ones.)"""
        was = self.private.get(pool)
        if was is None:
            return
        for head in was if isinstance(was, list) else (was,):  # ((de)activating leaves these as they are)
            if (head.group is None) is freed and private_ok(head, layout, in_flight) is freed:
                if freed:
                    self._activate(head, counters[head.tenant])
                else:
                    self._deactivate(head)

    def promote(self, now: float, backfill: float, limit: int) -> int:
        """Young heads that have waited ``backfill`` by ``now`` become old, oldest first (by enqueue
        time, then seq), at most ``limit`` of them; returns how many."""
        age, in_order, heads = self.age, self.age_in_order, self.heads
        promoted = 0
        while promoted < limit:
            if in_order and (not age or in_order[0] <= age[0]):
                entry, ordered = in_order[0], True
            elif age:
                entry, ordered = age[0], False
            else:
                break
            enq, seq, tier, tenant = entry
            head = heads.get((tier, tenant))
            stale = head is None or head.old or head.ticket.seq != seq  # granted, withdrawn, displaced
            if not stale and not now - enq >= backfill:
                break
            if ordered:
                in_order.popleft()
            else:
                heapq.heappop(age)
            if head is None or stale:
                continue
            promoted += 1
            head.old = True
            group, key = head.group, head.key
            if group is not None and key is not None:  # active (a parked head only keeps the flag)
                group.young.remove(key)
                group.n_young -= 1
                group.drop_cost(head.ticket.demand.cost)
                group.n_old += 1
                group.push_old(key)
        return promoted

    def clear(self) -> None:
        self.heads.clear()
        self.groups.clear()
        self.private.clear()
        self.age.clear()
        self.age_in_order.clear()
        self.split.clear()

    # ---- internals ----

    def _activate(self, head: Head, counter: float) -> None:
        by_pools = self.groups.get(head.tier)
        if by_pools is None:
            by_pools = self.groups[head.tier] = {}
        group = by_pools.get(head.shared)
        if group is None:
            group = by_pools[head.shared] = Group(head.tier, head.shared, self.heads)
        key = (counter, head.rank_seq, head.tenant)
        head.group, head.key = group, key
        if head.old:
            group.n_old += 1
            group.push_old(key)
        else:
            group.young.add(key)
            group.n_young += 1
            group.add_cost(head.ticket.demand.cost)

    def _deactivate(self, head: Head) -> None:
        group, key = head.group, head.key
        assert group is not None and key is not None
        if head.old:
            group.n_old -= 1  # its heap entry goes stale
        else:
            group.young.remove(key)
            group.n_young -= 1
            group.drop_cost(head.ticket.demand.cost)
        head.group = head.key = None
        if not group.n_young and not group.n_old:
            by_pools = self.groups[group.tier]
            if by_pools.get(group.pools) is group:
                del by_pools[group.pools]
                if not by_pools:
                    del self.groups[group.tier]

    def _rebuild_age(self) -> None:
        self.age = []
        self.age_in_order = deque(
            sorted(
                (h.ticket.enqueued_at, h.ticket.seq, h.tier, h.tenant)
                for h in self.heads.values()
                if not h.old
            )
        )

    def has_young(self) -> bool:
        """Whether any entry for ``promote`` is left (possibly stale)."""
        return bool(self.age or self.age_in_order)


def private_ok(head: Head, layout: BudgetLayout, in_flight: Mapping[str, int]) -> bool:
    cost = head.ticket.demand.cost
    pools = layout.pools
    for name in head.private:
        if in_flight.get(name, 0) + cost > pools[name].capacity:
            return False
    return True

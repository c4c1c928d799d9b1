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
  young or old too. Young heads are in order by ``(counter, rank_seq, tenant)`` (short sorted
  buckets, budgets/sorted_keys.py: the pass asks for the first one above its cursor), and counted
  per cost, with the costs there are in a tree (the pass asks "can any young head of this group
  fit?" of the lowest cost). Old heads are in a tree by
  ``(counter, rank_seq, tenant)`` (the lowest one either fits or holds the group's pools, so
  nothing but the minimum is ever needed). Young heads, parked or not, are also ordered by enqueue
  time for ``promote``: in a FIFO while they come in that order (a new ticket that is head at once,
  enqueued at the latest ``now``), in a tree when not (a successor, enqueued earlier behind its
  queue's head); ``promote`` takes the lower of the two fronts. With a hundred thousand waiting
  tenants each new ticket is a head, and the FIFO's front is one step where a tree's is seventeen.
- Every structure is exact: a head that leaves, moves or changes rank takes its entry out (or
  moves it) at once, at O(log n) at worst (budgets/min_tree.py). Lazy heaps, which leave an entry
  behind and drop it when it surfaces, were cheaper on average and unbounded at the worst moment:
  after a round in which every backlogged tenant was served once, all their outdated entries
  surfaced in one grant pass (235–355 ms at 100,000 waiting tenants; docs/benchmarks.md,
  "Every step bounded").

Redis keeps the same structures in sorted sets (budgets/redis/lua/lib.lua).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from budgets.min_tree import MinMap, MinTree, MostlyInOrder
from budgets.sorted_keys import SortedKeys
from budgets.types import BudgetLayout, Demand

Key = tuple[float, int, str]  # (counter, rank_seq, tenant): the rank of a head inside its tier
NO_KEY: Key = (math.inf, 0, "")  # above every rank: an empty slot of a group's ``old``
AgeKey = tuple[float, int, str, str]  # (enqueued_at, seq, tier, tenant) of a young head
NO_AGE: AgeKey = (math.inf, 0, "", "")


@dataclass(slots=True)
class Ticket:
    seq: int
    demand: Demand
    enqueued_at: float


class Group:
    """Active heads of one tier whose demands name the same shared pools (``pools``, sorted)."""

    __slots__ = (
        "cost_order",
        "costs",
        "limits",
        "limits_of",
        "old",
        "pools",
        "tier",
        "young",
    )

    def __init__(self, tier: str, pools: tuple[str, ...]) -> None:
        self.tier = tier
        self.pools = pools
        self.young: SortedKeys[Key] = SortedKeys()  # Key of each young head
        # cost -> young heads with that cost (> 0), and those costs in a tree: one entry per
        # distinct cost, so as many as there are heads at worst and far fewer where costs repeat
        # (the same prompt and max_tokens, a benchmark), small and hot in the caches there.
        self.costs: dict[int, int] = {}
        self.cost_order: MinMap[int, float] = MinMap(math.inf)
        self.old: MinTree[Key] = MinTree(NO_KEY)  # Key of each old head, in the head's ``slot``
        # (pool, limit for this tier) of each pool, under the layout ``limits_of`` (the pass's room)
        self.limits: tuple[tuple[str, int], ...] = ()
        self.limits_of: BudgetLayout | None = None

    def __bool__(self) -> bool:
        return self.young.n > 0 or self.old.n > 0

    def lowest_old(self) -> Key | None:
        """The lowest-ranked old head's key."""
        key = self.old.cells[1]
        return None if key is NO_KEY else key

    def lowest_young_cost(self) -> float:
        """The lowest cost of a young head (``math.inf`` when none is young)."""
        return self.cost_order.cells[1]

    def add_cost(self, cost: int) -> None:
        """A young head with ``cost`` joined the group."""
        costs = self.costs
        n = costs.get(cost)
        if n is not None:
            costs[cost] = n + 1
            return
        costs[cost] = 1
        self.cost_order.set(cost, cost)

    def drop_cost(self, cost: int) -> None:
        """A young head with ``cost`` left the group, or young."""
        costs = self.costs
        n = costs[cost] - 1
        if n:
            costs[cost] = n
        else:
            del costs[cost]
            self.cost_order.discard(cost)


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
    slot: int = -1  # its key's slot in its group's ``old`` (active and old heads only)


class QueueIndex:
    """Heads of every ``(tier, tenant)`` FIFO, grouped for the grant pass (module docstring)."""

    __slots__ = ("age", "age_floor", "groups", "heads", "private", "split")

    def __init__(self) -> None:
        self.heads: dict[tuple[str, str], Head] = {}
        self.groups: dict[str, dict[tuple[str, ...], Group]] = {}  # tier -> shared pools -> group
        # private pool -> the head naming it, or a list of them (a tenant's own budget: one head per
        # tier, so nearly always one head and no container to make, drop and collect per head)
        self.private: dict[str, Head | list[Head]] = {}
        # Each young head's (enqueued_at, seq, tier, tenant), by (tier, tenant), for ``promote``;
        # a head leaving young leaves it at once.
        self.age: MostlyInOrder[tuple[str, str], AgeKey] = MostlyInOrder(NO_AGE)
        # At most the lowest enqueue time in ``age`` (lowered by each add, raised to the true lowest
        # when ``promote`` finds nothing aged): most passes promote nothing, and learn it here.
        self.age_floor = math.inf
        # demand pools -> (shared pools sorted, private pools) under the indexed layout
        self.split: dict[tuple[str, ...], tuple[tuple[str, ...], tuple[str, ...]]] = {}

    # ---- heads ----

    def add(
        self,
        queue: tuple[str, str],
        ticket: Ticket,
        layout: BudgetLayout,
        counter: float,
        in_flight: Mapping[str, int],
        now: float,
        old: bool = False,
        rank_seq: int | None = None,
    ) -> Head:
        """Index the new head of a queue: old if ``old`` or if it has waited ``backfill_limit_s`` by
        ``now``; ranked with ``rank_seq`` (the queue's lowest seq; default the ticket's own).
        ``queue`` is ``(tier, tenant)``, the caller's key object: the index keeps it rather than a
        copy (everything kept here outlives a young collection, which walks it first)."""
        tier, tenant = queue
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
            enq = ticket.enqueued_at
            self.age.add(queue, (enq, ticket.seq, tier, tenant))
            if enq < self.age_floor:
                self.age_floor = enq
        self.heads[queue] = head
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
        queue = (head.tier, head.tenant)
        del self.heads[queue]
        if not head.old:
            self.age.discard(queue)
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
            group.old.change(head.slot, new)
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
        if not now - self.age_floor >= backfill:  # (no young head at all: the floor is infinite)
            return 0
        age, heads = self.age, self.heads
        promoted = 0
        while promoted < limit:
            enq, _, tier, tenant = age.lowest()
            if not now - enq >= backfill:  # (also when none is young: NO_AGE's time is infinite)
                self.age_floor = enq
                break
            queue = (tier, tenant)
            age.discard(queue)
            head = heads[queue]
            promoted += 1
            head.old = True
            group, key = head.group, head.key
            if group is not None and key is not None:  # active (a parked head only keeps the flag)
                group.young.remove(key)
                group.drop_cost(head.ticket.demand.cost)
                head.slot = group.old.add(key)
        return promoted

    def clear(self) -> None:
        self.heads.clear()
        self.groups.clear()
        self.private.clear()
        self.age = MostlyInOrder(NO_AGE)
        self.age_floor = math.inf
        self.split.clear()

    # ---- internals ----

    def _activate(self, head: Head, counter: float) -> None:
        by_pools = self.groups.get(head.tier)
        if by_pools is None:
            by_pools = self.groups[head.tier] = {}
        group = by_pools.get(head.shared)
        if group is None:
            group = by_pools[head.shared] = Group(head.tier, head.shared)
        key = (counter, head.rank_seq, head.tenant)
        head.group, head.key = group, key
        if head.old:
            head.slot = group.old.add(key)
        else:
            group.young.add(key)
            group.add_cost(head.ticket.demand.cost)

    def _deactivate(self, head: Head) -> None:
        group, key = head.group, head.key
        assert group is not None and key is not None
        if head.old:
            group.old.remove(head.slot)
            head.slot = -1
        else:
            group.young.remove(key)
            group.drop_cost(head.ticket.demand.cost)
        head.group = head.key = None
        if not group.young.n and not group.old.n:
            by_pools = self.groups[group.tier]
            if by_pools.get(group.pools) is group:
                del by_pools[group.pools]
                if not by_pools:
                    del self.groups[group.tier]

    def has_young(self) -> bool:
        """Whether any head is young (parked or not)."""
        age = self.age
        return bool(age.fifo) or bool(age.tree.slots)  # (MostlyInOrder.__bool__, without the call)


def private_ok(head: Head, layout: BudgetLayout, in_flight: Mapping[str, int]) -> bool:
    demand = head.ticket.demand
    pools = layout.pools
    for name in head.private:
        if in_flight.get(name, 0) + demand.held_in(name) > pools[name].capacity:
            return False
    return True

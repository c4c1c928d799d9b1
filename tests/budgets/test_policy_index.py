"""The indexed grant pass makes exactly the decisions its spec describes (budgets/policy.py).

Two references, both written the slow obvious way (every head looked at on every step):

- ``spec_pass``: the pass exactly as the policy docstring writes it. The indexed pass must grant the
  same tickets in the same order for any state: any demands, any ``max_scan``.
- ``rescanning_pass``: the pass as it was before the index (every head charged to ``max_scan``, and a
  ticket on a held pool still holding its other pools). With every demand naming at most one shared
  pool and ``max_scan`` never reached, the two rules coincide: the indexed pass must then decide
  exactly what the old one did.

Hypothesis drives random sequences (enqueue, release with usage, withdraw, time, counters set by
hand, layout changes, forgetting idle tenants) and compares before every pass.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import replace
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from budgets import policy
from budgets.policy import PolicyState
from budgets.queue_index import Group
from budgets.types import Demand, NeverFits, TenantSpec
from tests.budgets.support import TIER_NAMES, layout, private, shared
from tests.support import examples

TENANTS = ("a", "b", "c", "d")
P, Q, R = "backend:p", "backend:q", "class:r"
POOLS = [
    shared(P, 60),
    shared(Q, 40),
    shared(R, 50),
    private("tenant:a", 30),
    private("tenant:b", 50),
    private("tenant:c", 25),
]
ONE_SHARED = ((P,), (Q,), ())
MANY_SHARED = ((P,), (Q,), (), (P, Q), (P, R), (Q, R, P))


def _rank_tiers(state: PolicyState) -> list[str]:
    return [t.name for t in sorted(state.layout.tiers.values(), key=lambda t: (t.rank, t.name))]


def _copy(state: PolicyState) -> tuple[dict[str, float], dict[str, int], dict[tuple[str, str], deque[Any]]]:
    return dict(state.counters), dict(state.in_flight), {k: deque(v) for k, v in state.queues.items() if v}


def _grant(
    state: PolicyState, counters: dict[str, float], in_flight: dict[str, int], fifo: deque[Any]
) -> int:
    ticket = fifo.popleft()
    d = ticket.demand
    for name in d.pools:
        in_flight[name] = in_flight.get(name, 0) + d.cost
    counters[d.tenant] = counters.get(d.tenant, 0.0) + policy.prompt_service(state.layout, d)
    return int(ticket.seq)


def spec_pass(state: PolicyState, now: float, old_heads: set[int]) -> list[int]:
    """The grant pass of the policy docstring, looking at every head at every step. ``old_heads``:
    the seqs of the heads that are old (the caller's record, updated here)."""
    lay = state.layout
    pools, pol = lay.pools, lay.policy
    counters, in_flight, queues = _copy(state)
    aged = sorted(
        (f[0].enqueued_at, f[0].seq)
        for f in queues.values()
        if f[0].seq not in old_heads and now - f[0].enqueued_at >= pol.backfill_limit_s
    )
    old_heads.update(seq for _, seq in aged[: pol.max_scan])
    budget = pol.max_scan
    held_all: set[str] = set()
    granted: list[int] = []
    for tier_name in _rank_tiers(state):
        tier = lay.tiers[tier_name]
        held_lower: set[str] = set()
        cursor: tuple[float, int, str] | None = None
        while True:
            if budget == 0:
                return granted
            cands = []
            for (t, tenant), fifo in queues.items():
                if t != tier_name or not fifo:
                    continue
                head = fifo[0]
                d = head.demand
                rank = (counters[tenant], head.seq, tenant)
                if cursor is not None and rank <= cursor:
                    continue
                if any(
                    not pools[p].shared and in_flight.get(p, 0) + d.cost > pools[p].capacity for p in d.pools
                ):
                    continue
                group = frozenset(p for p in d.pools if pools[p].shared)
                if group & held_all:
                    continue
                room = min(
                    (policy.pool_limit(pools[p], tier) - in_flight.get(p, 0) for p in group), default=math.inf
                )
                old = head.seq in old_heads
                cands.append((rank, group, old, d.cost <= room, fifo))
            fitting = {group for _, group, old, fit, _ in cands if fit and not old}
            eligible = [c for c in cands if c[2] or c[1] in fitting]
            if not eligible:
                for c in cands:
                    held_lower |= c[1]
                break
            rank, group, old, fit, fifo = min(eligible, key=lambda c: c[0])
            for c in cands:
                if c[0] < rank:
                    held_lower |= c[1]
            budget -= 1
            cursor = rank
            if fit:
                granted.append(_grant(state, counters, in_flight, fifo))
                if fifo and now - fifo[0].enqueued_at >= pol.backfill_limit_s:
                    old_heads.add(fifo[0].seq)  # aged already when it becomes head
            else:
                held_lower |= group
                if old:
                    held_all |= group
        held_all |= held_lower
    return granted


def rescanning_pass(state: PolicyState, now: float) -> list[int]:
    """The grant pass before the index (every examined head counted, held heads still holding)."""
    lay = state.layout
    pools, pol = lay.pools, lay.policy
    counters, in_flight, queues = _copy(state)
    held_all: set[str] = set()
    scanned = 0
    granted: list[int] = []
    for tier_name in _rank_tiers(state):
        tier = lay.tiers[tier_name]
        held_lower: set[str] = set()
        candidates = {tenant for (t, tenant) in queues if t == tier_name and queues[(t, tenant)]}
        while candidates and scanned < pol.max_scan:
            tenant = min(candidates, key=lambda n: (counters[n], queues[(tier_name, n)][0].seq, n))
            fifo = queues[(tier_name, tenant)]
            head = fifo[0]
            d = head.demand
            scanned += 1
            private_ok = all(
                in_flight.get(p, 0) + d.cost <= pools[p].capacity for p in d.pools if not pools[p].shared
            )
            sh = [p for p in d.pools if pools[p].shared]
            full = any(in_flight.get(p, 0) + d.cost > policy.pool_limit(pools[p], tier) for p in sh)
            held = any(p in held_all for p in sh)
            if private_ok and not full and not held:
                granted.append(_grant(state, counters, in_flight, fifo))
                if not fifo:
                    candidates.discard(tenant)
            else:
                candidates.discard(tenant)
                if private_ok and full:
                    held_lower |= set(sh)
                    if now - head.enqueued_at >= pol.backfill_limit_s:
                        held_all |= set(sh)
        held_all |= held_lower
        if scanned >= pol.max_scan:
            break
    return granted


def check_index(s: PolicyState, old: set[int]) -> None:
    """The index is exactly the derived state the policy says it is."""
    idx = s.index
    assert set(idx.heads) == set(s.queues)
    active = 0
    for (tier, tenant), fifo in s.queues.items():
        head = idx.heads[(tier, tenant)]
        d = head.ticket.demand
        assert head.ticket is fifo[0]
        assert head.old == (head.ticket.seq in old)
        ok = all(s.in_flight.get(p, 0) + d.cost <= s.layout.pools[p].capacity for p in head.private)
        assert (head.group is not None) == ok
        if head.group is not None:
            active += 1
            assert head.key == (s.counters[tenant], head.ticket.seq, tenant)
            if head.old:
                assert head.group.old.cells[head.group.old.cap + head.slot] == head.key
            else:
                assert head.key in head.group.young
    groups = [g for gs in idx.groups.values() for g in gs.values()]
    assert active == sum(len(g.young) + len(g.old) for g in groups)  # nothing else is held
    ahead: dict[tuple[str, str], int] = {}
    tiers: dict[str, int] = {}
    for t in s.waiting.values():
        tiers[t.demand.tier] = tiers.get(t.demand.tier, 0) + 1
        for p in t.demand.pools:
            if t.demand.cost:
                ahead[(p, t.demand.tier)] = ahead.get((p, t.demand.tier), 0) + t.demand.cost
    assert ahead == s.ahead and tiers == s.tier_waiting


class Driver:
    def __init__(self, max_scan: int, pool_sets: tuple[tuple[str, ...], ...]) -> None:
        tenants = [TenantSpec("a", 1.0), TenantSpec("b", 2.0), TenantSpec("c", 0.5), TenantSpec("d", 1.0)]
        self.base = layout(POOLS, tenants, backfill_limit_s=1.0, max_scan=max_scan, idle_forget_s=3.0)
        self.state = PolicyState(self.base)
        self.pool_sets = pool_sets
        self.leases: list[Demand] = []
        self.now = 0.0
        self.heads: set[int] = set()  # tickets seen as heads so far
        self.old: set[int] = set()  # heads that are old (the spec's record, kept by spec_pass)

    def new_heads(self) -> None:
        """Tickets that became head outside a pass are old at once if aged by the latest pass's now."""
        s = self.state
        for fifo in s.queues.values():
            head = fifo[0]
            if head.seq not in self.heads:
                self.heads.add(head.seq)
                if s.clock - head.enqueued_at >= s.layout.policy.backfill_limit_s:
                    self.old.add(head.seq)

    def grant(self, compare_rescanning: bool) -> None:
        self.new_heads()
        expected = spec_pass(self.state, self.now, self.old)
        old = rescanning_pass(self.state, self.now) if compare_rescanning else expected
        got = policy.grant_pass(self.state, self.now)
        assert [t.seq for t in got] == expected
        assert expected == old
        self.leases += [t.demand for t in got]
        self.heads.update(f[0].seq for f in self.state.queues.values())  # new heads of the pass

    def step(self, op: tuple[Any, ...], compare_rescanning: bool) -> None:
        kind = op[0]
        s = self.state
        if kind == "enq":
            _, tenant, tier, pools_i, prefill, decode = op
            own = (f"tenant:{tenant}",) if f"tenant:{tenant}" in s.layout.pools else ()
            d = Demand(tenant, tier, self.pool_sets[pools_i % len(self.pool_sets)] + own, prefill, decode)
            try:
                policy.check_demand(s.layout, d)
            except NeverFits:
                return
            if policy.grant_immediately(s, d):
                self.leases.append(d)
                return
            policy.enqueue(s, d, self.now)
        elif kind == "rel" and self.leases:
            d = self.leases.pop(op[1] % len(self.leases))
            policy.release(s, d, op[2], self.now)
        elif kind == "wd" and s.waiting:
            seq = sorted(s.waiting)[op[1] % len(s.waiting)]
            policy.withdraw(s, seq, self.now)
        elif kind == "tick":
            self.now += op[1]
            policy.forget_idle(s, self.now)
        elif kind == "counter" and s.counters:
            tenant = sorted(s.counters)[op[1] % len(s.counters)]
            policy.set_counter(s, tenant, op[2])
        elif kind == "layout":
            pools = dict(s.layout.pools)
            pools[P] = shared(P, op[1])
            pools["tenant:a"] = private("tenant:a", op[2])
            policy.apply_layout(s, replace(self.base, pools=pools))
        self.grant(compare_rescanning)
        check_index(s, self.old)


def ops(one_shared: bool) -> st.SearchStrategy[list[tuple[Any, ...]]]:
    enq = st.tuples(
        st.just("enq"),
        st.sampled_from(TENANTS),
        st.sampled_from(TIER_NAMES),
        st.integers(0, 5),
        st.sampled_from([0, 3, 8, 15, 25]),
        st.sampled_from([0, 5, 10]),
    )
    rel = st.tuples(st.just("rel"), st.integers(0, 50), st.one_of(st.none(), st.integers(0, 10)))
    wd = st.tuples(st.just("wd"), st.integers(0, 50))
    tick = st.tuples(st.just("tick"), st.sampled_from([0.2, 0.6, 1.1, 4.0]))
    counter = st.tuples(st.just("counter"), st.integers(0, 5), st.sampled_from([0.0, 5.0, 20.0, 80.0]))
    relayout = st.tuples(st.just("layout"), st.sampled_from([30, 60, 90]), st.sampled_from([20, 30, 60]))
    choices = [enq, enq, enq, rel, rel, wd, tick, counter]
    if not one_shared:
        choices.append(relayout)  # a shrunken P can make a ticket never fit: beyond the old pass's scope
    return st.lists(st.one_of(*choices), max_size=70)


@pytest.mark.slow  # hypothesis, a few hundred sequences
@settings(max_examples=examples(300), deadline=None)
@given(steps=ops(one_shared=False), max_scan=st.sampled_from([1, 2, 3, 5, 256]))
def test_indexed_pass_follows_its_spec_for_any_state(steps: list[tuple[Any, ...]], max_scan: int) -> None:
    driver = Driver(max_scan, MANY_SHARED)
    for op in steps:
        driver.step(op, compare_rescanning=False)


@settings(max_examples=examples(150), deadline=None)
@given(steps=ops(one_shared=True))
def test_indexed_pass_decides_what_the_rescanning_pass_did(steps: list[tuple[Any, ...]]) -> None:
    driver = Driver(10_000, ONE_SHARED)
    for op in steps:
        driver.step(op, compare_rescanning=True)


def test_a_head_blocked_by_its_own_budget_is_parked_until_that_budget_moves() -> None:
    state = PolicyState(layout([shared(P, 100), private("tenant:a", 10)], ["a", "b"]))
    assert policy.grant_immediately(state, Demand("a", "critical", (P, "tenant:a"), 10, 0))
    policy.enqueue(state, Demand("a", "critical", (P, "tenant:a"), 5, 0), now=0.0)
    head = state.index.heads[("critical", "a")]
    assert head.group is None  # parked: no pass looks at it
    policy.release(state, Demand("a", "critical", (P, "tenant:a"), 10, 0), None, now=0.0)
    assert head.group is not None
    assert [t.demand.tenant for t in policy.grant_pass(state, 0.0)] == ["a"]


def test_a_held_group_costs_the_pass_nothing() -> None:
    # 2,000 tenants blocked behind an old head on P: the pass examines that head and stops; with
    # max_scan 3 a ticket on Q behind all of them is still reached.
    tenants = [f"t{i}" for i in range(2000)]
    state = PolicyState(
        layout([shared(P, 100), shared(Q, 100)], [*tenants, "q"], backfill_limit_s=0.0, max_scan=3)
    )
    assert policy.grant_immediately(state, Demand("t0", "critical", (P,), 100, 0))
    for t in tenants:
        policy.enqueue(state, Demand(t, "critical", (P,), 50, 0), now=0.0)
    policy.set_counter(state, "q", 1e9)  # ranked after every tenant on P
    policy.enqueue(state, Demand("q", "critical", (Q,), 10, 0), now=0.0)
    assert [t.demand.tenant for t in policy.grant_pass(state, 0.0)] == ["q"]


def test_a_new_head_that_cannot_fit_leaves_a_settled_state_settled() -> None:
    # A full pool: a settled pass granted nothing. New heads that cannot fit (more than the room
    # left, or parked by the tenant's own budget) leave the state settled, so their passes return
    # at once; one that fits the room unsettles it, and its pass grants it.
    state = PolicyState(layout([shared(P, 100), private("tenant:a", 30)], ["a", "b", "c", "d"]))
    assert policy.grant_immediately(state, Demand("d", "critical", (P,), 95, 0))
    assert policy.grant_immediately(state, Demand("a", "critical", ("tenant:a",), 28, 0))
    policy.enqueue(state, Demand("b", "critical", (P,), 10, 0), now=0.0)
    assert policy.grant_pass(state, 0.0) == [] and state.settled
    policy.enqueue(state, Demand("c", "critical", (P,), 6, 0), now=0.0)  # more than the 5 left
    assert state.settled
    policy.enqueue(state, Demand("a", "standard", (P, "tenant:a"), 5, 0), now=0.0)  # 28 + 5 > 30
    assert state.index.heads[("standard", "a")].group is None and state.settled
    assert policy.grant_pass(state, 0.0) == []
    policy.enqueue(state, Demand("a", "critical", (P, "tenant:a"), 2, 0), now=0.0)  # fits both
    assert not state.settled
    assert [(t.demand.tenant, t.demand.tier) for t in policy.grant_pass(state, 0.0)] == [("a", "critical")]


def test_young_costs_are_counted_and_a_cost_no_young_head_has_leaves_at_once() -> None:
    group = Group("critical", (P,))
    for cost in range(1, 201):  # 200 young heads, each with a cost of its own
        group.add_cost(cost)
    for cost in range(2, 201):  # all but the cheapest leave
        group.drop_cost(cost)
    assert group.lowest_young_cost() == 1 and group.costs == {1: 1} and group.cost_order.keys() == [1]
    group.add_cost(500)
    assert group.costs == {1: 1, 500: 1} and sorted(group.cost_order.keys()) == [1, 500]
    group.drop_cost(1)
    assert group.lowest_young_cost() == 500
    group.add_cost(500)  # a second head with the same cost: counted, no second entry
    assert group.costs == {500: 2} and group.cost_order.keys() == [500]
    group.drop_cost(500)
    group.drop_cost(500)
    assert group.lowest_young_cost() == math.inf and not group.costs


def test_heads_of_several_tiers_on_one_private_pool_are_parked_and_woken_together() -> None:
    state = PolicyState(layout([shared(P, 100), private("tenant:a", 30)], ["a", "b"]))
    assert policy.grant_immediately(state, Demand("a", "critical", ("tenant:a",), 25, 0))
    for tier in ("critical", "standard", "batch"):  # each 25 + 10 > 30: parked
        policy.enqueue(state, Demand("a", tier, (P, "tenant:a"), 10, 0), now=0.0)
    heads = [state.index.heads[(tier, "a")] for tier in ("critical", "standard", "batch")]
    assert state.index.private["tenant:a"] == heads and all(h.group is None for h in heads)
    policy.release(state, Demand("a", "critical", ("tenant:a",), 25, 0), None, now=0.0)
    assert all(h.group is not None for h in heads)  # all three woken by the one release
    granted = policy.grant_pass(state, 0.0)
    assert [t.demand.tier for t in granted] == ["critical", "standard", "batch"]
    assert "tenant:a" not in state.index.private and state.in_flight == {P: 30, "tenant:a": 30}


def test_heads_age_oldest_first_whether_they_became_heads_in_order_or_not() -> None:
    # New tickets that are heads at once come in enqueue order (the FIFO); a successor of a granted
    # head was enqueued earlier than the heads before it (the heap). promote takes the oldest of
    # both, at most ``limit`` per call; a head that leaves takes its entry with it.
    state = PolicyState(layout([shared(P, 100)], ["a", "b", "c"], backfill_limit_s=2.0))
    assert policy.grant_immediately(state, Demand("c", "critical", (P,), 100, 0))
    policy.enqueue(state, Demand("a", "critical", (P,), 60, 0), now=0.0)
    policy.enqueue(state, Demand("a", "critical", (P,), 60, 0), now=0.5)  # behind a's head
    policy.enqueue(state, Demand("b", "critical", (P,), 60, 0), now=1.0)
    index = state.index
    assert [e[0] for e in index.age.fifo.values()] == [0.0, 1.0] and not index.age.tree
    policy.release(state, Demand("c", "critical", (P,), 100, 0), None, now=1.2)
    [granted] = policy.grant_pass(state, 1.2)  # a's head; its successor (enqueued at 0.5) is head
    assert granted.demand.tenant == "a" and granted.enqueued_at == 0.0
    assert [e[0] for e in index.age.tree.keys()] == [0.5]  # out of order: older than b's 1.0 in the FIFO
    assert [e[0] for e in index.age.fifo.values()] == [1.0]  # a's granted head left it
    heads = index.heads
    assert index.promote(2.6, 2.0, limit=1) == 1  # a's successor, 2.1 s old
    assert heads[("critical", "a")].old and not heads[("critical", "b")].old
    assert index.promote(2.6, 2.0, limit=5) == 0  # b has waited 1.6 s
    assert index.promote(3.0, 2.0, limit=5) == 1 and heads[("critical", "b")].old
    assert not index.has_young()

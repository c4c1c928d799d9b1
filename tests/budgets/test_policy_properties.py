"""Property tests of budgets.policy over random operation sequences (hypothesis)."""

from __future__ import annotations

import copy
import dataclasses
import math
from collections import Counter

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from budgets import policy
from budgets.policy import PolicyState
from budgets.types import QUEUE_ORDERS, Demand, NeverFits, QueueOrder, TenantSpec
from tests.budgets.support import TIER_NAMES, layout, private, shared
from tests.support import examples

TENANTS = ("a", "b", "c")
POOL_CHOICES = (("backend:p",), ("backend:q",), ("backend:p", "backend:q"))
POOLS = [
    shared("backend:p", 60),
    shared("backend:q", 40),
    private("tenant:a", 30),
    private("tenant:b", 50),
]

enqueue_op = st.tuples(
    st.just("enq"),
    st.sampled_from(TENANTS),
    st.sampled_from(TIER_NAMES),
    st.sampled_from(POOL_CHOICES),
    st.integers(0, 30),
    st.integers(0, 20),
    # How much more than it reserves the request may produce (held in its tenant's pool).
    st.sampled_from([0, 0, 0, 5, 15]),
)
release_op = st.tuples(st.just("rel"), st.integers(0, 50), st.one_of(st.none(), st.integers(-5, 40)))
withdraw_op = st.tuples(st.just("wd"), st.integers(0, 50))
tick_op = st.tuples(st.just("tick"), st.sampled_from([0.1, 0.5, 1.5]))
grow_op = st.tuples(st.just("grow"), st.integers(0, 50), st.integers(1, 30))
# Weighted by sampling a kind first: st.one_of does not weigh a strategy listed twice.
OPS = {"enq": enqueue_op, "rel": release_op, "wd": withdraw_op, "tick": tick_op, "grow": grow_op}
ops_strategy = st.lists(
    st.sampled_from(["enq", "enq", "enq", "rel", "rel", "wd", "tick", "tick", "grow"]).flatmap(
        OPS.__getitem__
    ),
    max_size=60,
)


# For shortest_first: deep queues of one tenant with mixed predicted outputs.
OPS_ORDERED = {
    **OPS,
    "enq": st.tuples(
        st.just("enq"),
        st.sampled_from(("a", "a", "c")),
        st.sampled_from(("critical", "critical", "standard")),
        st.sampled_from(POOL_CHOICES),
        st.integers(0, 10),
        st.integers(0, 20),
    ),
}
ordered_ops_strategy = st.lists(
    st.sampled_from(["enq", "enq", "enq", "enq", "rel", "wd", "tick", "tick"]).flatmap(
        OPS_ORDERED.__getitem__
    ),
    max_size=60,
)


class Model:
    """Drives a PolicyState the way a store does and checks invariants after every step."""

    def __init__(self, max_scan: int, order: QueueOrder = "fifo") -> None:
        tenants = [TenantSpec("a", weight=1.0), TenantSpec("b", weight=2.0), TenantSpec("c", weight=0.5)]
        lay = layout(POOLS, tenants, backfill_limit_s=1.0, max_scan=max_scan)
        # Defers of 0 to 1.2 s for decodes of 0 to 20, against clock ticks of 0.1 to 1.5 s.
        policy_spec = dataclasses.replace(
            lay.policy, tenant_queue_order=order, max_defer_s=1.2, defer_s_per_token=0.1
        )
        self.state = PolicyState(dataclasses.replace(lay, policy=policy_spec))
        self.leases: list[Demand] = []
        self.now = 0.0
        self.skips_checked = 0  # passes that ran on a settled state (checked against a full one)

    def demand(
        self, tenant: str, tier: str, pools: tuple[str, ...], prefill: int, decode: int, beyond: int = 0
    ) -> Demand:
        own = (f"tenant:{tenant}",) if tenant in ("a", "b") else ()
        return Demand(tenant, tier, pools + own, prefill, decode, decode + beyond if beyond else 0)

    def check_grants(self, before: dict[str, int], grants: list[Demand]) -> None:
        """Each grant, replayed in order, stayed within capacity and its tier's ceiling."""
        lay = self.state.layout
        running = dict(before)
        for d in grants:
            tier = lay.tiers[d.tier]
            for name in d.pools:
                running[name] = running.get(name, 0) + d.held_in(name)
                assert running[name] <= policy.pool_limit(lay.pools[name], tier)
        assert {k: v for k, v in running.items() if v} == self.state.in_flight

    def run_pass(self) -> None:
        before = dict(self.state.in_flight)
        counters = dict(self.state.counters)
        pending = len(self.state.waiting)
        waiting = list(self.state.waiting.values())
        full = None
        if self.state.settled:
            # A settled state may skip the pass: it must decide exactly what a full pass decides.
            twin = copy.deepcopy(self.state)
            twin.settled = False
            full = [t.seq for t in policy.grant_pass(twin, self.now)], twin.counters, twin.in_flight
        tickets = policy.grant_pass(self.state, self.now)
        if full is not None:
            assert full == ([t.seq for t in tickets], self.state.counters, self.state.in_flight)
            self.skips_checked += 1
        self.check_order(waiting, tickets)
        grants = [t.demand for t in tickets]
        self.check_grants(before, grants)
        self.leases.extend(grants)
        for tenant, value in counters.items():  # grants only ever raise counters
            assert self.state.counters[tenant] >= value
        if pending <= self.state.layout.policy.max_scan and not any(self.state.in_flight.values()):
            # Nothing in flight after a full pass: nothing can have been blocked, so nothing waits.
            assert not self.state.waiting

    def check_order(self, waiting: list[policy.Ticket], granted: list[policy.Ticket]) -> None:
        """A granted ticket passed no ticket of its own queue enqueued max_defer_s or more before it
        (shortest_first), or none at all (fifo). Tickets granted earlier in the pass do not count."""
        pol = self.state.layout.policy
        ordered = pol.tenant_queue_order == "shortest_first"
        left = {t.seq: t for t in waiting}
        for g in granted:
            del left[g.seq]
            for u in left.values():
                if (u.demand.tier, u.demand.tenant) == (g.demand.tier, g.demand.tenant) and u.seq < g.seq:
                    assert ordered, (g, u)
                    # (1e-9: the clock is a sum of float ticks, the bound is exact in the key)
                    assert g.enqueued_at - u.enqueued_at < pol.max_defer_s + 1e-9, (g, u)

    def enqueue(self, d: Demand) -> None:
        try:
            policy.check_demand(self.state.layout, d)
        except NeverFits:
            return
        if not self.state.waiting:
            # The fast path must decide exactly what enqueue + grant pass decides.
            twin = copy.deepcopy(self.state)
            policy.enqueue(twin, d, self.now)
            twin_grants = policy.grant_pass(twin, self.now)
            before = dict(self.state.in_flight)
            fast = policy.grant_immediately(self.state, d)
            assert fast == bool(twin_grants)
            if fast:
                assert self.state.counters == twin.counters
                self.check_grants(before, [d])
                self.leases.append(d)
                return
        policy.enqueue(self.state, d, self.now)
        self.run_pass()

    def step(self, op: tuple) -> None:  # type: ignore[type-arg]
        kind = op[0]
        if kind == "enq":
            self.enqueue(self.demand(*op[1:]))
        elif kind == "rel" and self.leases:
            d = self.leases.pop(op[1] % len(self.leases))
            counters = dict(self.state.counters)
            policy.release(self.state, d, op[2])
            # Only the releasing tenant is charged: the output served, never more than reserved.
            lay = self.state.layout
            most = lay.policy.decode_weight * d.decode / lay.tenants[d.tenant].weight
            for tenant, value in counters.items():
                charged = self.state.counters[tenant] - value
                assert 0 <= charged <= (most + 1e-9 if tenant == d.tenant else 0)
            self.run_pass()
        elif kind == "wd" and self.state.waiting:
            seq = sorted(self.state.waiting)[op[1] % len(self.state.waiting)]
            assert policy.withdraw(self.state, seq) is not None
            self.run_pass()
        elif kind == "tick":
            self.now += op[1]
            self.run_pass()
        elif kind == "grow" and self.leases:
            # A stream outgrows its reservation, within every pool's capacity (an overdraft is a
            # contract test): no later grant may then pass a pool's limit (check_grants).
            i = op[1] % len(self.leases)
            d = self.leases[i]
            pools, in_flight = self.state.layout.pools, self.state.in_flight

            def fits(tokens: int) -> bool:
                more = dataclasses.replace(d, decode=d.decode + tokens)
                return all(
                    in_flight.get(n, 0) + more.held_in(n) - d.held_in(n) <= pools[n].capacity for n in d.pools
                )

            tokens = op[2]
            while tokens > 0 and not fits(tokens):
                tokens -= 1
            if tokens > 0:
                grown, over = policy.extend(self.state, d, tokens)
                assert over == 0 and grown.cost == d.cost + tokens
                assert grown.private_cost == max(grown.cost, d.private_cost)  # its limit held already
                self.leases[i] = grown
        self.check_consistency()

    def check_consistency(self) -> None:
        s = self.state
        expected: Counter[str] = Counter()
        for d in self.leases:
            for name in d.pools:
                expected[name] += d.held_in(name)
        assert {k: v for k, v in expected.items() if v} == s.in_flight
        for name, used in s.in_flight.items():
            assert used <= s.layout.pools[name].capacity
        assert dict(Counter(d.tenant for d in self.leases)) == s.leases_by_tenant
        queued = [t for fifo in s.queues.values() for t in fifo]
        assert sorted(t.seq for t in queued) == sorted(s.waiting)
        assert all(fifo and list(fifo) == sorted(fifo, key=lambda t: t.seq) for fifo in s.queues.values())
        assert dict(Counter(t.demand.tenant for t in queued)) == s.tenant_waiting
        assert all(tenant in s.counters for tenant in s.tenant_waiting)
        pol = s.layout.policy
        ordered = pol.tenant_queue_order == "shortest_first"
        assert set(s.ordered) == (set(s.queues) if ordered else set())
        for key, fifo in s.queues.items():
            keys = sorted((policy.order_key(pol, t), t.seq) for t in fifo)
            head = s.index.heads[key]
            if ordered:
                assert s.ordered[key] == keys and head.ticket.seq == keys[0][1]
            else:
                assert head.ticket is fifo[0]
            assert head.rank_seq == fifo[0].seq  # the rank across tenants is the first ticket's
        for by_pools in s.index.groups.values():
            for group in by_pools.values():
                assert group  # (empty groups are dropped)
        check_lift_bases(s)

    def drain(self) -> None:
        """Owners release everything: every waiting ticket is eventually granted, then all is zero."""
        rounds = 0
        while self.state.waiting:
            rounds += 1
            assert rounds <= 200
            for d in self.leases:
                policy.release(self.state, d, None)
            self.leases.clear()
            self.run_pass()
            self.check_consistency()
        for d in self.leases:
            policy.release(self.state, d, None)
        self.leases.clear()
        assert self.state.in_flight == {} and self.state.leases_by_tenant == {}
        assert self.state.queues == {} and self.state.tenant_waiting == {}


@pytest.mark.slow  # hypothesis, 250 operation sequences
@settings(max_examples=examples(250), deadline=None)
@given(ops=ops_strategy, max_scan=st.sampled_from([1, 2, 5, 256]), order=st.sampled_from(QUEUE_ORDERS))
# A lease grows on its tenant's budget while that tenant's next request waits only for a shared
# pool: the grown budget must hold the request back when the shared pool frees.
@example(
    ops=[
        ("enq", "b", "critical", ("backend:p",), 30, 20),
        ("enq", "a", "critical", ("backend:q",), 5, 5),
        ("enq", "a", "critical", ("backend:p",), 10, 5),
        ("grow", 1, 10),
        ("rel", 0, None),
    ],
    max_scan=256,
    order="fifo",
)
def test_invariants_hold_for_any_operation_sequence(
    ops: list[tuple],  # type: ignore[type-arg]
    max_scan: int,
    order: QueueOrder,
) -> None:
    model = Model(max_scan, order)
    for op in ops:
        model.step(op)
    model.drain()


@pytest.mark.slow  # hypothesis, 250 operation sequences
@settings(max_examples=examples(250), deadline=None)
@given(ops=ordered_ops_strategy, max_scan=st.sampled_from([1, 2, 256]))
def test_invariants_hold_with_deep_shortest_first_queues(ops: list[tuple], max_scan: int) -> None:  # type: ignore[type-arg]
    model = Model(max_scan, "shortest_first")
    for op in ops:
        model.step(op)
    model.drain()


@settings(max_examples=examples(100), deadline=None)
@given(ops=ops_strategy, order=st.sampled_from(QUEUE_ORDERS))
def test_grant_pass_is_deterministic(ops: list[tuple], order: QueueOrder) -> None:  # type: ignore[type-arg]
    model = Model(256, order)
    for op in ops:
        model.step(op)
    twin = copy.deepcopy(model.state)
    a = [t.seq for t in policy.grant_pass(model.state, model.now + 3)]
    b = [t.seq for t in policy.grant_pass(twin, model.now + 3)]
    assert a == b and model.state.counters == twin.counters


def check_lift_bases(s: PolicyState) -> None:
    """Each counter is in the lift base its tenant's state names, and nowhere else."""
    c = s.counters
    backlogged = set(s.tenant_waiting)
    leased = set(s.leases_by_tenant) - backlogged
    idle = set(c) - backlogged - leased
    assert set(s.idle_order.fifo) | set(s.idle_order.tree.slots) == set(s.idle_since) <= idle
    assert len(s.idle_order) == len(s.idle_since)
    for base, members in ((s.backlog_min, backlogged), (s.lease_min, leased), (s.idle_min, idle)):
        assert set(base.slots) == members
        assert base.lowest() == min((c[t] for t in members), default=math.inf)
        assert sorted(base.keys()) == sorted(c[t] for t in members)

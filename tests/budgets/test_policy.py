"""Pure unit tests of budgets.policy: the exact decisions both stores must make."""

from __future__ import annotations

import pytest

from budgets import policy
from budgets.policy import PolicyState
from budgets.types import Demand, NeverFits, TenantSpec, TierSpec, UnknownTenantOrTier
from tests.budgets.support import FLAT, P, Q, demand, layout, private, shared


def state_with(*pools, tenants=("a", "b", "c"), tiers=None, **pol) -> PolicyState:  # type: ignore[no-untyped-def]
    return PolicyState(layout(pools, tenants, tiers=tiers, **pol))


def set_counters(state: PolicyState, **values: float) -> None:
    """Counters set by hand, through the policy (it keeps its index ranked by them)."""
    for tenant, value in values.items():
        policy.set_counter(state, tenant, value)


def hold(state: PolicyState, d: Demand) -> None:
    """Put a lease in flight directly (fast path on an empty queue)."""
    assert policy.grant_immediately(state, d)


def granted(state: PolicyState, now: float = 0.0) -> list[tuple[str, int]]:
    return [(t.demand.tenant, t.seq) for t in policy.grant_pass(state, now)]


# ---- limits and validation ----


def test_pool_limit_floors_the_ceiling_on_shared_pools_only() -> None:
    tier = TierSpec("batch", 2, ceiling=0.7)
    assert policy.pool_limit(shared(P, 101), tier) == 70
    assert policy.pool_limit(private("tenant:a", 101), tier) == 101


def test_check_demand_rejects_malformed_and_unknown() -> None:
    lay = layout([shared(P, 10)], ["a"])
    with pytest.raises(ValueError):
        policy.check_demand(lay, Demand("a", "critical", (P, P), 1, 0))
    with pytest.raises(ValueError):
        policy.check_demand(lay, Demand("a", "critical", (P,), -1, 0))
    with pytest.raises(UnknownTenantOrTier):
        policy.check_demand(lay, demand("b", 1, P))
    with pytest.raises(NeverFits):
        policy.check_demand(lay, demand("a", 11, P))
    policy.check_demand(lay, demand("a", 10, P))


# ---- virtual token counters ----


def test_grant_charges_the_prompt_and_release_the_output_served() -> None:
    state = PolicyState(
        layout([shared(P, 1000)], [TenantSpec("a", weight=4.0)], prefill_weight=1.0, decode_weight=3.0)
    )
    d = demand("a", 100, P, decode=20)
    hold(state, d)  # 80 * 1 / 4: the reserved output is not service yet
    assert state.counters["a"] == pytest.approx(20.0)
    policy.release(state, d, actual_decode=12)  # + 12 * 3 / 4
    assert state.counters["a"] == pytest.approx(29.0)


@pytest.mark.parametrize(
    ("reported", "served"),
    [
        (10, 10),  # honest
        (0, 0),
        (50, 50),  # the whole reservation
        (80, 50),  # more than the backend was allowed to write: a lie, clamped
        (10**30, 50),
        (-7, 0),  # a negative report refunds nothing
        (-(10**30), 0),
        (4.0, 4),  # a whole number in float form
        (None, 50),  # missing: charged as reserved
        (2.5, 50),  # not a token count: as missing
        (float("nan"), 50),
        (float("inf"), 50),
        (float("-inf"), 50),
        (True, 50),
        ("10", 50),
    ],
)
def test_release_charges_the_report_clamped_to_the_reservation(reported: object, served: int) -> None:
    state = state_with(shared(P, 1000), tiers=FLAT)
    d = demand("a", 100, P, tier="std", decode=50)
    hold(state, d)
    before = state.counters["a"]
    policy.release(state, d, reported)  # type: ignore[arg-type]
    assert policy.served_output(50, reported) == served
    assert state.counters["a"] == before + 2.0 * served
    assert state.in_flight == {} and state.leases_by_tenant == {}


def test_release_of_a_tenant_gone_from_the_layout_charges_nothing() -> None:
    state = state_with(shared(P, 1000), tiers=FLAT)
    d = demand("a", 100, P, tier="std", decode=50)
    hold(state, d)
    state.layout = layout([shared(P, 1000)], ["b"], tiers=FLAT)
    before = dict(state.counters)
    policy.release(state, d, 10)
    assert state.counters == before and state.in_flight == {}


def test_newcomer_lifted_beside_a_busy_tenant_wins_the_next_release() -> None:
    # At the policy level: reservations (1,992 each) are not service, so the newcomer's
    # lifted counter does not hold them, and a release serving "busy" 4 tokens puts it ahead.
    state = state_with(shared(P, 8000), tiers=FLAT)
    big = demand("a", 2000, P, tier="std", decode=1992)
    for _ in range(4):
        hold(state, big)
    for _ in range(27):
        policy.enqueue(state, big, now=0)
    policy.enqueue(state, demand("b", 2000, P, tier="std", decode=1992), now=0)
    assert state.counters["b"] == state.counters["a"] == 4 * 8.0  # prompts only
    policy.release(state, big, actual_decode=4)
    assert [t for t, _ in granted(state)] == ["b"]


def test_lift_prefers_other_backlogged_tenants() -> None:
    state = state_with(shared(P, 10), tiers=FLAT)
    set_counters(state, a=5.0, b=50.0, c=500.0)
    hold(state, demand("c", 10, P, tier="std"))  # c in flight at 510
    policy.enqueue(state, demand("b", 10, P, tier="std"), now=0)  # b backlogged at 50 (>= 510? no base:
    # nobody else backlogged, so the in-flight tenant c is the base: b lifted to 510)
    assert state.counters["b"] == 510.0
    policy.set_counter(state, "b", 50.0)
    policy.enqueue(state, demand("a", 10, P, tier="std"), now=0)  # base = min backlogged others = b
    assert state.counters["a"] == 50.0


def test_lift_never_lowers_and_skips_backlogged_tenants() -> None:
    state = state_with(shared(P, 10), tiers=FLAT)
    set_counters(state, a=100.0, b=10.0)
    policy.enqueue(state, demand("b", 20, P, tier="std"), now=0)
    policy.enqueue(state, demand("a", 20, P, tier="std"), now=0)
    assert state.counters["a"] == 100.0  # own is higher than the base
    policy.set_counter(state, "a", 1.0)
    policy.enqueue(state, demand("a", 20, P, tier="std"), now=0)  # already backlogged: no lift
    assert state.counters["a"] == 1.0


def test_lift_without_any_base() -> None:
    state = state_with(shared(P, 10), tiers=FLAT)
    policy.enqueue(state, demand("a", 20, P, tier="std"), now=0)
    assert state.counters == {"a": 0.0}  # first tenant ever: 0
    policy.withdraw(state, 1)
    set_counters(state, a=30.0, b=7.0)
    policy.enqueue(state, demand("a", 20, P, tier="std"), now=0)
    assert state.counters["a"] == 30.0  # known tenant, nobody else active: unchanged
    policy.withdraw(state, 2)
    policy.enqueue(state, demand("c", 20, P, tier="std"), now=0)
    assert state.counters["c"] == 7.0  # never seen, nobody active: min over all counters


# ---- the grant pass ----


def test_rank_is_tier_then_counter_then_arrival() -> None:
    state = state_with(shared(P, 100), shared(Q, 100))
    hold(state, demand("c", 100, P))
    policy.enqueue(state, demand("a", 10, P, tier="batch"), now=0)  # seq 1
    policy.enqueue(state, demand("b", 10, P, tier="standard"), now=0)  # seq 2
    policy.enqueue(state, demand("a", 10, P, tier="standard"), now=0)  # seq 3
    policy.enqueue(state, demand("c", 10, P, tier="standard"), now=0)  # seq 4
    set_counters(state, a=1.0, b=1.0, c=0.5)
    policy.release(state, demand("c", 100, P), None)
    assert granted(state) == [("c", 4), ("b", 2), ("a", 3), ("a", 1)]


def test_counters_update_within_a_pass() -> None:
    state = state_with(shared(P, 200), tiers=FLAT)
    hold(state, demand("c", 200, P, tier="std"))
    for _ in range(3):
        policy.enqueue(state, demand("a", 10, P, tier="std"), now=0)
        policy.enqueue(state, demand("b", 30, P, tier="std"), now=0)
    policy.release(state, demand("c", 200, P, tier="std"), None)
    # Both start level (lifted to c's 200); each grant raises only the grantee's counter:
    # a 210, b 230, a 220, a 230, then b (230, seq 2 < nothing of a left), b.
    assert [t for t, _ in granted(state)] == ["a", "b", "a", "a", "b", "b"]
    assert state.counters["a"] == 230.0 and state.counters["b"] == 290.0


def test_fifo_inside_a_tenant_even_when_a_later_ticket_would_fit() -> None:
    state = state_with(shared(P, 100), shared(Q, 100), tiers=FLAT)
    hold(state, demand("c", 95, P, tier="std"))
    policy.enqueue(state, demand("a", 10, P, tier="std"), now=0)
    policy.enqueue(state, demand("a", 10, Q, tier="std"), now=0)
    policy.enqueue(state, demand("b", 10, Q, tier="std"), now=0)
    assert granted(state) == [("b", 3)]


def test_tenant_pool_blocked_head_never_holds() -> None:
    state = state_with(shared(P, 100), private("tenant:a", 10), backfill_limit_s=1.0)
    hold(state, demand("a", 10, P, "tenant:a"))
    policy.enqueue(state, demand("a", 10, P, "tenant:a", tier="critical"), now=0)
    policy.enqueue(state, demand("b", 60, P, tier="batch"), now=0)
    assert granted(state, now=100.0) == [("b", 2)]


def test_ticket_blocked_by_tenant_and_shared_pool_does_not_hold() -> None:
    state = state_with(shared(P, 100), private("tenant:a", 10), tiers=FLAT, backfill_limit_s=0.0)
    hold(state, demand("a", 10, P, "tenant:a", tier="std"))
    hold(state, demand("c", 85, P, tier="std"))
    policy.enqueue(state, demand("a", 10, P, "tenant:a", tier="std"), now=0)  # fails both pools
    policy.enqueue(state, demand("b", 5, P, tier="std"), now=0)
    assert granted(state, now=10.0) == [("b", 2)]


def test_backfill_until_the_limit_then_hold() -> None:
    state = state_with(shared(P, 100), tiers=FLAT, backfill_limit_s=2.0)
    hold(state, demand("c", 50, P, tier="std"))
    policy.enqueue(state, demand("a", 60, P, tier="std"), now=0.0)
    policy.enqueue(state, demand("b", 10, P, tier="std"), now=0.0)
    set_counters(state, a=0.0, b=1.0)  # a ranks first
    assert granted(state, now=1.99) == [("b", 2)]  # backfill
    policy.enqueue(state, demand("b", 10, P, tier="std"), now=1.99)
    assert granted(state, now=2.0) == []  # a has waited 2 s: P is held for it
    policy.release(state, demand("c", 50, P, tier="std"), None)
    assert granted(state, now=2.0) == [("a", 1), ("b", 3)]


def test_holder_holds_all_its_shared_pools_but_not_others() -> None:
    R = "class:r"
    state = state_with(shared(P, 100), shared(Q, 100), shared(R, 100), tiers=FLAT, backfill_limit_s=0.0)
    hold(state, demand("c", 50, P, tier="std"))
    policy.enqueue(state, demand("a", 60, P, Q, tier="std"), now=0.0)  # blocked on P, fits Q
    policy.enqueue(state, demand("b", 10, Q, tier="std"), now=0.0)
    policy.enqueue(state, demand("c", 10, R, tier="std"), now=0.0)
    set_counters(state, a=0.0, b=1.0, c=2.0)
    assert granted(state, now=0.0) == [("c", 3)]


def test_blocked_by_a_hold_does_not_hold_in_turn() -> None:
    state = state_with(shared(P, 100), shared(Q, 100), tiers=FLAT, backfill_limit_s=0.0)
    hold(state, demand("c", 50, P, tier="std"))
    policy.enqueue(state, demand("a", 60, P, tier="std"), now=0.0)  # holds P
    policy.enqueue(state, demand("b", 10, P, Q, tier="std"), now=0.0)  # fits, but P is held
    policy.enqueue(state, demand("c", 10, Q, tier="std"), now=0.0)  # Q is not held by b
    set_counters(state, a=0.0, b=1.0, c=2.0)
    assert granted(state, now=0.0) == [("c", 3)]


def test_blocked_higher_tier_holds_against_lower_tiers_at_once() -> None:
    state = state_with(shared(P, 100), shared(Q, 100), backfill_limit_s=60.0)
    hold(state, demand("c", 50, P))
    policy.enqueue(state, demand("a", 60, P, tier="critical"), now=0.0)
    policy.enqueue(state, demand("b", 10, P, tier="critical"), now=0.0)  # same tier: backfills
    policy.enqueue(state, demand("b", 10, P, tier="standard"), now=0.0)  # lower tier: held
    policy.enqueue(state, demand("c", 10, Q, tier="batch"), now=0.0)  # other pool: proceeds
    set_counters(state, a=0.0, b=1.0, c=2.0)
    assert granted(state, now=0.0) == [("b", 2), ("c", 4)]


def test_ceiling_blocked_ticket_holds_against_lower_tiers() -> None:
    state = state_with(shared(P, 100), backfill_limit_s=60.0)
    hold(state, demand("c", 85, P))
    policy.enqueue(state, demand("a", 10, P, tier="standard"), now=0.0)  # 95 > 90
    policy.enqueue(state, demand("b", 5, P, tier="critical"), now=0.0)  # higher tier: unaffected
    assert granted(state, now=0.0) == [("b", 2)]


def test_scan_is_bounded() -> None:
    state = state_with(shared(P, 100), tiers=FLAT, max_scan=3)
    hold(state, demand("c", 100, P, tier="std"))
    for tenant in ("a", "b", "a", "b"):
        policy.enqueue(state, demand(tenant, 10, P, tier="std"), now=0.0)
    policy.release(state, demand("c", 100, P, tier="std"), None)
    assert len(granted(state)) == 3
    assert len(granted(state)) == 1


def test_fast_path_only_on_an_empty_queue() -> None:
    state = state_with(shared(P, 100), shared(Q, 100), tiers=FLAT)
    hold(state, demand("c", 100, P, tier="std"))
    policy.enqueue(state, demand("a", 10, P, tier="std"), now=0.0)
    assert not policy.grant_immediately(state, demand("b", 10, Q, tier="std"))
    t = policy.enqueue(state, demand("b", 10, Q, tier="std"), now=0.0)
    assert granted(state) == [("b", t.seq)]


def test_withdraw_and_drop_invalid() -> None:
    state = state_with(shared(P, 100), tiers=FLAT)
    hold(state, demand("c", 100, P, tier="std"))
    a = policy.enqueue(state, demand("a", 60, P, tier="std"), now=0.0)
    b = policy.enqueue(state, demand("b", 40, P, tier="std"), now=0.0)
    assert policy.withdraw(state, 999) is None
    state.layout = layout([shared(P, 50)], ["a", "b", "c"], tiers=FLAT)
    dropped = policy.drop_invalid(state)
    assert [(t.seq, type(e)) for t, e in dropped] == [(a.seq, NeverFits)]
    assert list(state.waiting) == [b.seq] and state.tenant_waiting == {"b": 1}
    assert policy.withdraw(state, b.seq) is b
    assert state.waiting == {} and state.queues == {} and state.tenant_waiting == {}


def test_tokens_ahead_counts_this_tier_and_better() -> None:
    state = state_with(shared(P, 100), shared(Q, 100))
    hold(state, demand("c", 100, P))
    policy.enqueue(state, demand("a", 10, P, tier="critical"), now=0.0)
    policy.enqueue(state, demand("a", 20, P, tier="standard"), now=0.0)
    policy.enqueue(state, demand("a", 40, P, tier="batch"), now=0.0)
    policy.enqueue(state, demand("b", 80, Q, tier="critical"), now=0.0)
    assert policy.tokens_ahead(state, P, rank=1) == 30
    assert policy.tokens_ahead(state, P, rank=2) == 70

"""Every grant pass decides what its spec decides, for *every* small state (no sampling).

Random sequences (test_policy_index.py, test_policy_properties.py) reach a state in which three
heads of three tiers interact through two shared pools too rarely to be relied on: a hold that a
new head adds can take another head's holds away (a head naming a held pool holds nothing), and
the pass once skipped such a head's pass as "settled" and kept a fitting ticket waiting. Here every
sequence of three new heads over two shared pools is enumerated, from every starting fill, with
heads young (they backfill) and old at once (``backfill_limit_s`` 0), and each pass is compared with
``spec_pass``, the docstring's pass written the slow obvious way. ``make test-long`` widens the
scope (more costs and fills).
"""

from __future__ import annotations

import itertools

import pytest

from budgets import policy
from budgets.policy import PolicyState
from budgets.types import BudgetLayout, Demand, NeverFits, TenantSpec
from tests.budgets.support import layout, shared
from tests.budgets.test_policy_index import spec_pass
from tests.support import LONG

P, Q = "backend:p", "backend:q"
TIERS = ("critical", "standard", "batch")  # ceilings 1.0, 0.9, 0.7: limits 4, 3 and 2 of 4
POOL_SETS = ((P,), (Q,), (P, Q))
COSTS = (1, 2, 3) if LONG else (1, 3)
FILLS = (0, 1, 2, 3) if LONG else (0, 2)
Head = tuple[str, tuple[str, ...], int]  # (tier, shared pools, cost)


def small_layout(backfill_limit_s: float) -> BudgetLayout:
    tenants = [TenantSpec(f"t{i}") for i in range(4)]
    return layout([shared(P, 4), shared(Q, 4)], tenants, backfill_limit_s=backfill_limit_s, max_scan=256)


def first_difference(lay: BudgetLayout, fill: tuple[int, int], heads: tuple[Head, ...]) -> str | None:
    """Fill P and Q with a lease each, then enqueue ``heads`` (one tenant each) with a pass after
    each; the first pass whose grants differ from the spec's, described, or None."""
    state = PolicyState(lay)
    for name, tokens in zip((P, Q), fill, strict=True):
        if tokens:
            assert policy.grant_immediately(state, Demand("t3", "critical", (name,), tokens, 0))
    seen: set[int] = set()
    old: set[int] = set()  # the spec's record of old heads (test_policy_index.Driver.new_heads)
    for i, (tier, pools, cost) in enumerate(heads):
        d = Demand(f"t{i}", tier, pools, cost, 0)
        try:
            policy.check_demand(lay, d)
        except NeverFits:
            continue
        if policy.grant_immediately(state, d):
            continue
        policy.enqueue(state, d, 0.0)
        for fifo in state.queues.values():
            if fifo[0].seq not in seen:
                seen.add(fifo[0].seq)
                if state.clock - fifo[0].enqueued_at >= lay.policy.backfill_limit_s:
                    old.add(fifo[0].seq)
        expected = spec_pass(state, 0.0, old)
        got = [t.seq for t in policy.grant_pass(state, 0.0)]
        seen.update(f[0].seq for f in state.queues.values())
        if got != expected:
            return f"fill {fill}, heads {heads[: i + 1]}: pass granted {got}, spec {expected}"
    return None


@pytest.mark.slow  # ~4 s per mode; ~45 s each under make test-long
@pytest.mark.parametrize("backfill_limit_s", [1.0, 0.0], ids=["young", "old"])
def test_every_pass_over_three_new_heads_and_two_shared_pools_follows_the_spec(
    backfill_limit_s: float,
) -> None:
    lay = small_layout(backfill_limit_s)
    choices = [(tier, pools, cost) for tier in TIERS for pools in POOL_SETS for cost in COSTS]
    failures = []
    for fill in itertools.product(FILLS, repeat=2):
        for heads in itertools.product(choices, repeat=3):
            found = first_difference(lay, fill, heads)
            if found is not None:
                failures.append(found)
    assert not failures, f"{len(failures)} sequences differ, e.g.\n" + "\n".join(failures[:5])


def test_a_new_head_whose_hold_frees_a_pool_unsettles_the_state() -> None:
    # A standard head on P and Q is blocked by Q and holds P against the batch tier; the batch head
    # on P waits. A new critical head on Q cannot fit, but it holds Q: the standard head names a
    # held pool and holds nothing, so P is free for the batch head, and this pass must grant it.
    state = PolicyState(small_layout(1.0))
    assert policy.grant_immediately(state, Demand("t3", "critical", (Q,), 2, 0))
    policy.enqueue(state, Demand("t0", "standard", (P, Q), 2, 0), 0.0)
    assert policy.grant_pass(state, 0.0) == [] and state.settled
    policy.enqueue(state, Demand("t1", "batch", (P,), 1, 0), 0.0)
    assert policy.grant_pass(state, 0.0) == []
    policy.enqueue(state, Demand("t2", "critical", (Q,), 3, 0), 0.0)
    assert not state.settled
    assert [(t.demand.tenant, t.demand.tier) for t in policy.grant_pass(state, 0.0)] == [("t1", "batch")]

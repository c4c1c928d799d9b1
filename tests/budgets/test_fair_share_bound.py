"""Property, on every store: the VTC fairness bound holds whatever the backend reports as usage.

Tenants "f" and "g" stay backlogged on one shared pool of M tokens while "h" comes and goes.
Leases are released in an order hypothesis picks, each with a usage report that is honest, 0, the
maximum, a lie (negative, above the reservation, a non-integer or NaN, a bool) or missing. The
test keeps its own ledger of the service each tenant was *actually* charged, from the spec
(budgets/policy.py): ``w_p * prompt`` at the grant, ``w_q * served`` at the release with
``served`` the report clamped to [0, reserved decode] (the whole reservation when the report is
missing or not a whole number), divided by the tenant's weight. Over any stretch in which f and
g are both backlogged (Sheng et al., OSDI 2024, Theorem 4.4, per-tenant weights):

    |W_f - W_g| <= U / weight_f + U / weight_g,   U = max(w_p * L_in, w_q * M)

which is the paper's ``2 * max(w_p * L_in, w_q * M)`` for unit weights. Along the way the stores'
own counters must move exactly as the ledger does while a tenant stays backlogged (no lift then):
counters measure service, not reservations.

The clock never moves and the backfill limit is 0, so a head blocked on the pool holds it at once:
only the lowest counter is ever served, as in the paper.
"""

from __future__ import annotations

import asyncio
import math
from dataclasses import dataclass, field
from typing import Any

import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from budgets.types import BudgetStore, Demand, Lease, TenantSpec
from tests.budgets.conftest import FACTORIES, STORE_KINDS
from tests.budgets.support import FLAT, FakeClock, P, assert_idle, eventually, layout, shared
from tests.support import examples

M = 100  # tokens the pool holds
BACKLOGGED = ("f", "g")
DEPTH = 11  # > M / smallest cost: one release can never drain a backlogged tenant's queue

# (prefill, decode); every cost is at least 10 and fits the pool.
request = st.tuples(st.integers(0, 40), st.integers(0, 60)).filter(lambda r: r[0] + r[1] >= 10)
report = st.one_of(
    st.none(),  # missing
    st.just(0),
    st.just("max"),  # exactly the reservation
    st.integers(0, 60),  # honest, or not: above a small reservation
    st.integers(-(10**9), -1),  # negative lie
    st.integers(1, 10**12).map(lambda n: ("over", n)),  # more than the backend was told it may write
    st.floats(allow_nan=True, allow_infinity=True),  # not a token count
    st.booleans(),
)
step = st.one_of(
    st.tuples(st.just("release"), st.integers(0, 10**6), report),
    st.tuples(st.just("release"), st.integers(0, 10**6), report),
    st.tuples(st.just("h"), request),  # the intermittent tenant asks for one more
)


def served_output(decode: int, reported: Any) -> int:
    """The spec's served output, written independently of the stores' code."""
    if isinstance(reported, float) and math.isfinite(reported) and reported.is_integer():
        reported = int(reported)
    if reported is None or isinstance(reported, bool) or not isinstance(reported, int):
        return decode
    return min(max(reported, 0), decode)


def resolve(decode: int, tag: Any) -> Any:
    if tag == "max":
        return decode
    if isinstance(tag, tuple):
        return decode + tag[1]
    return tag


@dataclass
class Run:
    store: BudgetStore
    weights: dict[str, float]
    prefill_weight: float
    decode_weight: float
    tasks: list[tuple[Demand, asyncio.Task[Lease]]] = field(default_factory=list)
    seen: int = 0
    live: list[Lease] = field(default_factory=list)
    booked: set[str] = field(default_factory=set)  # lease ids granted and charged their prompt
    charged: dict[str, float] = field(default_factory=lambda: {"f": 0.0, "g": 0.0, "h": 0.0})

    def enqueue(self, d: Demand) -> None:
        self.tasks.append((d, asyncio.create_task(self.store.acquire(d, 60))))

    def pending(self, tenant: str) -> int:
        return sum(1 for d, t in self.tasks if d.tenant == tenant and not t.done())

    async def settle(self) -> None:
        """Until the store and the test agree on who waits; then book the new grants."""

        async def agreed() -> bool:
            await asyncio.sleep(0)
            snap = await self.store.snapshot()
            return sum(snap.queue_depth.values()) == sum(1 for _, t in self.tasks if not t.done())

        await eventually(agreed)
        for d, task in self.tasks:
            if task.done() and not task.cancelled() and task.exception() is None:
                lease = task.result()
                if lease.id not in self.booked:
                    self.booked.add(lease.id)
                    self.live.append(lease)
                    self.charged[d.tenant] += self.prefill_weight * d.prefill / self.weights[d.tenant]

    async def release(self, index: int, tag: Any) -> None:
        lease = self.live.pop(index % len(self.live))
        d = lease.demand
        reported = resolve(d.decode, tag)
        assert await self.store.release(lease.id, reported)
        served = served_output(d.decode, reported)
        self.charged[d.tenant] += self.decode_weight * served / self.weights[d.tenant]

    async def counters(self) -> dict[str, float]:
        return dict((await self.store.snapshot()).virtual_service)


async def scenario(
    kind: str,
    weights: dict[str, float],
    decode_weight: float,
    plans: dict[str, list[tuple[int, int]]],
    steps: list[tuple[Any, ...]],
) -> None:
    tenants = [TenantSpec(name, weight=w, max_queue_len=64) for name, w in weights.items()]
    lay = layout([shared(P, M)], tenants, tiers=FLAT, backfill_limit_s=0.0, decode_weight=decode_weight)
    store = await FACTORIES[kind](lay, FakeClock())
    await store.start()
    run = Run(store, weights, lay.policy.prefill_weight, decode_weight)
    made = dict.fromkeys(BACKLOGGED, 0)
    longest = max(p for plan in plans.values() for p, _ in plan)
    bound_u = max(lay.policy.prefill_weight * longest, decode_weight * M)
    bound = bound_u / weights["f"] + bound_u / weights["g"]

    async def top_up() -> None:
        # Some of the new requests may be granted at once: top up until DEPTH really wait.
        while any(run.pending(t) < DEPTH for t in BACKLOGGED):
            for tenant in BACKLOGGED:
                while run.pending(tenant) < DEPTH:
                    prefill, decode = plans[tenant][made[tenant] % len(plans[tenant])]
                    made[tenant] += 1
                    run.enqueue(Demand(tenant, "std", (P,), prefill, decode))
            await run.settle()

    try:
        await top_up()
        # One stretch of joint backlog: every value W_f - W_g took in it, and where the counters were.
        diffs = [run.charged["f"] - run.charged["g"]]
        last_charged = dict(run.charged)
        last_counters = await run.counters()
        for i, op in enumerate(steps):
            if op[0] == "release" and run.live:
                await run.release(op[1], op[2])
            elif op[0] == "h":
                run.enqueue(Demand("h", "std", (P,), *op[1]))
            await run.settle()
            where = f"step {i} {op}"
            if any(run.pending(t) == 0 for t in BACKLOGGED):
                raise AssertionError(f"{where}: the test let a tenant's backlog run dry (raise DEPTH)")
            diffs.append(run.charged["f"] - run.charged["g"])
            spread = max(diffs) - min(diffs)
            assert spread <= bound + 1e-9, f"{where}: |W_f - W_g| reached {spread:.6g} > bound {bound:.6g}"
            counters = await run.counters()
            for t in BACKLOGGED:  # backlogged all along: no lift, so the counter moved by the charges
                assert counters[t] - last_counters[t] == pytest.approx(
                    run.charged[t] - last_charged[t], rel=1e-9, abs=1e-9
                ), f"{where}: counter of {t} is not the service charged"
            last_charged, last_counters = dict(run.charged), counters
            await top_up()
            # Top-ups may be granted at once (charged to both sides equally in the ledger and the counters).
            diffs.append(run.charged["f"] - run.charged["g"])
            assert max(diffs) - min(diffs) <= bound + 1e-9, f"{where}: bound broken after top-up"
            last_charged, last_counters = dict(run.charged), await run.counters()
        # Wind down: nothing lost, nothing leaked.
        for _, task in run.tasks:
            task.cancel()
        await asyncio.gather(*(t for _, t in run.tasks), return_exceptions=True)
        await run.settle()
        for lease in run.live:
            await store.release(lease.id, 0)
        await assert_idle(store)
    finally:
        await store.close()


weights_st = st.fixed_dictionaries(
    {"f": st.sampled_from([1.0, 2.0, 0.5]), "g": st.sampled_from([1.0, 2.0, 0.5]), "h": st.just(1.0)}
)
plans_st = st.fixed_dictionaries({t: st.lists(request, min_size=1, max_size=6) for t in BACKLOGGED})


@pytest.mark.slow  # hypothesis, both stores (the Lua code as functions; the contract suite runs it as scripts too)
@pytest.mark.parametrize("kind", [k for k in STORE_KINDS if k != "redis-scripts"])
@settings(
    max_examples=examples(60),
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
    # Every example drives a real store: shrink one failure, do not hunt for more.
    report_multiple_bugs=False,
    phases=[Phase.explicit, Phase.reuse, Phase.generate, Phase.shrink],
)
@given(
    weights=weights_st,
    decode_weight=st.sampled_from([1.0, 2.0]),
    plans=plans_st,
    steps=st.lists(step, min_size=1, max_size=40),
)
def test_backlogged_tenants_service_stays_within_the_vtc_bound_under_any_usage_reports(
    kind: str,
    weights: dict[str, float],
    decode_weight: float,
    plans: dict[str, list[tuple[int, int]]],
    steps: list[tuple[Any, ...]],
) -> None:
    asyncio.run(scenario(kind, weights, decode_weight, plans, steps))

"""Store contract: immediate grants, atomicity, idempotent release, refusals that never queue."""

from __future__ import annotations

import asyncio
import random

import pytest

from budgets.types import NeverFits, QueueTimeout, UnknownTenantOrTier
from tests.budgets.conftest import StoreFactory
from tests.budgets.support import (
    FakeClock,
    P,
    Q,
    assert_idle,
    demand,
    in_flight,
    layout,
    private,
    shared,
    wait_queued,
)


async def test_immediate_grant_and_release(store_factory: StoreFactory) -> None:
    store = await store_factory(layout([shared(P, 100), private("tenant:a", 50)], ["a"]))
    lease = await store.acquire(demand("a", 30, P, "tenant:a", decode=10), max_wait_s=1)
    assert lease.id and lease.demand.cost == 30
    assert lease.queued_s == 0
    assert await in_flight(store, P) == 30
    assert await in_flight(store, "tenant:a") == 30
    assert (await store.snapshot()).leases == 1
    assert await store.release(lease.id, actual_decode=4)
    await assert_idle(store)


async def test_counters_charge_the_prompt_at_grant_and_the_output_served_at_release(
    store_factory: StoreFactory, clock: FakeClock
) -> None:
    store = await store_factory(layout([shared(P, 1000)], ["a"], lease_ttl_s=5.0))
    d = demand("a", 100, P, decode=60)  # prompt 40, 60 output tokens reserved

    async def counter() -> float:
        return (await store.snapshot()).virtual_service["a"]

    lease = await store.acquire(d, 1)
    assert await counter() == 40.0  # the reservation is not service
    expected = 40.0
    # Reported completion tokens, clamped to the reservation; none at all: the whole reservation.
    for reported, served in ((7, 7), (0, 0), (-5, 0), (500, 60), (None, 60)):
        await store.release(lease.id, actual_decode=reported)
        expected += 2.0 * served
        assert await counter() == expected, reported
        lease = await store.acquire(d, 1)
        expected += 40.0
    clock.advance(5.1)  # its owner vanished: reaped, usage unknown, the whole reservation
    assert await store.reap_expired() == 1
    assert await counter() == expected + 2.0 * 60
    await assert_idle(store)


async def test_lease_ids_are_unique(store_factory: StoreFactory) -> None:
    store = await store_factory(layout([shared(P, 10_000)], ["a"]))
    leases = [await store.acquire(demand("a", 1, P), 1) for _ in range(200)]
    assert len({lease.id for lease in leases}) == 200
    for lease in leases:
        await store.release(lease.id)
    await assert_idle(store)


async def test_all_or_nothing_across_pools(store_factory: StoreFactory) -> None:
    store = await store_factory(layout([shared(P, 100), shared(Q, 100)], ["a", "b"]))
    blocker = await store.acquire(demand("b", 90, Q), 1)
    task = asyncio.create_task(store.acquire(demand("a", 20, P, Q), max_wait_s=5))
    await wait_queued(store, 1)
    # Waiting for Q must not hold anything in P meanwhile.
    assert await in_flight(store, P) == 0
    assert await in_flight(store, Q) == 90
    await store.release(blocker.id)
    lease = await asyncio.wait_for(task, 2)
    assert await in_flight(store, P) == 20
    assert await in_flight(store, Q) == 20
    await store.release(lease.id)
    await assert_idle(store)


async def test_all_or_nothing_on_timeout(store_factory: StoreFactory) -> None:
    store = await store_factory(layout([shared(P, 100), shared(Q, 100)], ["a", "b"]))
    blocker = await store.acquire(demand("b", 90, Q), 1)
    with pytest.raises(QueueTimeout):
        await store.acquire(demand("a", 20, P, Q), max_wait_s=0.03)
    assert await in_flight(store, P) == 0
    await store.release(blocker.id)
    await assert_idle(store)


async def test_release_is_idempotent(store_factory: StoreFactory) -> None:
    store = await store_factory(layout([shared(P, 100)], ["a"]))
    lease = await store.acquire(demand("a", 10, P), 1)
    assert await store.release(lease.id) is True
    assert await store.release(lease.id) is False
    assert await store.release("no-such-lease") is False
    await assert_idle(store)


async def test_never_fits_capacity(store_factory: StoreFactory) -> None:
    store = await store_factory(layout([shared(P, 100)], ["a"]))
    with pytest.raises(NeverFits) as info:
        await store.acquire(demand("a", 150, P, decode=50), 1)
    err = info.value
    assert (err.pool, err.cost, err.limit, err.status) == (P, 150, 100, 413)
    for part in ("150", "100", P, "max_tokens", "capacity_tokens of backend pool p"):
        assert part in err.message
    await assert_idle(store)


async def test_never_fits_tier_ceiling(store_factory: StoreFactory) -> None:
    store = await store_factory(layout([shared(P, 100)], ["a"]))
    # batch may fill 70 % of a shared pool: 71 tokens can never be granted to it, 70 can.
    with pytest.raises(NeverFits) as info:
        await store.acquire(demand("a", 71, P, tier="batch"), 1)
    assert (info.value.limit, info.value.cost) == (70, 71)
    assert "ceiling" in info.value.message and "70" in info.value.message
    lease = await store.acquire(demand("a", 70, P, tier="batch"), 1)
    await store.release(lease.id)
    await assert_idle(store)


async def test_never_fits_tenant_budget_names_the_tenant(store_factory: StoreFactory) -> None:
    store = await store_factory(layout([shared(P, 1000), private("tenant:a", 64)], ["a"]))
    with pytest.raises(NeverFits) as info:
        await store.acquire(demand("a", 65, P, "tenant:a"), 1)
    assert info.value.pool == "tenant:a"
    assert "raise budget_tokens of tenant a" in info.value.message


async def test_unknown_tenant_tier_or_pool(store_factory: StoreFactory) -> None:
    store = await store_factory(layout([shared(P, 100)], ["a"]))
    for bad in (demand("zz", 1, P), demand("a", 1, P, tier="gold"), demand("a", 1, "backend:nope")):
        with pytest.raises(UnknownTenantOrTier) as info:
            await store.acquire(bad, 1)
        assert info.value.status == 400
    await assert_idle(store)


async def test_a_pool_a_tier_and_a_tenant_of_the_same_name_are_told_apart(
    store_factory: StoreFactory,
) -> None:
    # The Redis scripts keep specs per kind (pool, tier, tenant) under bare names: the one name
    # must find the pool's capacity, the tier's ceiling and the tenant's spec, never another's.
    store = await store_factory(layout([shared("critical", 40), shared("batch", 50)], ["critical"]))
    lease = await store.acquire(demand("critical", 40, "critical"), 1)  # tier critical: ceiling 1.0
    with pytest.raises(NeverFits) as info:
        await store.acquire(demand("critical", 36, "batch", tier="batch"), 1)  # batch: 70 % of 50
    assert (info.value.pool, info.value.limit) == ("batch", 35)
    with pytest.raises(UnknownTenantOrTier):
        await store.acquire(demand("batch", 1, "critical"), 1)  # a tier and a pool, not a tenant
    with pytest.raises(UnknownTenantOrTier):
        await store.acquire(demand("critical", 1, "standard"), 1)  # a tier, not a pool
    assert await store.release(lease.id)
    await assert_idle(store)


async def test_pools_return_to_zero_under_concurrent_churn(store_factory: StoreFactory) -> None:
    tenants = ["a", "b", "c"]
    pools = [shared(P, 120), shared(Q, 90)] + [private(f"tenant:{t}", 60) for t in tenants]
    store = await store_factory(layout(pools, tenants, backfill_limit_s=0.0))
    rng = random.Random(7)
    outcomes: dict[str, int] = {}

    async def client(i: int) -> None:
        tenant = tenants[i % 3]
        backend = P if i % 2 else Q
        tier = ("critical", "standard", "batch")[i % 3]
        d = demand(
            tenant, rng.randint(1, 40), backend, f"tenant:{tenant}", tier=tier, decode=rng.randint(0, 1)
        )
        try:
            lease = await store.acquire(d, max_wait_s=rng.choice([0.005, 2.0]))
        except QueueTimeout:
            outcomes["timeout"] = outcomes.get("timeout", 0) + 1
            return
        try:
            await asyncio.sleep(rng.random() * 0.002)
        finally:  # as the gateway does: release exactly once, also when cancelled while holding
            assert await store.release(lease.id, actual_decode=rng.randint(0, 3))
        outcomes["ok"] = outcomes.get("ok", 0) + 1

    tasks = [asyncio.create_task(client(i)) for i in range(240)]
    await asyncio.sleep(0.002)
    for task in tasks[::17]:  # some clients go away while waiting or holding
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    assert outcomes.get("ok", 0) > 50
    await assert_idle(store)

"""Store contract: lease expiry, heartbeats, the background reaper and live layout changes."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from budgets.types import Demand, NeverFits, TierSpec, UnknownTenantOrTier
from tests.budgets.conftest import StoreFactory
from tests.budgets.support import (
    FakeClock,
    P,
    Q,
    assert_idle,
    demand,
    eventually,
    in_flight,
    layout,
    private,
    shared,
    wait_queued,
    waiting,
)


async def test_expired_leases_are_reaped(store_factory: StoreFactory, clock: FakeClock) -> None:
    store = await store_factory(layout([shared(P, 100)], ["a"], lease_ttl_s=5.0))
    lease = await store.acquire(demand("a", 40, P), 1)
    clock.advance(4.9)
    assert await store.reap_expired() == 0
    clock.advance(0.2)
    assert await store.reap_expired() == 1
    assert await store.release(lease.id) is False  # already reaped
    await assert_idle(store)


async def test_heartbeat_keeps_a_lease_alive(store_factory: StoreFactory, clock: FakeClock) -> None:
    store = await store_factory(layout([shared(P, 100)], ["a"], lease_ttl_s=5.0))
    alive = await store.acquire(demand("a", 10, P), 1)
    dead = await store.acquire(demand("a", 20, P), 1)
    for _ in range(3):
        clock.advance(4.0)
        await store.heartbeat([alive.id, "unknown-lease"])
    assert await store.reap_expired() == 1
    assert await in_flight(store, P) == 10
    assert await store.release(dead.id) is False
    assert await store.release(alive.id) is True
    await assert_idle(store)


async def test_reaping_grants_waiters(store_factory: StoreFactory, clock: FakeClock) -> None:
    store = await store_factory(layout([shared(P, 100)], ["a", "b"], lease_ttl_s=5.0))
    await store.acquire(demand("b", 100, P), 1)  # its owner "crashes": never released
    task = asyncio.create_task(store.acquire(demand("a", 60, P), 10))
    await wait_queued(store, 1)
    clock.advance(5.0)
    await store.heartbeat([])  # nothing renewed
    assert await store.reap_expired() == 1
    lease = await asyncio.wait_for(task, 2)
    assert await in_flight(store, P) == 60
    await store.release(lease.id)
    await assert_idle(store)


async def test_background_reaper_runs_between_start_and_close(
    store_factory: StoreFactory, clock: FakeClock
) -> None:
    store = await store_factory(layout([shared(P, 100)], ["a"], lease_ttl_s=0.2))
    await store.acquire(demand("a", 30, P), 1)
    clock.advance(1.0)

    async def drained() -> bool:
        return await in_flight(store, P) == 0

    await eventually(drained, timeout_s=3.0)
    await assert_idle(store)


async def test_apply_layout_grows_capacity_and_grants_waiters(store_factory: StoreFactory) -> None:
    before = layout([shared(P, 100)], ["a", "b"])
    store = await store_factory(before)
    held = await store.acquire(demand("b", 60, P), 1)
    task = asyncio.create_task(store.acquire(demand("a", 60, P), 10))
    await wait_queued(store, 1)
    await store.apply_layout(layout([shared(P, 200)], ["a", "b"]))
    lease = await asyncio.wait_for(task, 2)
    snap = await store.snapshot()
    assert (snap.pools[P].capacity, snap.pools[P].in_flight) == (200, 120)  # the old lease stays
    for x in (held, lease):
        assert await store.release(x.id)
    await assert_idle(store)


async def test_apply_layout_fails_waiters_that_can_never_fit(store_factory: StoreFactory) -> None:
    store = await store_factory(layout([shared(P, 100), shared(Q, 100)], ["a", "b"]))
    held = await store.acquire(demand("b", 90, P), 1)
    big = asyncio.create_task(store.acquire(demand("a", 80, P), 10))
    await wait_queued(store, 1)
    small = asyncio.create_task(store.acquire(demand("b", 20, P), 10))
    await wait_queued(store, 2)
    # Shrink P below the big ticket's cost (but below what is in flight, too): leases stay.
    await store.apply_layout(layout([shared(P, 50), shared(Q, 100)], ["a", "b"]))
    with pytest.raises(NeverFits) as info:
        await big
    assert (info.value.cost, info.value.limit) == (80, 50)
    assert await waiting(store) == 1
    assert await in_flight(store, P) == 90
    await store.release(held.id)
    lease = await asyncio.wait_for(small, 2)
    await store.release(lease.id)
    await assert_idle(store)


async def test_apply_layout_changes_tier_ceilings_and_drops_unknown_tenants(
    store_factory: StoreFactory,
) -> None:
    store = await store_factory(layout([shared(P, 100)], ["a", "b"]))
    held = await store.acquire(demand("b", 100, P), 1)
    a_task = asyncio.create_task(store.acquire(demand("a", 50, P, tier="batch"), 10))
    await wait_queued(store, 1)
    b_task = asyncio.create_task(store.acquire(demand("b", 40, P, tier="batch"), 10))
    await wait_queued(store, 2)
    tiers = {"critical": TierSpec("critical", 0), "batch": TierSpec("batch", 2, ceiling=0.45)}
    await store.apply_layout(layout([shared(P, 100)], ["b"], tiers=tiers))
    with pytest.raises(UnknownTenantOrTier):
        await a_task
    assert await waiting(store) == 1
    await store.release(held.id)
    lease = await asyncio.wait_for(b_task, 2)
    await store.release(lease.id)
    await assert_idle(store)


async def test_removed_pool_keeps_its_leases_until_released(store_factory: StoreFactory) -> None:
    base = layout([shared(P, 100), shared(Q, 100)], ["a"])
    store = await store_factory(base)
    lease = await store.acquire(demand("a", 30, P, Q), 1)
    await store.apply_layout(dataclasses.replace(base, pools={Q: shared(Q, 100)}))
    assert await in_flight(store, Q) == 30
    assert await store.release(lease.id)
    await assert_idle(store)


# ---- growing a lease while its stream runs ----


async def test_a_lease_grows_in_every_pool_it_holds_and_releases_what_it_grew_to(
    store_factory: StoreFactory, clock: FakeClock
) -> None:
    store = await store_factory(layout([shared(P, 1000), private("tenant:a", 500)], ["a"]))
    lease = await store.acquire(demand("a", 150, P, "tenant:a", decode=100), 1)
    assert await store.extend(lease.id, 200) == 0  # it fits: no overdraft
    assert (await in_flight(store, P), await in_flight(store, "tenant:a")) == (350, 350)
    assert await store.extend(lease.id, 0) == 0
    assert await store.release(lease.id, 250) is True
    await assert_idle(store)


async def test_growth_past_capacity_is_an_overdraft_and_the_pool_admits_nothing_until_paid_back(
    store_factory: StoreFactory, clock: FakeClock
) -> None:
    store = await store_factory(layout([shared(P, 100)], ["a", "b"]))
    lease = await store.acquire(demand("a", 90, P, decode=80), 1)
    assert await store.extend(lease.id, 40) == 30  # 130 in flight against 100
    assert await in_flight(store, P) == 130
    small = asyncio.create_task(store.acquire(demand("b", 5, P), 10))
    await wait_queued(store, 1)  # even 5 tokens wait: the pool is over its limit
    assert not small.done()
    assert await store.release(lease.id, 100) is True
    (await small)  # granted once the overdraft is paid back
    assert await in_flight(store, P) == 5


async def test_growth_on_a_tenant_budget_holds_back_that_tenants_waiting_request(
    store_factory: StoreFactory, clock: FakeClock
) -> None:
    # Tenant a's next request (40) fits its budget (100) beside its running stream (50) and waits
    # only for the shared pool P. The stream then grows by 30 (80 of a's 100): when P frees, the
    # waiting request must not be granted, or a holds 120 of a budget of 100.
    store = await store_factory(
        layout([shared(P, 100), shared(Q, 1000), private("tenant:a", 100)], ["a", "b"])
    )
    other = await store.acquire(demand("b", 100, P), 1)
    stream = await store.acquire(demand("a", 50, Q, "tenant:a", decode=40), 1)
    nxt = asyncio.create_task(store.acquire(demand("a", 40, P, "tenant:a"), 10))
    await wait_queued(store, 1)
    assert await store.extend(stream.id, 30) == 0  # a's budget: 80 of 100, no overdraft
    await store.release(other.id)  # P is empty now
    await wait_queued(store, 1)
    assert not nxt.done()
    assert await in_flight(store, "tenant:a") == 80
    await store.release(stream.id, 70)  # a's budget frees: now it is granted
    lease = await asyncio.wait_for(nxt, 5)
    assert await in_flight(store, "tenant:a") == 40
    await store.release(lease.id)
    await assert_idle(store)


async def test_a_tenants_budget_holds_what_a_request_may_produce_and_a_shared_pool_what_it_reserves(
    store_factory: StoreFactory, clock: FakeClock
) -> None:
    # A learned reservation of 100 for a request that may produce 400: tenant a's budget holds the
    # 400 (its in-flight tokens can never pass its budget, whatever its estimates), P the 100.
    store = await store_factory(layout([shared(P, 1000), private("tenant:a", 500)], ["a", "b"]))
    lease = await store.acquire(Demand("a", "critical", (P, "tenant:a"), 50, 100, decode_limit=400), 1)
    assert (await in_flight(store, P), await in_flight(store, "tenant:a")) == (150, 450)
    nxt = asyncio.create_task(store.acquire(demand("a", 100, P, "tenant:a"), 10))
    await wait_queued(store, 1)  # 450 + 100 > 500: waits for a's own budget...
    other = await store.acquire(demand("b", 300, P), 1)  # ...and holds nothing on P
    assert await store.extend(lease.id, 200) == 0  # within the limit: P grows, a's budget held it already
    assert (await in_flight(store, P), await in_flight(store, "tenant:a")) == (650, 450)
    assert await store.extend(lease.id, 200) == 50  # 500 of a limit of 400: a's budget 550 of 500
    assert (await in_flight(store, P), await in_flight(store, "tenant:a")) == (850, 550)
    assert await store.release(lease.id, 480) is True
    granted = await asyncio.wait_for(nxt, 5)
    assert (await in_flight(store, P), await in_flight(store, "tenant:a")) == (400, 100)
    await store.release(granted.id)
    await store.release(other.id)
    await assert_idle(store)


async def test_a_reaped_lease_returns_its_limit_to_its_tenants_budget(
    store_factory: StoreFactory, clock: FakeClock
) -> None:
    store = await store_factory(layout([shared(P, 1000), private("tenant:a", 500)], ["a"], lease_ttl_s=5.0))
    lease = await store.acquire(Demand("a", "critical", (P, "tenant:a"), 50, 100, decode_limit=400), 1)
    await store.extend(lease.id, 100)
    assert (await in_flight(store, P), await in_flight(store, "tenant:a")) == (250, 450)
    clock.advance(5.1)  # its replica died: nothing renews it
    assert await store.reap_expired() == 1
    await assert_idle(store)


async def test_a_request_whose_limit_can_never_fit_its_tenants_budget_is_refused_saying_so(
    store_factory: StoreFactory,
) -> None:
    store = await store_factory(layout([shared(P, 1000), private("tenant:a", 500)], ["a"]))
    with pytest.raises(NeverFits) as err:
        await store.acquire(Demand("a", "critical", (P, "tenant:a"), 50, 100, decode_limit=600), 1)
    assert (err.value.pool, err.value.cost, err.value.limit) == ("tenant:a", 650, 500)
    assert "output limit 600" in str(err.value) and "budget_tokens of tenant a" in str(err.value)
    await assert_idle(store)


async def test_an_unknown_lease_cannot_grow_and_a_grown_reaped_lease_returns_all_of_it(
    store_factory: StoreFactory, clock: FakeClock
) -> None:
    store = await store_factory(layout([shared(P, 100)], ["a"], lease_ttl_s=5.0))
    assert await store.extend("no-such-lease", 10) is None
    lease = await store.acquire(demand("a", 20, P, decode=10), 1)
    await store.extend(lease.id, 30)
    assert await in_flight(store, P) == 50
    clock.advance(5.1)
    assert await store.reap_expired() == 1
    assert await store.extend(lease.id, 10) is None  # reaped: gone
    await assert_idle(store)


async def test_growth_is_not_service_but_the_grown_output_is_when_served(
    store_factory: StoreFactory, clock: FakeClock
) -> None:
    store = await store_factory(layout([shared(P, 10_000)], ["a", "b"]))
    busy = await store.acquire(demand("b", 10, P), 1)  # keeps b in flight: no idle-tenant lift
    lease = await store.acquire(demand("a", 110, P, decode=100), 1)
    before = (await store.snapshot()).virtual_service["a"]
    await store.extend(lease.id, 300)
    assert (await store.snapshot()).virtual_service["a"] == before  # a reservation is not service
    await store.release(lease.id, 350)  # served 350: more than the first reservation, within the grown one
    after = (await store.snapshot()).virtual_service["a"]
    assert after - before == 2 * 350  # the default decode weight
    await store.release(busy.id)

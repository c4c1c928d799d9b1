"""Store contract: tenants idle for ``idle_forget_s`` are forgotten, and come back as newcomers."""

from __future__ import annotations

from budgets.types import BudgetStore
from tests.budgets.conftest import StoreFactory
from tests.budgets.support import FLAT, FakeClock, P, demand, layout, shared


async def counters(store: BudgetStore) -> dict[str, float]:
    return dict((await store.snapshot()).virtual_service)


async def test_a_tenant_idle_for_idle_forget_s_is_forgotten_and_comes_back_as_a_newcomer(
    store_factory: StoreFactory, clock: FakeClock
) -> None:
    store = await store_factory(layout([shared(P, 100)], ["a", "b"], tiers=FLAT, idle_forget_s=10.0))
    lease = await store.acquire(demand("a", 50, P, tier="std", decode=20), 1)
    assert await store.release(lease.id, 20)
    assert await counters(store) == {"a": 30.0 + 2 * 20}  # prompt, then the output served
    clock.advance(9.9)
    await store.reap_expired()
    assert await counters(store) == {"a": 70.0}  # idle, but not for long enough
    clock.advance(0.1)
    await store.reap_expired()
    assert await counters(store) == {}
    # Back after that: charged like a tenant never seen (nobody else active: from 0), its debt gone.
    lease = await store.acquire(demand("a", 10, P, tier="std"), 1)
    assert await counters(store) == {"a": 10.0}
    assert await store.release(lease.id, 0)


async def test_a_tenant_with_a_lease_or_a_ticket_is_never_forgotten(
    store_factory: StoreFactory, clock: FakeClock
) -> None:
    store = await store_factory(layout([shared(P, 100)], ["a", "b"], tiers=FLAT, idle_forget_s=1.0))
    held = await store.acquire(demand("a", 100, P, tier="std"), 1)
    clock.advance(5.0)
    await store.heartbeat([held.id])
    await store.reap_expired()
    assert set(await counters(store)) == {"a"}
    assert await store.release(held.id, 0)
    clock.advance(1.0)
    await store.reap_expired()
    assert await counters(store) == {}

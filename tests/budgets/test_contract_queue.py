"""Store contract: who is granted next when a pool is full (tier, fair share, FIFO, backfill)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterable

import pytest

from budgets.types import BudgetStore, Demand, Lease, QueueFull, QueueTimeout, StoreUnavailable, TenantSpec
from tests.budgets.conftest import StoreFactory
from tests.budgets.support import (
    FLAT,
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


class Waiters:
    """Starts acquires one at a time (so arrival order is known) and records grants in order."""

    def __init__(self, store: BudgetStore) -> None:
        self.store = store
        self.granted: list[tuple[str, Lease]] = []
        self.tasks: list[asyncio.Task[None]] = []
        self.seen = 0

    async def add(self, label: str, d: Demand, max_wait_s: float = 10.0) -> asyncio.Task[None]:
        before = await waiting(self.store)

        async def run() -> None:
            lease = await self.store.acquire(d, max_wait_s)
            self.granted.append((label, lease))

        task = asyncio.create_task(run())
        self.tasks.append(task)
        await wait_queued(self.store, before + 1)
        return task

    async def next_grants(self, n: int) -> list[str]:
        """Wait until ``n`` grants beyond those already looked at have arrived; returns their labels."""
        start, self.seen = self.seen, self.seen + n
        await eventually(lambda: len(self.granted) >= self.seen)
        return [label for label, _ in self.granted[start : self.seen]]

    async def serve_one_at_a_time(self, first: Lease, count: int) -> list[str]:
        """Release ``first``, then each new grant as soon as it arrives; the grant order."""
        await self.store.release(first.id)
        order: list[str] = []
        for i in range(count):
            await eventually(lambda i=i: len(self.granted) > i)  # type: ignore[misc]
            label, lease = self.granted[i]
            order.append(label)
            await self.store.release(lease.id)
        return order

    async def cancel_rest(self, served: int) -> None:
        """Cancel the waiters still queued. In a distributed store the grant after the last one
        served may already be on its way to its waiter; its owner releases it, as the gateway would."""
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        for _, lease in self.granted[served:]:
            await self.store.release(lease.id)


def labels_count(labels: Iterable[str], label: str) -> int:
    return sum(1 for x in labels if x == label)


async def test_queue_order_by_tier_then_fifo(store_factory: StoreFactory) -> None:
    store = await store_factory(layout([shared(P, 10)], ["a", "b"], tiers=None))
    blocker = await store.acquire(demand("b", 10, P), 1)
    w = Waiters(store)
    await w.add("batch-1", demand("a", 7, P, tier="batch"))
    await w.add("standard-1", demand("a", 9, P, tier="standard"))
    await w.add("batch-2", demand("a", 7, P, tier="batch"))
    await w.add("critical-1", demand("a", 10, P, tier="critical"))
    await w.add("standard-2", demand("a", 9, P, tier="standard"))
    order = await w.serve_one_at_a_time(blocker, 5)
    assert order == ["critical-1", "standard-1", "standard-2", "batch-1", "batch-2"]
    await assert_idle(store)


async def test_fair_share_follows_weights(store_factory: StoreFactory) -> None:
    tenants = [TenantSpec("light", weight=1.0), TenantSpec("heavy", weight=2.0), TenantSpec("c")]
    store = await store_factory(layout([shared(P, 10)], tenants, tiers=FLAT))
    blocker = await store.acquire(demand("c", 10, P, tier="std"), 1)
    w = Waiters(store)
    for _ in range(30):
        await w.add("light", demand("light", 10, P, tier="std"))
        await w.add("heavy", demand("heavy", 10, P, tier="std"))
    order = await w.serve_one_at_a_time(blocker, 30)
    # Service is divided by the weight: "heavy" receives two grants per grant of "light".
    assert labels_count(order, "heavy") == 20
    assert labels_count(order, "light") == 10
    await w.cancel_rest(served=30)
    await assert_idle(store)


async def test_fair_share_charges_decode_at_its_weight(store_factory: StoreFactory) -> None:
    # Equal weights, equal cost; "talker" reserves output (decode weight 2), "reader" only prompt.
    store = await store_factory(layout([shared(P, 10)], ["talker", "reader", "c"], tiers=FLAT))
    blocker = await store.acquire(demand("c", 10, P, tier="std"), 1)
    w = Waiters(store)
    for _ in range(12):
        await w.add("talker", demand("talker", 10, P, tier="std", decode=10))
        await w.add("reader", demand("reader", 10, P, tier="std"))
    order = await w.serve_one_at_a_time(blocker, 12)
    assert labels_count(order, "reader") == 8 and labels_count(order, "talker") == 4
    await w.cancel_rest(served=12)
    await assert_idle(store)


async def test_idle_tenant_cannot_bank_credit(store_factory: StoreFactory) -> None:
    store = await store_factory(layout([shared(P, 10)], ["idle", "busy"], tiers=FLAT))
    lease = await store.acquire(demand("idle", 10, P, tier="std"), 1)
    await store.release(lease.id)
    for _ in range(10):  # "busy" is served alone while "idle" is away
        lease = await store.acquire(demand("busy", 10, P, tier="std"), 1)
        await store.release(lease.id)
    blocker = await store.acquire(demand("busy", 10, P, tier="std"), 1)
    w = Waiters(store)
    for _ in range(6):
        await w.add("idle", demand("idle", 10, P, tier="std"))
    for _ in range(6):
        await w.add("busy", demand("busy", 10, P, tier="std"))
    snap = await store.snapshot()
    # Rejoining lifted "idle" to the counter of the tenant in flight; its old low counter is gone.
    assert snap.virtual_service["idle"] >= snap.virtual_service["busy"] - 10
    order = await w.serve_one_at_a_time(blocker, 6)
    assert labels_count(order, "busy") >= 2, order
    await w.cancel_rest(served=6)
    await assert_idle(store)


async def test_newcomer_is_granted_at_the_first_release_after_it_arrives(store_factory: StoreFactory) -> None:
    # "busy" fills the pool with requests that reserve 1,992 output tokens each but are
    # served 4. A reservation is not service: if the counters held reservations, the newcomer
    # would be lifted to an inflated counter that each release refunds, and wait behind the
    # whole queue (measured: all 27 went first; 429 queue_timeout under a sustained backlog).
    store = await store_factory(layout([shared(P, 4 * 2000)], ["busy", "new"], tiers=FLAT))
    big = demand("busy", 2000, P, tier="std", decode=1992)
    held = [await store.acquire(big, 1) for _ in range(4)]
    w = Waiters(store)
    for _ in range(27):
        await w.add("busy", big)
    for _ in range(5):  # "busy" alone for a while: each release hands the slot to its next request
        await store.release(held.pop(0).id, actual_decode=4)
        assert await w.next_grants(1) == ["busy"]
        held.append(w.granted[-1][1])
    for _ in range(3):
        await w.add("new", demand("new", 2000, P, tier="std", decode=1992))
    await store.release(held.pop(0).id, actual_decode=4)
    assert await w.next_grants(1) == ["new"]
    held.append(w.granted[-1][1])
    # ...and its other two tickets are not left behind the queue either.
    shares: list[str] = []
    for _ in range(4):
        await store.release(held.pop(0).id, actual_decode=4)
        shares += await w.next_grants(1)
        held.append(w.granted[-1][1])
    assert labels_count(shares, "new") == 2, shares
    await w.cancel_rest(served=len(w.granted))
    for lease in held:
        await store.release(lease.id, actual_decode=4)
    await assert_idle(store)


async def test_tier_ceilings_keep_headroom_for_higher_tiers(store_factory: StoreFactory) -> None:
    store = await store_factory(layout([shared(P, 100)], ["a"]))
    leases = [await store.acquire(demand("a", 10, P, tier="batch"), 1) for _ in range(7)]
    w = Waiters(store)
    await w.add("batch", demand("a", 10, P, tier="batch"))  # 80 > 70: waits
    leases.append(await store.acquire(demand("a", 10, P, tier="standard"), 1))  # 80 <= 90
    leases.append(await store.acquire(demand("a", 10, P, tier="standard"), 1))  # 90 <= 90
    with pytest.raises(QueueTimeout):
        await store.acquire(demand("a", 10, P, tier="standard"), 0.02)  # 100 > 90
    leases.append(await store.acquire(demand("a", 10, P, tier="critical"), 1))  # 100 <= 100
    assert await in_flight(store, P) == 100
    assert await waiting(store) == 1
    for lease in leases[:3]:
        await store.release(lease.id)  # 70 in flight: batch still may not go to 80
    assert await waiting(store) == 1
    await store.release(leases[3].id)  # 60 in flight: 70 <= 70
    assert await w.next_grants(1) == ["batch"]
    for lease in [*leases[4:], w.granted[0][1]]:
        await store.release(lease.id)
    await assert_idle(store)


async def test_tenant_pool_blocked_ticket_blocks_nobody(
    store_factory: StoreFactory, clock: FakeClock
) -> None:
    pools = [shared(P, 100), private("tenant:a", 10), private("tenant:b", 100)]
    store = await store_factory(layout(pools, ["a", "b"]))
    mine = await store.acquire(demand("a", 10, P, "tenant:a"), 1)
    w = Waiters(store)
    # A critical ticket blocked by its own tenant budget, for far longer than the backfill limit...
    await w.add("a", demand("a", 10, P, "tenant:a", tier="critical"))
    clock.advance(60)
    # ...holds nothing: a lower tier of another tenant still gets the shared pool at once.
    other = await store.acquire(demand("b", 50, P, "tenant:b", tier="batch"), 1)
    await store.release(mine.id)
    assert await w.next_grants(1) == ["a"]
    for lease in (other, w.granted[0][1]):
        await store.release(lease.id)
    await assert_idle(store)


async def test_backfill_is_bounded_then_capacity_drains_to_the_big_ticket(
    store_factory: StoreFactory, clock: FakeClock
) -> None:
    store = await store_factory(
        layout([shared(P, 100)], ["x", "big", "small"], tiers=FLAT, backfill_limit_s=2.0)
    )
    held = await store.acquire(demand("x", 30, P, tier="std"), 1)
    w = Waiters(store)
    await w.add("big", demand("big", 80, P, tier="std"))  # 30 + 80 > 100: waits
    # Within the backfill limit, smaller tickets behind it pass it.
    s1 = await store.acquire(demand("small", 10, P, tier="std"), 1)
    clock.advance(1.0)
    s2 = await store.acquire(demand("small", 10, P, tier="std"), 1)
    clock.advance(1.5)
    # Past the limit, the pool is held for "big": small tickets queue although they would fit.
    await w.add("small", demand("small", 10, P, tier="std"))
    assert await in_flight(store, P) == 50
    await store.release(held.id)  # 20 in flight: big fits (100), then small (no room left)
    assert await w.next_grants(1) == ["big"]
    assert await in_flight(store, P) == 100
    assert await waiting(store) == 1
    await store.release(s1.id)
    assert await w.next_grants(1) == ["small"]
    for _, lease in w.granted:
        await store.release(lease.id)
    await store.release(s2.id)
    await assert_idle(store)


async def test_blocked_higher_tier_is_not_overtaken_by_lower_tiers(store_factory: StoreFactory) -> None:
    store = await store_factory(layout([shared(P, 100), shared(Q, 100)], ["a", "b"]))
    held = await store.acquire(demand("b", 50, P, tier="critical"), 1)
    w = Waiters(store)
    await w.add("critical-big", demand("a", 60, P, tier="critical"))
    # A lower tier may not take P while a critical ticket waits for it, even within the backfill limit...
    await w.add("batch-small", demand("b", 10, P, tier="batch"))
    # ...but traffic on other pools proceeds.
    other = await store.acquire(demand("a", 10, Q, tier="batch"), 1)
    await store.release(held.id)
    assert await w.next_grants(2) == ["critical-big", "batch-small"]
    for lease in [other] + [lease for _, lease in w.granted]:
        await store.release(lease.id)
    await assert_idle(store)


async def test_queue_full_with_retry_after(store_factory: StoreFactory) -> None:
    tenants = [TenantSpec("a", max_queue_len=2), TenantSpec("b")]
    store = await store_factory(layout([shared(P, 100), shared(Q, 100)], tenants))
    blocker = await store.acquire(demand("b", 100, P), 1)
    w = Waiters(store)
    await w.add("a", demand("a", 10, P))
    await w.add("a", demand("a", 10, P))
    with pytest.raises(QueueFull) as info:
        await store.acquire(demand("a", 10, P), 5)
    assert info.value.status == 429
    retry = info.value.retry_after_s
    assert retry is not None and 1.0 <= retry <= 30.0  # critical's max_queue_wait_s
    assert await waiting(store) == 2
    # A full queue refuses only what would have to wait: this is granted at once.
    other = await store.acquire(demand("a", 10, Q, tier="standard"), 5)
    await store.release(other.id)
    await store.release(blocker.id)
    await w.next_grants(2)
    for _, lease in w.granted:
        await store.release(lease.id)
    await assert_idle(store)


async def test_queue_timeout_withdraws_the_ticket(store_factory: StoreFactory, clock: FakeClock) -> None:
    store = await store_factory(layout([shared(P, 100)], ["a", "b"]))
    # Some recent release history so the estimate has a rate: 100 tokens/s for a while.
    for _ in range(20):
        lease = await store.acquire(demand("b", 100, P), 1)
        clock.advance(1.0)
        await store.release(lease.id)
    blocker = await store.acquire(demand("b", 100, P), 1)
    with pytest.raises(QueueTimeout) as info:
        await store.acquire(demand("a", 50, P), max_wait_s=0.03)
    retry = info.value.retry_after_s
    # 50 tokens needed at ~86 tokens/s (EWMA after 20 s of 100/s): about half a second, clamped to 1 s.
    assert retry == pytest.approx(1.0)
    assert await waiting(store) == 0
    with pytest.raises(QueueTimeout) as info:
        await store.acquire(demand("a", 10, P), max_wait_s=0)
    await store.release(blocker.id)
    await assert_idle(store)


async def test_each_waiter_times_out_at_its_own_deadline_whatever_the_arrival_order(
    store_factory: StoreFactory,
) -> None:
    store = await store_factory(layout([shared(P, 100)], ["a", "b", "c"]))
    blocker = await store.acquire(demand("c", 100, P), 1)
    order: list[str] = []
    at: list[float] = []
    loop = asyncio.get_running_loop()

    async def wait(label: str, tenant: str, max_wait_s: float) -> None:
        with pytest.raises(QueueTimeout):
            await store.acquire(demand(tenant, 10, P), max_wait_s)
        order.append(label)
        at.append(loop.time())

    tasks = []
    for label, tenant, wait_s in (("late", "a", 0.6), ("early", "b", 0.05), ("middle", "a", 0.25)):
        before = await waiting(store)
        tasks.append(asyncio.create_task(wait(label, tenant, wait_s)))
        await wait_queued(store, before + 1)
    await asyncio.gather(*tasks)
    assert order == ["early", "middle", "late"]
    # each at its own time (0.2 s and 0.35 s apart), not all at the first or the last deadline
    assert at[1] - at[0] > 0.08 and at[2] - at[1] > 0.08, at
    # A waiter granted long before its deadline leaves nothing that fires for a later one.
    granted = asyncio.create_task(store.acquire(demand("a", 10, P), 30))
    await wait_queued(store, 1)
    await store.release(blocker.id)
    lease = await asyncio.wait_for(granted, 5)
    full = await store.acquire(demand("c", 90, P), 1)
    with pytest.raises(QueueTimeout):
        await store.acquire(demand("b", 10, P), max_wait_s=0.05)
    for held in (lease, full):
        await store.release(held.id)
    await assert_idle(store)


async def test_retry_after_when_nothing_moves_is_the_tier_wait(store_factory: StoreFactory) -> None:
    store = await store_factory(layout([shared(P, 100)], ["a", "b"]))
    blocker = await store.acquire(demand("b", 100, P), 1)
    with pytest.raises(QueueTimeout) as info:
        await store.acquire(demand("a", 50, P, tier="standard"), max_wait_s=0.02)
    assert info.value.retry_after_s == pytest.approx(60.0)
    await store.release(blocker.id)


async def test_cancelled_waiter_leaks_nothing(store_factory: StoreFactory) -> None:
    store = await store_factory(layout([shared(P, 100)], ["a", "b"]))
    blocker = await store.acquire(demand("b", 100, P), 1)
    w = Waiters(store)
    task = await w.add("a", demand("a", 60, P))
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert await waiting(store) == 0
    await store.release(blocker.id)
    await assert_idle(store)


async def test_grant_racing_cancellation_is_given_back(store_factory: StoreFactory) -> None:
    store = await store_factory(layout([shared(P, 100)], ["a", "b"]))
    for _ in range(5):
        blocker = await store.acquire(demand("b", 100, P), 1)
        w = Waiters(store)
        task = await w.add("a", demand("a", 60, P))
        await store.release(blocker.id)  # grants the waiter (synchronously in the memory store)...
        task.cancel()  # ...but its task is cancelled before it could resume
        await asyncio.gather(task, return_exceptions=True)
        if w.granted:  # the task did resume first: its owner releases, as the gateway would
            await store.release(w.granted[0][1].id)

        async def idle() -> bool:
            snap = await store.snapshot()
            return snap.leases == 0 and snap.pools[P].in_flight == 0

        await eventually(idle)
    await assert_idle(store)


async def test_withdrawn_holder_unblocks_backfill(store_factory: StoreFactory, clock: FakeClock) -> None:
    store = await store_factory(
        layout([shared(P, 100)], ["x", "big", "small"], tiers=FLAT, backfill_limit_s=1.0)
    )
    held = await store.acquire(demand("x", 50, P, tier="std"), 1)
    w = Waiters(store)
    big = await w.add("big", demand("big", 80, P, tier="std"))
    clock.advance(5)
    await w.add("small", demand("small", 10, P, tier="std"))  # held back for "big"
    big.cancel()
    await asyncio.gather(big, return_exceptions=True)
    assert await w.next_grants(1) == ["small"]
    for lease in (held, w.granted[0][1]):
        await store.release(lease.id)
    await assert_idle(store)


async def test_close_fails_waiters(store_factory: StoreFactory) -> None:
    store = await store_factory(layout([shared(P, 100)], ["a", "b"]))
    await store.acquire(demand("b", 100, P), 1)
    task = asyncio.create_task(store.acquire(demand("a", 10, P), 10))
    await wait_queued(store, 1)
    assert await store.healthy()
    await store.close()
    with pytest.raises(StoreUnavailable, match="shutting down") as info:
        await task
    assert info.value.status == 503
    assert not await store.healthy()
    with pytest.raises(StoreUnavailable):
        await store.acquire(demand("a", 10, P), 1)

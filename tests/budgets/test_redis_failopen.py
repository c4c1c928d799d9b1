"""Fail-open recovery: when Redis comes back, nothing the local fallbacks admitted or queued may
push a pool over its capacity.

Each test counts what callers really hold (a lease is counted from the moment ``acquire`` returns
it until its caller lets go of it): that is what runs on the backend, whatever any store's books
say. Every test runs two RedisStore replicas (``replicas=2``: each fallback admits half of a pool)
against a real redis-server that is killed and restarted empty. The last tests check the
fallback's side of the hand-over (budgets/memory.py) on its own.
"""

from __future__ import annotations

import asyncio
import dataclasses
from dataclasses import dataclass

import pytest

from budgets.memory import MemoryStore
from budgets.redis import RedisStore
from budgets.redis.transport import Down
from budgets.types import BudgetLayout, Demand, Lease, QueueTimeout
from tests.budgets.redis_fixtures import (
    RedisServer,
    StoreMaker,
    crash,
    fresh_redis,
    make_store,
    unique_prefix,
)
from tests.budgets.support import (
    P,
    assert_idle,
    demand,
    eventually,
    in_flight,
    layout,
    shared,
    wait_queued,
    waiting,
)

__all__ = ["fresh_redis", "make_store"]  # fixtures used below
pytestmark = pytest.mark.redis_outage  # stores notice an outage within tenths of a second

CAPACITY = 100


def flat_layout() -> BudgetLayout:
    # Demands default to the critical tier, whose ceiling is the pool's whole capacity.
    return layout([shared(P, CAPACITY)], ["a", "b"], lease_ttl_s=5.0)


@dataclass
class Ledger:
    """Tokens callers hold right now (what the backend runs) and the most they ever held at once."""

    current: int = 0
    peak: int = 0

    async def acquire(self, store: RedisStore, d: Demand, max_wait_s: float) -> Lease:
        lease = await store.acquire(d, max_wait_s)
        self.current += d.cost
        self.peak = max(self.peak, self.current)
        return lease

    async def release(self, store: RedisStore, lease: Lease) -> None:
        self.current -= lease.demand.cost  # the request is over before its lease is handed back
        assert await store.release(lease.id)


async def replicas(
    make: StoreMaker,
    server: RedisServer,
    a_options: dict[str, object] | None = None,
    b_options: dict[str, object] | None = None,
) -> tuple[RedisStore, RedisStore]:
    prefix = unique_prefix()
    a = make(server, flat_layout(), prefix, fail_mode="open", replicas=2, **(a_options or {}))
    b = make(server, flat_layout(), prefix, fail_mode="open", replicas=2, **(b_options or {}))
    await a.start()
    await b.start()
    return a, b


async def outage(server: RedisServer, *stores: RedisStore) -> None:
    """Kill Redis and wait until every store has noticed (they admit locally from then on)."""
    server.kill()
    await eventually(lambda: all(s.degraded for s in stores), timeout_s=3.0)


async def assert_all_idle(*stores: RedisStore) -> None:
    for store in stores:
        await store.snapshot()  # a store's snapshot waits for its own write-behind releases
    for store in stores:
        await assert_idle(store)


async def recovered(*stores: RedisStore) -> None:
    await eventually(lambda: not any(s.degraded for s in stores), timeout_s=5.0)


async def test_recovery_moves_local_waiters_into_redis_in_order_and_never_over_admits(
    fresh_redis: RedisServer, make_store: StoreMaker
) -> None:
    a, b = await replicas(make_store, fresh_redis)
    ledger = Ledger()
    await outage(fresh_redis, a, b)
    full = await ledger.acquire(a, demand("a", 50, P), 1)  # a's whole local share (100 / 2)
    # Queued in a's fallback in this order: a30, a40 (same tenant: FIFO), b20.
    waiters = []
    for d in (demand("a", 30, P), demand("a", 40, P), demand("b", 20, P)):
        waiters.append(asyncio.create_task(ledger.acquire(a, d, 10)))
        await wait_queued(a, len(waiters))
    fresh_redis.restart()
    await recovered(a, b)
    # In Redis the local lease (50) is registered first, then the tickets in arrival order: a30
    # fits (80), a40 does not (120) and waits, b20 (another tenant) still fits (100). Moved the
    # other way round, a40 would have been granted and a30 would wait.
    await eventually(lambda: waiters[0].done() and waiters[2].done(), timeout_s=3.0)
    assert not waiters[1].done()
    # The pool is full in Redis too: another replica's request waits instead of running beside
    # grants Redis never saw.
    late = asyncio.create_task(ledger.acquire(b, demand("b", 50, P), 10))

    async def answered() -> bool:
        return late.done() or await waiting(b) == 2  # a40 and b50 queued in Redis

    await eventually(answered)
    assert not late.done(), f"granted beside local grants Redis never counted: {ledger}"
    assert await in_flight(a, P) == ledger.current == CAPACITY
    assert ledger.peak <= CAPACITY

    for lease in (full, waiters[0].result(), waiters[2].result()):
        await ledger.release(a, lease)
    await ledger.release(a, await asyncio.wait_for(waiters[1], 5))
    await ledger.release(b, await asyncio.wait_for(late, 5))
    assert ledger.peak <= CAPACITY, ledger
    assert ledger.current == 0
    await assert_all_idle(a, b)


async def test_a_moved_ticket_keeps_its_remaining_wait(
    fresh_redis: RedisServer, make_store: StoreMaker
) -> None:
    a, b = await replicas(make_store, fresh_redis)
    loop = asyncio.get_running_loop()
    ledger = Ledger()
    before = await ledger.acquire(a, demand("a", 40, P), 1)  # granted by Redis, still running
    await outage(fresh_redis, a, b)
    local = await ledger.acquire(a, demand("a", 50, P), 1)  # a's whole local share
    started = loop.time()
    late = asyncio.create_task(ledger.acquire(a, demand("b", 40, P), 1.2))
    await wait_queued(a, 1)
    await asyncio.sleep(0.5)  # the outage goes on for a while
    fresh_redis.restart()
    await recovered(a, b)
    recovered_after = loop.time() - started
    # 40 + 50 are registered in Redis, so 40 more do not fit while they run. The ticket waits in
    # the shared queue for what is left of its 1.2 s, then fails as any ticket does.
    with pytest.raises(QueueTimeout):
        await late
    waited = loop.time() - started
    assert 1.2 <= waited < recovered_after + 1.2, (waited, recovered_after)
    assert await in_flight(a, P) == ledger.current == 90
    assert ledger.peak <= CAPACITY
    for lease in (before, local):
        await ledger.release(a, lease)
    await assert_idle(a)


async def nothing_granted_until_b_registered(
    a: RedisStore, b: RedisStore, ledger: Ledger, on_a: Lease, on_b: Lease
) -> None:
    """a is back and Redis counts a's 50, not b's 50 (b still runs it locally): a grants nothing
    until b has recovered and registered it; then the pool is full and a's request queues."""
    extra = asyncio.create_task(ledger.acquire(a, demand("a", 30, P), 10))
    done, _ = await asyncio.wait({extra}, timeout=0.3)
    assert not done, f"granted before b's leases were registered: {ledger}"
    assert await b._failover.recover()
    await wait_queued(a, 1)  # now it waits in the shared queue: the pool is full
    assert await in_flight(a, P) == ledger.current == CAPACITY
    await ledger.release(b, on_b)
    await ledger.release(a, await asyncio.wait_for(extra, 5))
    await ledger.release(a, on_a)
    assert ledger.peak <= CAPACITY, ledger
    await assert_all_idle(a, b)


async def test_after_a_restart_no_replica_grants_before_the_others_re_registered(
    fresh_redis: RedisServer, make_store: StoreMaker
) -> None:
    # b probes Redis only every 60 s: the test says when it comes back.
    a, b = await replicas(
        make_store, fresh_redis, a_options={"settle_s": 5.0}, b_options={"probe_interval_s": 60}
    )
    ledger = Ledger()
    await outage(fresh_redis, a, b)
    on_a = await ledger.acquire(a, demand("a", 50, P), 1)
    on_b = await ledger.acquire(b, demand("b", 50, P), 1)
    fresh_redis.restart()
    await recovered(a)
    assert b.degraded
    # Redis counts a's 50 only, but b's 50 are running: nothing may be granted yet.
    await nothing_granted_until_b_registered(a, b, ledger, on_a, on_b)


async def test_a_recovery_that_failed_once_still_waits_for_the_other_replicas(
    fresh_redis: RedisServer, make_store: StoreMaker
) -> None:
    # a's first attempt reads Redis's new incarnation token and then fails (its connection breaks
    # mid-recovery). The retry must still know that Redis lost its data: before, it saw the token
    # it had just stored, took it for "nothing lost" and granted before b had re-registered.
    a, b = await replicas(
        make_store,
        fresh_redis,
        a_options={"settle_s": 5.0, "probe_interval_s": 60},
        b_options={"probe_interval_s": 60},
    )
    ledger = Ledger()
    await outage(fresh_redis, a, b)
    on_a = await ledger.acquire(a, demand("a", 50, P), 1)
    on_b = await ledger.acquire(b, demand("b", 50, P), 1)
    failover = a._failover
    real = failover._resync.reregister
    attempts = 0

    async def breaks_once() -> None:
        nonlocal attempts
        attempts += 1
        if attempts == 1:
            raise Down("injected: the connection broke during the recovery")
        await real()

    failover._resync = dataclasses.replace(failover._resync, reregister=breaks_once)

    async def stays_down() -> bool:
        return False

    b._failover.recover = stays_down  # type: ignore[method-assign]  # (until the test lets it)
    fresh_redis.restart()
    await eventually(failover.recover, timeout_s=5.0)
    assert attempts >= 2 and a.settling
    del b._failover.recover  # b may come back now
    await nothing_granted_until_b_registered(a, b, ledger, on_a, on_b)


async def test_grants_resume_after_the_settle_deadline_when_a_replica_never_comes_back(
    fresh_redis: RedisServer, make_store: StoreMaker
) -> None:
    a, b = await replicas(make_store, fresh_redis, a_options={"settle_s": 0.6})
    await outage(fresh_redis, a, b)
    await crash(b)  # dies during the outage: it will never re-register anything
    fresh_redis.restart()
    await recovered(a)
    assert a.settling  # b will never re-register: grants wait until the settle runs out
    task = asyncio.create_task(a.acquire(demand("a", 30, P), 5))
    await eventually(lambda: a.held_back == 1)
    lease = await asyncio.wait_for(task, 3.0)
    assert not a.settling
    assert await a.release(lease.id)
    await assert_idle(a)


async def test_a_request_cancelled_while_grants_wait_for_other_replicas_leaves_nothing_behind(
    fresh_redis: RedisServer, make_store: StoreMaker
) -> None:
    a, b = await replicas(
        make_store, fresh_redis, a_options={"settle_s": 5.0}, b_options={"probe_interval_s": 60}
    )
    await outage(fresh_redis, a, b)
    fresh_redis.restart()
    await recovered(a)
    task = asyncio.create_task(a.acquire(demand("a", 30, P), 10))
    await eventually(lambda: a.held_back == 1)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert a.held_back == 0
    assert await b._failover.recover()
    lease = await a.acquire(demand("a", 100, P), 5)  # the settle is over and nothing is left
    assert await a.release(lease.id)
    await assert_all_idle(a, b)


# ---- the fallback's side of the hand-over (budgets/memory.py) ----


class HandedOver(Exception):
    pass


async def test_a_paused_memory_store_grants_nothing_and_hands_its_waiters_over_oldest_first() -> None:
    store = MemoryStore(layout([shared(P, 50)], ["a", "b"]))
    await store.start()
    full = await store.acquire(demand("a", 50, P), 1)
    waiters = []
    for d in (demand("b", 30, P), demand("a", 30, P)):
        waiters.append(asyncio.create_task(store.acquire(d, 10)))
        await wait_queued(store, len(waiters))
    store.pause()
    assert await store.release(full.id)  # room for both now, but nothing is granted
    waiters.append(asyncio.create_task(store.acquire(demand("b", 10, P), 10)))  # nor on the fast path
    await wait_queued(store, 3)
    handed: list[Demand] = []

    def hand_over(d: Demand) -> BaseException:
        handed.append(d)
        return HandedOver(d.tenant)

    assert store.hand_over_waiting(hand_over) == 3
    for task in waiters:
        with pytest.raises(HandedOver):
            await task
    assert [(d.tenant, d.cost) for d in handed] == [("b", 30), ("a", 30), ("b", 10)]
    store.resume()
    await assert_idle(store)
    await store.close()


async def test_a_waiter_cancelled_after_its_hand_over_is_reported_unclaimed() -> None:
    unclaimed: list[Lease | BaseException] = []
    store = MemoryStore(layout([shared(P, 50)], ["a"]), on_unclaimed=unclaimed.append)
    await store.start()
    full = await store.acquire(demand("a", 50, P), 1)
    waiter = asyncio.create_task(store.acquire(demand("a", 30, P), 10))
    await wait_queued(store, 1)
    store.hand_over_waiting(HandedOver)
    waiter.cancel()  # before it could see what the hand-over decided
    with pytest.raises(asyncio.CancelledError):
        await waiter
    assert [type(x) for x in unclaimed] == [HandedOver]
    assert await store.release(full.id)
    await assert_idle(store)
    await store.close()

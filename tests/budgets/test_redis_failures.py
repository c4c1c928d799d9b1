"""The Redis store when things go wrong: Redis killed, hung or restarted (both fail modes),
scripts flushed, pub/sub messages lost, a replica dying with tokens and tickets, layout changes
reaching other replicas. Every test runs against a real redis-server.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest
from redis.asyncio import Redis

from budgets.redis import RedisStore
from budgets.redis.keys import SEP
from budgets.redis.replies import Outcome, Queued, status, withdraw
from budgets.types import BudgetLayout, Demand, QueueTimeout, StoreUnavailable
from tests.budgets.redis_fixtures import (
    RedisServer,
    StoreMaker,
    crash,
    fresh_redis,
    make_store,
    redis_server,
    unique_prefix,
)
from tests.budgets.support import (
    P,
    assert_idle,
    demand,
    eventually,
    in_flight,
    layout,
    private,
    shared,
    small_layout,
    wait_queued,
)

__all__ = ["fresh_redis", "make_store", "redis_server"]  # fixtures used below
pytestmark = pytest.mark.redis_outage  # stores notice an outage within tenths of a second


async def test_fail_closed_answers_fast_while_redis_is_down_and_recovers(
    fresh_redis: RedisServer, make_store: StoreMaker
) -> None:
    store = make_store(fresh_redis, small_layout(ttl=2.0))
    await store.start()
    held = await store.acquire(demand("a", 30, P, "tenant:a"), 1)
    fresh_redis.kill()
    started = time.monotonic()
    with pytest.raises(StoreUnavailable) as info:
        await store.acquire(demand("b", 10, P), 5)
    assert info.value.status == 503
    # Bounded by the configured timeouts (0.2 s each), not by the request's 5 s wait.
    assert time.monotonic() - started < 1.5
    assert not await store.healthy()
    with pytest.raises(StoreUnavailable):  # while down: refused at once, without touching Redis
        await store.acquire(demand("b", 10, P), 5)
    fresh_redis.restart()  # empty: layout, leases and scripts are gone

    async def healthy() -> bool:
        return await store.healthy()

    await eventually(healthy, timeout_s=5)
    # The in-flight lease was re-registered before anything else was granted.
    assert await in_flight(store, P) == 30
    assert await in_flight(store, "tenant:a") == 30
    lease = await store.acquire(demand("b", 70, P), 1)
    assert await store.release(held.id) is True
    assert await store.release(held.id) is False
    assert await store.release(lease.id)
    await assert_idle(store)


async def acquire_while_hung(server: RedisServer, store: RedisStore, d: Demand) -> None:
    """An acquire sent to a hung Redis (SIGSTOP) fails fast with StoreUnavailable; then Redis
    resumes (running what it had read) and the store recovers."""
    assert server.proc is not None
    os.kill(server.proc.pid, signal.SIGSTOP)
    try:
        started = time.monotonic()
        with pytest.raises(StoreUnavailable):
            await store.acquire(d, 5)
        assert time.monotonic() - started < 1.5
    finally:
        os.kill(server.proc.pid, signal.SIGCONT)
    await eventually(store.healthy, timeout_s=5)


async def test_fail_closed_times_out_on_a_hung_redis(
    fresh_redis: RedisServer, make_store: StoreMaker, caplog: pytest.LogCaptureFixture
) -> None:
    store = make_store(fresh_redis, small_layout())
    await store.start()
    # The acquire reaches Redis and runs when it resumes: its lease must not hold tokens until
    # the TTL, nobody will release it.
    await acquire_while_hung(fresh_redis, store, demand("a", 10, P))
    assert "budget store unreachable (redis did not answer within 0.2s)" in caplog.text
    lease = await store.acquire(demand("a", 10, P), 1)
    assert await store.release(lease.id)
    await assert_idle(store)


async def test_a_store_started_on_a_hung_redis_says_what_timed_out(
    fresh_redis: RedisServer, make_store: StoreMaker, caplog: pytest.LogCaptureFixture
) -> None:
    # The kernel accepts the connection; the handshake is never answered. asyncio's timeouts carry
    # no text, and "unreachable ()" told the operator nothing.
    store = make_store(fresh_redis, small_layout())
    assert fresh_redis.proc is not None
    os.kill(fresh_redis.proc.pid, signal.SIGSTOP)
    try:
        await store.start()
        assert not await store.healthy()
    finally:
        os.kill(fresh_redis.proc.pid, signal.SIGCONT)
    assert "budget store unreachable (redis did not " in caplog.text
    await eventually(store.healthy, timeout_s=5)
    lease = await store.acquire(demand("a", 10, P), 1)
    assert await store.release(lease.id)
    await assert_idle(store)


async def test_an_acquire_that_queued_while_redis_hung_leaves_no_ticket_behind(
    fresh_redis: RedisServer, make_store: StoreMaker
) -> None:
    # The pool is full, so the acquire sent just before Redis hangs queues a ticket when Redis
    # resumes; its caller has long been told 503. The recovery must withdraw that ticket, or the
    # next release grants it to nobody and the tokens stay out until the lease TTL.
    store = make_store(fresh_redis, small_layout())
    await store.start()
    full = await store.acquire(demand("b", 100, P), 1)
    await acquire_while_hung(fresh_redis, store, demand("a", 10, P))
    assert await store.release(full.id)
    await assert_idle(store)  # well before the 10 s lease TTL


async def test_fail_open_admits_a_local_share_and_hands_it_back(
    fresh_redis: RedisServer, make_store: StoreMaker
) -> None:
    store = make_store(fresh_redis, small_layout(ttl=2.0), fail_mode="open", replicas=4)
    await store.start()
    before = await store.acquire(demand("a", 20, P), 1)
    fresh_redis.kill()
    # Down: admitted against 100 // 4 = 25 tokens of P on this replica.
    local = await store.acquire(demand("b", 25, P), 1)
    assert store.degraded and await store.healthy()
    with pytest.raises(QueueTimeout):
        await store.acquire(demand("b", 1, P), 0.05)
    fresh_redis.restart()

    async def recovered() -> bool:
        return not store.degraded

    await eventually(recovered, timeout_s=5)
    # Both the pre-outage lease and the fail-open one are now counted in Redis.
    assert await in_flight(store, P) == 45
    for lease in (before, local):
        assert await store.release(lease.id)
    await assert_idle(store)


async def test_release_during_an_outage_is_applied_on_recovery(
    redis_server: RedisServer, make_store: StoreMaker
) -> None:
    store = make_store(redis_server, small_layout())
    await store.start()
    lease = await store.acquire(demand("a", 40, P), 1)
    store._failover.mark_down(RuntimeError("simulated partition"))  # Redis keeps its data this time
    assert await store.release(lease.id) is True

    async def recovered() -> bool:
        return not store.degraded

    await eventually(recovered, timeout_s=5)
    await assert_idle(store)


async def test_grant_wakes_another_replica_through_pubsub(
    redis_server: RedisServer, make_store: StoreMaker
) -> None:
    prefix = unique_prefix()
    lay = small_layout()
    # Polling every 30 s: a grant that arrives within a second came by pub/sub.
    a = make_store(redis_server, lay, prefix, poll_interval_s=30.0, maintenance_interval_s=0.1)
    b = make_store(redis_server, lay, prefix)
    await a.start()
    await b.start()
    blocker = await b.acquire(demand("b", 100, P), 1)
    task = asyncio.create_task(a.acquire(demand("a", 50, P), 10))
    await wait_queued(b, 1)
    await b.release(blocker.id)
    lease = await asyncio.wait_for(task, 1.0)
    assert lease.queued_s > 0
    assert await a.release(lease.id)
    await assert_idle(a)  # a store reads its own (write-behind) releases


async def test_lost_wakeup_is_found_by_polling(redis_server: RedisServer, make_store: StoreMaker) -> None:
    prefix = unique_prefix()
    a = make_store(redis_server, small_layout(), prefix)
    b = make_store(redis_server, small_layout(), prefix)
    await a.start()
    await b.start()
    a._tasks[0].cancel()  # a's pub/sub listener is gone: every wake-up message is lost
    blocker = await b.acquire(demand("b", 100, P), 1)
    task = asyncio.create_task(a.acquire(demand("a", 50, P), 10))
    await wait_queued(b, 1)
    await b.release(blocker.id)
    lease = await asyncio.wait_for(task, 2.0)
    assert await a.release(lease.id)
    await assert_idle(a)  # a store reads its own (write-behind) releases


async def test_a_grant_that_overtakes_its_own_queued_reply_is_kept_for_the_waiter(
    redis_server: RedisServer, make_store: StoreMaker
) -> None:
    # The order a busy event loop can produce: the acquire script has queued the ticket and
    # replied, but before the acquire resumes to register its waiter, a release's reply carrying
    # the grant is read. The two halves of acquire are run by hand to force that order; with
    # polling every 30 s, a grant dropped on arrival would leave the waiter stuck.
    store = make_store(redis_server, small_layout(), poll_interval_s=30.0)
    await store.start()
    blocker = await store.acquire(demand("b", 100, P), 1)
    d = demand("a", 50, P)
    lease_id = store._new_lease_id()
    loop = asyncio.get_running_loop()
    started = loop.time()
    ticket = await store._enqueue(lease_id, d)
    assert isinstance(ticket, Queued)
    await store.release(blocker.id)  # write-behind: its reply wakes ticket.seq ...
    await store._transport.drain(1.0)  # ... and has been read here, with nobody waiting for it yet
    lease = await asyncio.wait_for(store._wait(ticket, lease_id, d, 10, started), 1.0)
    assert lease.id == lease_id
    assert await store.release(lease.id)
    await assert_idle(store)


async def test_a_wake_up_kept_from_before_a_redis_restart_never_grants_a_new_ticket_with_its_seq(
    fresh_redis: RedisServer, make_store: StoreMaker
) -> None:
    # A Redis that restarted empty numbers its tickets from 1 again. A wake-up the store kept for
    # a waiter that never came (here: a grant read before anyone registered for it, as in the
    # test above, whose waiter then never waits) must not grant the new ticket that reuses its
    # seq: that request would run on the GPU with nothing counted for it in Redis.
    store = make_store(fresh_redis, small_layout())
    await store.start()
    blocker = await store.acquire(demand("b", 100, P), 1)
    stale_id = store._new_lease_id()
    stale = await store._enqueue(stale_id, demand("a", 50, P))
    assert isinstance(stale, Queued) and stale.seq == 1
    await store.release(blocker.id)  # its reply grants seq 1 ...
    await store._transport.drain(1.0)  # ... and is kept here, for a waiter that never comes
    assert await store.release(stale_id)
    await assert_idle(store)

    fresh_redis.kill()
    with pytest.raises(StoreUnavailable):
        await store.acquire(demand("b", 10, P), 1)
    fresh_redis.restart()  # empty: the next ticket is seq 1 again
    await eventually(store.healthy, timeout_s=5)
    blocker = await store.acquire(demand("b", 100, P), 1)
    with pytest.raises(QueueTimeout):  # a full pool: nothing is granted before its wait is over
        await store.acquire(demand("a", 50, P), 0.5)
    assert await in_flight(store, P) == 100
    assert await store.release(blocker.id)
    await assert_idle(store)


async def test_an_older_versions_wake_up_is_never_kept_for_a_ticket_that_comes_later(
    redis_server: RedisServer, make_store: StoreMaker
) -> None:
    # A wake-up without a lease id (an older replica's format, during a rolling upgrade) names its
    # ticket by seq alone: handed to a waiter registered when it arrives, or dropped, never kept
    # for a later ticket that may reuse the seq after a restart.
    store = make_store(redis_server, small_layout())
    await store.start()
    blocker = await store.acquire(demand("b", 100, P), 1)
    raw = Redis.from_url(redis_server.url, decode_responses=True)
    next_seq = int(await raw.get(f"{store.keys.tag}:seq") or 0) + 1
    await raw.aclose()
    store._on_wake(SEP.join(["G", str(next_seq), "12.5", "0.0"]))  # nobody waits for it yet
    with pytest.raises(QueueTimeout):
        await store.acquire(demand("a", 50, P), 0.3)
    assert await store.release(blocker.id)
    await assert_idle(store)


async def test_a_poll_or_withdrawal_that_names_another_lease_never_touches_the_ticket_with_that_seq(
    fresh_redis: RedisServer, make_store: StoreMaker
) -> None:
    # After a restart a waiter (or a withdrawal deferred through the outage) can carry a seq that
    # now names another replica's ticket: that ticket is not its to see as waiting, or to take
    # out of the queue.
    prefix = unique_prefix()
    a = make_store(fresh_redis, small_layout(), prefix)
    b = make_store(fresh_redis, small_layout(), prefix)
    await a.start()
    await b.start()
    blocker = await a.acquire(demand("b", 100, P), 1)
    queued = asyncio.create_task(b.acquire(demand("a", 50, P), 10))
    await wait_queued(a, 1)
    stale_id = a._new_lease_id()
    assert status(await a._transport.eval("status", ["1", stale_id])) is Outcome.UNKNOWN
    assert withdraw(await a._transport.eval("withdraw", ["1", stale_id, "1"])) is Outcome.UNKNOWN
    await wait_queued(a, 1)  # b's ticket 1 is still in the queue ...
    await a.release(blocker.id)
    lease = await asyncio.wait_for(queued, 5)  # ... and granted when room frees up
    assert await b.release(lease.id)
    await assert_idle(b)  # a store reads its own (write-behind) releases


async def test_dead_replica_returns_its_tokens_and_tickets(
    redis_server: RedisServer, make_store: StoreMaker
) -> None:
    prefix = unique_prefix()
    lay = small_layout(ttl=0.5)
    doomed = make_store(redis_server, lay, prefix)
    survivor = make_store(redis_server, lay, prefix)
    await doomed.start()
    await survivor.start()
    await doomed.acquire(demand("a", 60, P), 1)
    queued = asyncio.create_task(doomed.acquire(demand("a", 60, P), 30))
    await wait_queued(survivor, 1)
    await crash(doomed)
    queued.cancel()

    async def drained() -> bool:
        snap = await survivor.snapshot()
        return snap.pools[P].in_flight == 0 and sum(snap.queue_depth.values()) == 0

    # One lease TTL (0.5 s) plus a reap period, with room for a loaded machine.
    await eventually(drained, timeout_s=3.0)
    lease = await survivor.acquire(demand("b", 100, P), 1)
    assert await survivor.release(lease.id)
    await assert_idle(survivor)


async def test_heartbeat_reregisters_a_lease_redis_forgot(
    redis_server: RedisServer, make_store: StoreMaker
) -> None:
    store = make_store(redis_server, small_layout())
    await store.start()
    lease = await store.acquire(demand("a", 25, P, "tenant:a"), 1)
    # Redis loses the lease state but keeps the layout (say a failover to a lagging replica).
    raw = Redis.from_url(redis_server.url)
    await raw.delete(*(f"{store.keys.tag}:{k}" for k in ("used", "leases", "lexp", "tleases")))
    await raw.aclose()
    assert await in_flight(store, P) == 0
    await store.heartbeat([lease.id])
    assert store.restored_leases == 1
    assert (await store.snapshot()).leases == 1
    assert await store.release(lease.id) is True
    await assert_idle(store)


async def test_a_lease_restored_after_redis_forgot_it_holds_its_limit_in_its_tenants_budget(
    redis_server: RedisServer, make_store: StoreMaker
) -> None:
    # A learned reservation (10 of a limit of 50), grown once: restored, the tenant's budget holds
    # the limit again and P what the lease had grown to; released, nothing is left anywhere.
    store = make_store(redis_server, small_layout())
    await store.start()
    lease = await store.acquire(Demand("a", "critical", (P, "tenant:a"), 5, 10, decode_limit=50), 1)
    assert await store.extend(lease.id, 10) == 0
    assert (await in_flight(store, P), await in_flight(store, "tenant:a")) == (25, 55)
    raw = Redis.from_url(redis_server.url)
    await raw.delete(*(f"{store.keys.tag}:{k}" for k in ("used", "leases", "lexp", "tleases")))
    await raw.aclose()
    await store.heartbeat([lease.id])
    assert store.restored_leases == 1
    assert (await in_flight(store, P), await in_flight(store, "tenant:a")) == (25, 55)
    assert await store.release(lease.id, 20) is True
    await assert_idle(store)


async def test_layout_change_reaches_other_replicas(
    redis_server: RedisServer, make_store: StoreMaker
) -> None:
    prefix = unique_prefix()
    a = make_store(redis_server, small_layout(), prefix)
    b = make_store(redis_server, small_layout(), prefix)
    await a.start()
    await b.start()
    seen: list[BudgetLayout] = []
    b.add_layout_listener(seen.append)
    bigger = layout([shared(P, 500), private("tenant:a", 100)], ["a", "b", "c"])
    await a.apply_layout(bigger)

    def adopted() -> bool:
        return b.layout.pools[P].capacity == 500 and "c" in b.layout.tenants

    await eventually(adopted, timeout_s=2.0)
    assert seen == [b.layout]
    lease = await b.acquire(demand("c", 400, P), 1)
    assert await b.release(lease.id)
    await assert_idle(b)


async def test_write_behind_release_is_idempotent_and_read_by_its_store(
    redis_server: RedisServer, make_store: StoreMaker
) -> None:
    store = make_store(redis_server, small_layout(ttl=5.0))
    await store.start()
    lease = await store.acquire(demand("a", 40, P), 1)
    assert await store.release(lease.id) is True  # acknowledged before Redis applied it
    assert await store.release(lease.id) is False  # while on its way
    assert await in_flight(store, P) == 0  # the store's own snapshot waits for it
    assert await store.release(lease.id) is False  # and after
    await assert_idle(store)


async def test_release_after_the_ttl_asks_redis_and_reports_a_reaped_lease(
    redis_server: RedisServer, make_store: StoreMaker
) -> None:
    store = make_store(redis_server, small_layout(ttl=0.3), maintenance_interval_s=0.05)
    await store.start()
    lease = await store.acquire(demand("a", 40, P), 1)

    async def reaped() -> bool:
        return await in_flight(store, P) == 0

    await eventually(reaped, timeout_s=3.0)  # never heartbeated: reaped by the maintenance loop
    assert await store.release(lease.id) is False
    await assert_idle(store)

"""The Redis store through Sentinel, for real: a primary, its replica and three sentinels on loopback.
The primary is killed (or demoted) under the store; it follows the failover without a restart,
grants nothing past what its live leases leave meanwhile, and leaks nothing afterwards."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import pytest

from budgets.redis.sentinel import SentinelSpec, parse_sentinel_url
from budgets.types import Lease, QueueTimeout, StoreUnavailable
from loadtest.redis_server import SentinelGroup
from tests.budgets.redis_fixtures import StoreMaker, make_store
from tests.budgets.support import P, assert_idle, demand, eventually, in_flight, small_layout

__all__ = ["make_store"]  # a fixture used below
# No redis_outage mark: a killed primary refuses at once and a demoted one answers READONLY at once,
# so the store needs no short timeouts to notice; short ones made a slow healthy call right after a
# failover (the new primary busy syncing, on a loaded machine) read as one more outage.


@pytest.fixture
def sentinels() -> Iterator[SentinelGroup]:
    group = SentinelGroup().start()
    try:
        yield group
    finally:
        group.stop()


async def grants_while_down(store: object, stop: asyncio.Event) -> list[Lease]:
    """Keep asking for 50 of P's 100 while another lease holds 60: any grant is over-admission."""
    from budgets.redis import RedisStore

    assert isinstance(store, RedisStore)
    granted = []
    while not stop.is_set():
        try:
            granted.append(await store.acquire(demand("b", 50, P), 0.2))
        except (StoreUnavailable, QueueTimeout):
            await asyncio.sleep(0.02)
    return granted


async def grants(store: object) -> bool:
    """Whether the store grants (and then releases) 20 of P now."""
    from budgets.redis import RedisStore

    assert isinstance(store, RedisStore)
    try:
        lease = await store.acquire(demand("b", 20, P), 0.5)
    except (StoreUnavailable, QueueTimeout):
        return False
    await store.release(lease.id, 0)
    return True


async def test_the_store_follows_the_primarys_death_to_the_new_primary_over_admitting_nothing(
    sentinels: SentinelGroup, make_store: StoreMaker
) -> None:
    store = make_store(sentinels.primary, small_layout(ttl=2.0), url=sentinels.url)
    await store.start()
    held = await store.acquire(demand("a", 60, P, "tenant:a"), 1)
    stop = asyncio.Event()
    prober = asyncio.create_task(grants_while_down(store, stop))
    killed_at = time.monotonic()
    old = sentinels.kill_primary()
    await asyncio.to_thread(sentinels.wait_primary_change, old)

    async def serving() -> bool:
        return await store.healthy() and await in_flight(store, P) == 60

    # Serving again, with the running lease held on the new primary (replicated, or re-registered).
    await eventually(serving, timeout_s=10, message="the store did not follow the failover")
    took = time.monotonic() - killed_at
    await asyncio.sleep(0.5)  # the prober keeps asking on the new primary
    stop.set()
    assert await prober == []  # nothing granted past the 60 the lease holds: never over capacity
    assert took < 10, took
    resolver = store._transport.resolver
    assert resolver is not None and resolver.resolved >= 2  # the old primary, then the new one
    described = store.describe()
    assert (described["topology"], described["node"]) == ("sentinel", f"127.0.0.1:{sentinels.primary_port()}")
    assert await store.release(held.id, 0)
    lease = await store.acquire(demand("b", 50, P), 2)  # fits now
    assert await store.release(lease.id, 0)
    await assert_idle(store)


async def test_a_demoted_primary_that_answers_readonly_sends_the_store_to_the_new_one(
    sentinels: SentinelGroup, make_store: StoreMaker
) -> None:
    """A manual failover: the old primary stays up as a replica, its connections open; the store's
    next write there gets READONLY, and it reconnects to the primary the sentinels name."""
    store = make_store(sentinels.primary, small_layout(ttl=2.0), url=sentinels.url)
    await store.start()
    before = await store.acquire(demand("a", 30, P, "tenant:a"), 1)
    old = sentinels.primary_port()
    assert old is not None
    sentinels.failover()
    await asyncio.to_thread(sentinels.wait_primary_change, old)

    await eventually(
        lambda: grants(store), timeout_s=10, message="the store kept writing to the demoted primary"
    )
    assert await in_flight(store, P) == 30
    assert await store.release(before.id, 0)
    await assert_idle(store)


async def test_sentinels_and_data_nodes_that_ask_for_passwords_are_given_theirs(
    make_store: StoreMaker,
) -> None:
    """``requirepass`` on the data nodes (the URL's user info) and on the sentinels
    (``sentinel_password``), each its own: the store resolves, grants and follows a failover; a
    wrong sentinel password is a store that is down, saying why, never a grant."""
    group = SentinelGroup(password="d@ta/p#1", sentinel_password="s&p=1").start()
    try:
        store = make_store(group.primary, small_layout(ttl=2.0), url=group.url)
        await store.start()
        held = await store.acquire(demand("a", 30, P, "tenant:a"), 1)
        old = group.primary_port()
        assert old is not None
        group.failover()
        await asyncio.to_thread(group.wait_primary_change, old)

        await eventually(
            lambda: grants(store),
            timeout_s=10,
            message="the store did not follow the failover with passwords",
        )
        assert await in_flight(store, P) == 30
        assert await store.release(held.id, 0)
        await assert_idle(store)

        wrong = make_store(group.primary, small_layout(), url=group.url.replace("s%26p%3D1", "not-it"))
        with pytest.raises(StoreUnavailable):
            await wrong.start()
            await wrong.acquire(demand("c", 10, P), 0.5)
        assert not await wrong.healthy()
        resolver = wrong._transport.resolver
        assert resolver is not None
        with pytest.raises(Exception, match=r"no sentinel gave the primary.*(WRONGPASS|invalid password)"):
            await resolver()
    finally:
        group.stop()


def test_a_sentinel_url_names_the_sentinels_the_master_and_the_data_nodes_credentials() -> None:
    assert parse_sentinel_url(
        "redis+sentinel://:s3cret@10.0.0.1:26379,[::1]:26380/mymaster/2"
    ) == SentinelSpec((("10.0.0.1", 26379), ("::1", 26380)), "mymaster", 2, None, "s3cret")
    assert parse_sentinel_url("redis+sentinel://u:p@s1:26379/m") == SentinelSpec(
        (("s1", 26379),), "m", 0, "u", "p"
    )
    # The sentinels' own credentials, from the query string.
    assert parse_sentinel_url(
        "redis+sentinel://:d@s1:26379/m?sentinel_password=s%26p&sentinel_username=watcher"
    ) == SentinelSpec((("s1", 26379),), "m", 0, None, "d", "watcher", "s&p")
    for bad, says in (
        ("redis+sentinel://s1/m", "expected host:port"),
        ("redis+sentinel://s1:26379", "master's name"),
        ("redis+sentinel://s1:26379/m/x", "db 'x'"),
        ("redis+sentinel://s1:99999/m", "expected host:port"),
        (
            "redis+sentinel://s1:26379/m?password=x",
            "query 'password': expected sentinel_username=... or sentinel_password=...",
        ),
    ):
        with pytest.raises(ValueError, match=says):
            parse_sentinel_url(bad)

"""A real ``redis-server`` for tests (``loadtest.redis_server``, shared with the benchmarks): started
on a free port in a temp dir, with kill/restart helpers.

Import the fixtures into a test module or conftest: ``from tests.budgets.redis_fixtures import
redis_server, fresh_redis``. ``redis_server`` is one server per test session (tests isolate
themselves with a unique key prefix, and never change what the whole server holds or runs: no
FLUSH of data, functions or scripts, no ACL or CONFIG change); ``scratch_redis`` is one server per
module for tests that do change the whole server; ``fresh_redis`` is a private server per test, for
tests that kill or restart it. ``make_store`` builds RedisStore replicas on either (short timeouts in a
module marked ``redis_outage``), and ``crash`` stops one the way SIGKILL would.
"""

from __future__ import annotations

import asyncio
import atexit
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from typing import TYPE_CHECKING

import pytest

from budgets.types import BudgetLayout, BudgetStore
from loadtest.redis_server import RedisCluster, RedisServer

if TYPE_CHECKING:
    from budgets.redis import RedisStore


def unique_prefix() -> str:
    return f"t{uuid.uuid4().hex[:10]}"


class _Session:
    """The one shared server of a test run, started on first use and stopped at exit.

    Store factories (tests/budgets/conftest.py) get only a layout and a clock, so they reach the
    server through here rather than through a fixture argument.
    """

    server: RedisServer | None = None

    @classmethod
    def get(cls) -> RedisServer:
        if cls.server is None or not cls.server.running:
            server = RedisServer()
            server.start()
            atexit.register(server.stop)
            cls.server = server
        return cls.server


def session_redis() -> RedisServer:
    return _Session.get()


class _SessionCluster:
    """The one Redis Cluster (three primaries) of a test run, started on first use."""

    cluster: RedisCluster | None = None

    @classmethod
    def get(cls) -> RedisCluster:
        if cls.cluster is None or not all(n.running for n in cls.cluster.nodes):
            cluster = RedisCluster()
            cluster.start()
            atexit.register(cluster.stop)
            cls.cluster = cluster
        return cls.cluster


def session_cluster() -> RedisCluster:
    return _SessionCluster.get()


def prefixes_on_distinct_shards(cluster: RedisCluster, n: int) -> list[str]:
    """``n`` fresh key prefixes (budget domains) whose slots ``n`` different primaries own."""
    from budgets.redis.cluster import slot_of

    owners: dict[int, str] = {}
    while len(owners) < n:
        prefix = unique_prefix()
        owners.setdefault(cluster.owner(slot_of("{tg:" + prefix + "}")).port, prefix)
    return list(owners.values())


async def redis_store_factory(layout: BudgetLayout, clock: Callable[[], float]) -> BudgetStore:
    """The contract suite's factory: a RedisStore on a fresh key prefix, driven by the test clock
    (its Lua code as a Redis 7 function library, the default)."""
    return _contract_store(layout, clock, "functions")


async def redis_scripts_store_factory(layout: BudgetLayout, clock: Callable[[], float]) -> BudgetStore:
    """The same with the Lua code run as EVALSHA scripts (what a Redis 6 gets)."""
    return _contract_store(layout, clock, "scripts")


async def redis_cluster_store_factory(layout: BudgetLayout, clock: Callable[[], float]) -> BudgetStore:
    """The same on a three-primary Redis Cluster: each test's prefix is a domain in one slot, so the
    suite's domains spread over the shards."""
    return _contract_store(layout, clock, "functions", url=session_cluster().url)


def _contract_store(
    layout: BudgetLayout, clock: Callable[[], float], lua: str, url: str | None = None
) -> BudgetStore:
    from budgets.redis import RedisOptions, RedisStore

    # Own grants reach a waiter in the script reply, so the suite needs no polling; a poll in
    # flight could also hand a waiter its grant while the test is about to cancel it, which the
    # suite's "serve n, then cancel the rest" pattern does not expect. Calls may take 5 s: the
    # contract is not about outages (test_redis_failures is), and a test process that stalls half
    # a second late in a full CI run (a collection of its large heap) must not see "Redis is down"
    # (a waiter of 0.6 s once failed that way with the default 0.5 s).
    options = RedisOptions(
        url=url or session_redis().url,
        key_prefix=unique_prefix(),
        poll_interval_s=5.0,
        maintenance_interval_s=0.02,
        op_timeout_s=5.0,
        lua="scripts" if lua == "scripts" else "functions",
    )
    return RedisStore(layout, options, clock=clock)


@pytest.fixture(scope="session")
def redis_server() -> RedisServer:
    return session_redis()


def _own_server() -> Iterator[RedisServer]:
    server = RedisServer()
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def scratch_redis() -> Iterator[RedisServer]:
    """A server of the module's own: its tests may flush it, add ACL users or change its config
    without reaching another module's stores on the session server."""
    yield from _own_server()


@pytest.fixture
def fresh_redis() -> Iterator[RedisServer]:
    yield from _own_server()


# ---- RedisStore replicas for failure tests ----

# Short timeouts and polling: an outage is noticed, and a recovery made, within a few tenths of a second.
# Only for tests that break Redis on purpose (marked ``redis_outage``): on a loaded 2-core machine a
# healthy call can take past 0.2 s, and a test about something else would see "Redis is down".
FAST = {"connect_timeout_s": 0.2, "op_timeout_s": 0.2, "poll_interval_s": 0.05}
# Every other test: timeouts a slow healthy call stays well inside, polling as quick as FAST's.
STEADY = {"connect_timeout_s": 5.0, "op_timeout_s": 5.0, "poll_interval_s": 0.05}

StoreMaker = Callable[..., "RedisStore"]


@pytest.fixture
async def make_store(request: pytest.FixtureRequest) -> AsyncIterator[StoreMaker]:
    """``make(server, layout, prefix=None, **options)``: an unstarted RedisStore (FAST options in a
    test marked ``redis_outage``, STEADY in any other, unless overridden); stores sharing a prefix
    are replicas of one domain. All are closed at teardown."""
    from budgets.redis import RedisOptions, RedisStore

    made: list[RedisStore] = []
    timeouts = FAST if request.node.get_closest_marker("redis_outage") else STEADY

    def make(
        server: RedisServer, lay: BudgetLayout, prefix: str | None = None, **options: object
    ) -> RedisStore:
        given = {"url": server.url, "key_prefix": prefix or unique_prefix(), **timeouts, **options}
        opts = RedisOptions(**given)  # type: ignore[arg-type]
        store = RedisStore(lay, opts)
        made.append(store)
        return store

    yield make
    for store in made:
        await store.close()


async def crash(store: RedisStore) -> None:
    """What SIGKILL does to a replica: no more heartbeats, liveness, withdrawals or releases."""
    store._closed = True
    for task in store._tasks:
        task.cancel()
    await asyncio.wait(store._tasks, timeout=2)
    await store._transport.close()

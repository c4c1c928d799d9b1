"""How the Redis store runs its Lua code (budgets/redis/scripts.py): a Redis 7 function library by
default, EVALSHA scripts on a server without FCALL or FUNCTION, and code Redis lost (flushed,
restarted) loaded again without running an operation twice. Every test uses a real redis-server;
"Redis 6" is a Redis 7 with the commands renamed away, which answers exactly as an old one does.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest
from redis.asyncio import Redis

from budgets.redis import RedisStore
from budgets.redis.keys import pack_demand
from budgets.redis.scripts import ENTRY_SCRIPTS, ScriptRunner, load_library, load_scripts
from loadtest.redis_server import RedisServer
from tests.budgets.redis_fixtures import (
    StoreMaker,
    fresh_redis,
    make_store,
    redis_server,
    scratch_redis,
    unique_prefix,
)
from tests.budgets.support import P, assert_idle, demand, in_flight, layout, private, shared, small_layout

__all__ = ["fresh_redis", "make_store", "redis_server", "scratch_redis"]  # fixtures used below


async def serves_one_request(store: RedisStore, lua_mode: str) -> None:
    """A request is admitted and returned, with the Lua code running as ``lua_mode``."""
    lease = await store.acquire(demand("a", 10, P), 1)
    assert store.lua_mode == lua_mode
    assert await store.release(lease.id)
    await assert_idle(store)


async def flush_functions(server: RedisServer) -> None:
    """FUNCTION FLUSH: the library is gone, as after a restart without persistence."""
    client = Redis.from_url(server.url)
    try:
        await client.function_flush()
    finally:
        await client.aclose()


def server_without(*commands: str) -> Iterator[RedisServer]:
    args: list[str] = []
    for command in commands:
        args += ["--rename-command", command, ""]
    server = RedisServer(extra_args=args)
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def redis_without_fcall() -> Iterator[RedisServer]:
    yield from server_without("FCALL", "FCALL_RO", "FUNCTION")


@pytest.fixture
def redis_without_function_load() -> Iterator[RedisServer]:
    yield from server_without("FUNCTION")


def test_the_library_holds_every_entry_under_names_that_change_with_the_code() -> None:
    library = load_library()
    assert set(library.functions) == set(ENTRY_SCRIPTS)
    assert library.code.startswith(f"#!lua name={library.name}\n")
    digest = library.name.removeprefix("tokengate_")
    assert all(fn == f"tg_{digest}_{name}" for name, fn in library.functions.items())
    # the scripts are built from the same files: the digest covers lib.lua and every entry file
    assert all("local function grant_pass(" in script.source for script in load_scripts().values())


async def test_the_store_runs_the_function_library_on_redis_7(
    redis_server: RedisServer, make_store: StoreMaker
) -> None:
    store = make_store(redis_server, small_layout())
    await store.start()
    await serves_one_request(store, "functions")
    client = Redis.from_url(redis_server.url, decode_responses=True)
    try:
        names = [
            dict(zip(lib[::2], lib[1::2], strict=True))["library_name"]
            for lib in await client.function_list()
        ]
    finally:
        await client.aclose()
    assert load_library().name in names


@pytest.mark.parametrize(("lua", "flush"), [("functions", "FUNCTION"), ("scripts", "SCRIPT")])
async def test_code_redis_lost_is_loaded_again_and_the_call_runs_once(
    scratch_redis: RedisServer, make_store: StoreMaker, lua: str, flush: str
) -> None:
    store = make_store(scratch_redis, small_layout(), lua=lua)
    await store.start()
    client = Redis.from_url(scratch_redis.url)
    try:
        await client.execute_command(flush, "FLUSH")
    finally:
        await client.aclose()
    lease = await store.acquire(demand("a", 10, P), 1)
    assert store.script_reloads >= 1
    assert store.lua_mode == lua
    assert await in_flight(store, P) == 10  # charged once, not once per attempt
    assert await store.release(lease.id)
    await assert_idle(store)


async def test_a_redis_without_fcall_gets_scripts_and_the_same_decisions(
    redis_without_fcall: RedisServer, make_store: StoreMaker
) -> None:
    store = make_store(redis_without_fcall, small_layout())
    await store.start()
    assert store.lua_mode == "scripts"
    first = await store.acquire(demand("a", 60, P), 1)
    second = await store.acquire(demand("b", 30, P), 1)
    waiting = asyncio.ensure_future(store.acquire(demand("b", 30, P), 5))
    await asyncio.sleep(0.05)
    assert not waiting.done()  # 90 of 100 in flight: the third waits
    assert await store.release(first.id)
    third = await asyncio.wait_for(waiting, 2)
    assert await in_flight(store, P) == 60
    for lease in (second, third):
        assert await store.release(lease.id)
    await assert_idle(store)


async def test_a_redis_that_refuses_function_load_gets_scripts(
    redis_without_function_load: RedisServer, make_store: StoreMaker
) -> None:
    store = make_store(redis_without_function_load, small_layout())
    await store.start()
    await serves_one_request(store, "scripts")


async def user_without_functions(server: RedisServer) -> str:
    """A URL for a new ACL user who may run scripts but not FCALL or FUNCTION."""
    user = f"tg{unique_prefix()}".replace("-", "")
    client = Redis.from_url(server.url)
    try:
        await client.function_flush()
        await client.execute_command(
            "ACL", "SETUSER", user, "on", ">pw", "~*", "&*", "+@all", "-fcall", "-fcall_ro", "-function"
        )
    finally:
        await client.aclose()
    return server.url.replace("redis://", f"redis://{user}:pw@")


async def test_a_user_whose_acl_allows_scripts_but_not_functions_gets_scripts(
    scratch_redis: RedisServer, make_store: StoreMaker
) -> None:
    url = await user_without_functions(scratch_redis)
    store = make_store(scratch_redis, small_layout(), url=url)
    await store.start()
    await serves_one_request(store, "scripts")


async def test_replicas_loading_the_library_at_once_all_succeed(
    scratch_redis: RedisServer, make_store: StoreMaker
) -> None:
    await flush_functions(scratch_redis)
    prefix = unique_prefix()
    replicas = [make_store(scratch_redis, small_layout(), prefix=prefix) for _ in range(4)]
    await asyncio.gather(*(r.start() for r in replicas))
    leases = await asyncio.gather(*(r.acquire(demand("a", 10, P), 1) for r in replicas))
    assert await in_flight(replicas[0], P) == 40
    for replica, lease in zip(replicas, leases, strict=True):
        assert await replica.release(lease.id)
    await assert_idle(replicas[0])


async def _status_via_redis_py(url: str, runner: ScriptRunner) -> object:
    """One call through redis-py (the transport of rediss:// URLs): the status of an unknown ticket."""
    client = Redis.from_url(url, decode_responses=True)
    try:
        return await runner.call(client, "status", [f"{{tg:{unique_prefix()}}}:layout"], ["", "r", "1", "L1"])
    finally:
        await client.aclose()


async def test_redis_py_calls_load_lost_code_and_fall_back_like_the_lean_connection(
    scratch_redis: RedisServer, redis_without_fcall: RedisServer
) -> None:
    await flush_functions(scratch_redis)
    runner = ScriptRunner()
    first = await _status_via_redis_py(scratch_redis.url, runner)
    assert (runner.mode, runner.reloads) == ("functions", 1)
    assert await _status_via_redis_py(scratch_redis.url, runner) == first  # loaded: no reload
    assert runner.reloads == 1
    old = ScriptRunner()
    assert await _status_via_redis_py(redis_without_fcall.url, old) == first
    assert old.mode == "scripts"
    denied = ScriptRunner()
    assert await _status_via_redis_py(await user_without_functions(scratch_redis), denied) == first
    assert denied.mode == "scripts"


async def test_a_layout_kept_by_the_library_is_not_used_for_another_layout_after_a_flush(
    fresh_redis: RedisServer, make_store: StoreMaker
) -> None:
    # The library keeps parsed layouts across calls, by version and digest. FLUSHALL empties the
    # data and leaves the library loaded; the next layout written starts again at version 1, so
    # only the digest tells it from the one kept. It is written here by a replica running EVALSHA
    # scripts (another Lua state, as a replica of an older version would), so nothing in the
    # library hears of it; the library's next call must still use it.
    prefix = unique_prefix()
    roomy = make_store(fresh_redis, small_layout(), prefix)
    await roomy.start()
    lease = await roomy.acquire(demand("a", 80, P), 1)  # fits 100: the library keeps this layout
    assert await roomy.release(lease.id)
    await roomy.close()
    raw = Redis.from_url(fresh_redis.url, decode_responses=True)
    await raw.flushall()
    tight = layout([shared(P, 50), private("tenant:a", 100)], ["a", "b"], lease_ttl_s=10.0)
    other = make_store(fresh_redis, tight, prefix, lua="scripts")
    await other.start()
    await other.close()
    assert await raw.hget(roomy._keys.layout, "ver") == "1"
    acquire = load_library().functions["acquire"]
    reply = await raw.fcall(
        acquire, 1, roomy._keys.layout, "", "r1", "r1-1", *pack_demand(demand("a", 80, P))
    )
    assert reply[0][0] == "E", reply  # NeverFits under the new layout (80 > 50), not a grant
    await raw.aclose()


async def test_what_the_library_keeps_across_calls_does_not_grow_with_the_tenants_it_served(
    fresh_redis: RedisServer, make_store: StoreMaker
) -> None:
    # What the library keeps across calls is bounded by the layout's shape (policy, tiers, shared
    # pools) and a few hundred tenants, not by how many tenants it has served: Lua's collector
    # walks every live object of the functions' heap on each cycle, and a heap holding every
    # tenant's specs made that walk the costliest part of a call at 10,000 tenants. The heap is
    # the library's code and state (~0.4 MB) plus garbage, which the collector lets grow to about
    # the live size again before a cycle; kept specs of 5,000 tenants (each with its own pool)
    # were ~3 MB more.
    n = 5000
    names = [f"t{i}" for i in range(n)]
    big = layout([shared(P, 100), *(private(f"tenant:{t}", 100) for t in names)], names, lease_ttl_s=10.0)
    store = make_store(fresh_redis, big)
    await store.start()
    raw = Redis.from_url(fresh_redis.url, decode_responses=True)
    try:
        lease = await store.acquire(demand("t0", 10, P, "tenant:t0"), 1)
        assert await store.release(lease.id)
        before = int((await raw.info("memory"))["used_memory_vm_functions"])
        for start in range(0, n, 100):
            leases = await asyncio.gather(
                *(store.acquire(demand(t, 1, P, f"tenant:{t}"), 10) for t in names[start : start + 100])
            )
            await asyncio.gather(*(store.release(le.id) for le in leases))
        after = int((await raw.info("memory"))["used_memory_vm_functions"])
        assert after < 2_000_000, (before, after)
        await assert_idle(store)
    finally:
        await raw.aclose()
        await store.close()

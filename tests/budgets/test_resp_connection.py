"""The lean RESP2 connection (budgets/redis/resp.py) against a real redis-server: pipelining order,
error replies, timeouts that tear the connection down, cancellation mid-flight, a server killed
and restarted, NOSCRIPT after SCRIPT FLUSH, and the same under uvloop (what the gateway runs on).
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import signal
from collections.abc import AsyncIterator, Callable

import pytest
import uvloop

from budgets.redis.resp import (
    Address,
    CommandPrefix,
    NoScriptError,
    ReplyError,
    RespConnection,
    RespConnectionError,
    address_from_url,
    encode_command,
)
from budgets.redis.scripts import Script, ScriptRunner
from loadtest.processes import free_port
from tests.budgets.redis_fixtures import RedisServer, fresh_redis, redis_server, scratch_redis, unique_prefix

__all__ = ["fresh_redis", "redis_server", "scratch_redis"]  # fixtures used below

# Busy-waits inside Redis for ARGV[1] microseconds, then returns ARGV[2]: a slow reply on demand.
SLOW = (
    "local t = redis.call('TIME') "
    "repeat local n = redis.call('TIME') "
    "until (n[1] - t[1]) * 1000000 + (n[2] - t[2]) >= tonumber(ARGV[1]) "
    "return ARGV[2]"
)

Maker = Callable[..., RespConnection]


@pytest.fixture
async def connect() -> AsyncIterator[Maker]:
    made: list[RespConnection] = []

    def make(
        server: RedisServer, op_timeout_s: float = 2.0, connect_timeout_s: float = 1.0
    ) -> RespConnection:
        address = address_from_url(server.url)
        assert address is not None
        conn = RespConnection(address, connect_timeout_s=connect_timeout_s, op_timeout_s=op_timeout_s)
        made.append(conn)
        return conn

    yield make
    for conn in made:
        await conn.close()


def slow(conn: RespConnection, micros: int, value: str) -> asyncio.Future[object]:
    return asyncio.ensure_future(conn.execute("EVAL", SLOW, "0", str(micros), value))


def test_encoding_matches_resp2() -> None:
    assert encode_command(["SET", "k", "é"]) == b"*3\r\n$3\r\nSET\r\n$1\r\nk\r\n$2\r\n\xc3\xa9\r\n"
    prefix = CommandPrefix("EVALSHA", "ab", "1", "key")
    assert prefix.build(["", "x\x1fy"]) == encode_command(["EVALSHA", "ab", "1", "key", "", "x\x1fy"])


def test_urls() -> None:
    assert address_from_url("redis://u:p@10.0.0.1:6380/2") == Address("10.0.0.1", 6380, None, 2, "u", "p")
    assert address_from_url("unix:///tmp/r.sock?db=3") == Address(path="/tmp/r.sock", db=3)
    assert address_from_url("rediss://h:6379/0") is None  # TLS stays with redis-py


async def test_pipelined_requests_are_answered_in_order(redis_server: RedisServer, connect: Maker) -> None:
    conn = connect(redis_server)
    key = unique_prefix()
    replies = await asyncio.gather(
        *(conn.execute("INCR", key) if i % 2 else conn.execute("ECHO", f"v{i}") for i in range(400))
    )
    incrs = iter(range(1, 201))
    assert replies == [next(incrs) if i % 2 else f"v{i}" for i in range(400)]
    assert conn.connects == 1  # one connection, all pipelined


async def test_error_replies_raise_and_keep_the_connection_in_step(
    redis_server: RedisServer, connect: Maker
) -> None:
    conn = connect(redis_server)
    key = unique_prefix()
    await conn.execute("SET", key, "not a number")
    results = await asyncio.gather(
        conn.execute("ECHO", "a"),
        conn.execute("INCR", key),
        conn.execute("NOSUCHCOMMAND"),
        conn.execute("ECHO", "b"),
        return_exceptions=True,
    )
    assert results[0] == "a" and results[3] == "b"
    assert isinstance(results[1], ReplyError) and "not an integer" in str(results[1])
    assert isinstance(results[2], ReplyError) and not isinstance(results[2], OSError)
    # An error raised by a script is a reply error too, and nested replies keep their types.
    with pytest.raises(ReplyError, match="boom"):
        await conn.execute("EVAL", "return redis.error_reply('boom')", "0")
    assert await conn.execute("EVAL", "return {1, 'x', {2}}", "0") == [1, "x", [2]]
    assert conn.connects == 1


async def test_timeout_fails_the_call_and_tears_the_connection_down(
    redis_server: RedisServer, connect: Maker
) -> None:
    conn = connect(redis_server, op_timeout_s=0.1)
    assert await conn.execute("PING") == "PONG"
    late = slow(conn, 300_000, "late")
    behind = asyncio.ensure_future(conn.execute("ECHO", "behind"))
    with pytest.raises(TimeoutError):
        await late
    # Everything pipelined behind the expired request fails with it: its reply would be next.
    with pytest.raises(RespConnectionError):
        await behind
    assert not conn.connected
    await asyncio.sleep(0.3)  # the slow script has finished: its reply "late" is out by now
    # The next request reconnects and gets its own reply, never the late one.
    assert await conn.execute("ECHO", "fresh") == "fresh"
    assert await conn.execute("ECHO", "again") == "again"
    assert conn.connects == 2


async def test_a_hung_server_times_out_within_the_op_timeout(
    fresh_redis: RedisServer, connect: Maker
) -> None:
    conn = connect(fresh_redis, op_timeout_s=0.2)
    assert await conn.execute("PING") == "PONG"
    assert fresh_redis.proc is not None
    os.kill(fresh_redis.proc.pid, signal.SIGSTOP)
    try:
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        with pytest.raises(TimeoutError):
            await conn.execute("PING")
        assert loop.time() - t0 < 1.0
        # Reconnecting to a hung server is bounded by the connect/op timeouts as well.
        with pytest.raises((TimeoutError, OSError)):
            await conn.execute("PING")
    finally:
        os.kill(fresh_redis.proc.pid, signal.SIGCONT)
    assert await conn.execute("PING") == "PONG"


async def test_cancelled_caller_does_not_desync_the_fifo(redis_server: RedisServer, connect: Maker) -> None:
    conn = connect(redis_server)
    key = unique_prefix()
    first = slow(conn, 50_000, "first")
    second = asyncio.ensure_future(conn.execute("SET", key, "written"))
    third = asyncio.ensure_future(conn.execute("ECHO", "third"))
    await asyncio.sleep(0.01)  # all three are on the wire
    first.cancel()
    second.cancel()
    with pytest.raises(asyncio.CancelledError):
        await first
    assert await third == "third"
    # The cancelled SET still ran (it was sent): cancellation stops the wait, not the command.
    assert await conn.execute("GET", key) == "written"
    assert await conn.execute("ECHO", "fourth") == "fourth"
    assert conn.connects == 1 and conn.connected


async def test_cancelled_while_connecting_leaves_a_usable_connection(
    redis_server: RedisServer, connect: Maker
) -> None:
    conn = connect(redis_server)
    task = asyncio.ensure_future(conn.execute("PING"))
    await asyncio.sleep(0)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert await conn.execute("ECHO", "ok") == "ok"


async def test_server_killed_and_restarted(fresh_redis: RedisServer, connect: Maker) -> None:
    conn = connect(fresh_redis, op_timeout_s=0.5, connect_timeout_s=0.5)
    assert await conn.execute("PING") == "PONG"
    in_flight = slow(conn, 500_000, "never")
    await asyncio.sleep(0.05)
    fresh_redis.kill()
    with pytest.raises(OSError):  # the store treats OSError (ConnectionError) as "Redis down"
        await in_flight
    with pytest.raises(OSError):  # refused while it is down
        await conn.execute("PING")
    fresh_redis.restart()
    assert await conn.execute("ECHO", "back") == "back"


async def test_refused_connection_is_an_os_error(connect: Maker) -> None:
    conn = connect(RedisServer(port=free_port()), connect_timeout_s=0.5)
    with pytest.raises(OSError):
        await conn.execute("PING")


async def test_noscript_after_script_flush_reloads_and_retries(
    scratch_redis: RedisServer, connect: Maker
) -> None:
    conn = connect(scratch_redis)
    source = "return {ARGV[1], KEYS[1]}"
    runner = ScriptRunner({"echo": Script("echo", source, hashlib.sha1(source.encode()).hexdigest())})
    with pytest.raises(NoScriptError):  # a raw EVALSHA of an unknown script
        await conn.execute("EVALSHA", "0" * 40, "0")
    assert await runner.call_resp(conn, "echo", "k", ["a"]) == ["a", "k"]
    await conn.execute("SCRIPT", "FLUSH")
    assert await runner.call_resp(conn, "echo", "k", ["b"]) == ["b", "k"]
    assert await runner.call_resp(conn, "echo", "k", ["c"]) == ["c", "k"]
    assert runner.reloads >= 1
    assert conn.connects == 1


async def test_closed_connection_refuses_requests(redis_server: RedisServer, connect: Maker) -> None:
    conn = connect(redis_server)
    assert await conn.execute("PING") == "PONG"
    pending = slow(conn, 100_000, "x")
    await asyncio.sleep(0.01)
    await conn.close()
    with pytest.raises(RespConnectionError):
        await pending
    with pytest.raises(RespConnectionError):
        await conn.execute("PING")


async def test_a_connection_reset_before_connection_lost_runs_is_not_written_to(
    redis_server: RedisServer, connect: Maker
) -> None:
    # A reset read by the event loop closes the transport at once but calls connection_lost on a
    # later turn; a batch flushed in between used to raise from send_nowait (a 500 in CI).
    conn = connect(redis_server)
    assert await conn.execute("PING") == "PONG"
    proto = conn._proto
    assert proto is not None and proto._transport is not None
    proto._transport.close()  # what the loop does on ECONNRESET, before connection_lost
    assert not conn.connected
    assert conn.send_nowait(encode_command(("PING",))) is None  # the caller takes the async path
    assert await conn.execute("ECHO", "again") == "again"  # which opens a new connection
    assert conn.connects == 2


def test_works_on_uvloop(redis_server: RedisServer) -> None:
    # The gateway runs on uvloop, whose transports differ from asyncio's.
    async def main() -> None:
        address = address_from_url(redis_server.url)
        assert address is not None
        conn = RespConnection(address, connect_timeout_s=1.0, op_timeout_s=0.1)
        try:
            replies = await asyncio.gather(*(conn.execute("ECHO", str(i)) for i in range(50)))
            assert replies == [str(i) for i in range(50)]
            with pytest.raises(TimeoutError):
                await slow(conn, 300_000, "late")
            await asyncio.sleep(0.3)
            assert await conn.execute("ECHO", "fresh") == "fresh"
            assert conn.connects == 2
        finally:
            await conn.close()

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        runner.run(main())


async def test_a_write_refused_as_readonly_tears_the_connection_down(
    redis_server: RedisServer, connect: Maker
) -> None:
    """A primary demoted to a replica (a failover) refuses every write: the connection is dropped
    (the next request connects again, through Sentinel to the new primary), not kept in step."""
    replica = RedisServer(extra_args=["--replicaof", "127.0.0.1", str(redis_server.port)]).start()
    try:
        conn = connect(replica)
        assert await conn.execute("PING") == "PONG"
        first = conn.connects
        with pytest.raises(RespConnectionError, match="READONLY"):
            await conn.execute("SET", f"{unique_prefix()}:k", "v")
        assert not conn.connected
        assert await conn.execute("PING") == "PONG" and conn.connects == first + 1
    finally:
        replica.stop()


async def test_a_resolved_address_must_answer_as_a_primary(redis_server: RedisServer) -> None:
    """Connecting through a resolver (Sentinel), a node that answers ROLE as a replica is refused:
    a sentinel may still name a primary it has just demoted."""
    replica = RedisServer(extra_args=["--replicaof", "127.0.0.1", str(redis_server.port)]).start()
    asked: list[int] = []

    async def resolve(port: int) -> Address:
        asked.append(port)
        return Address("127.0.0.1", port)

    try:
        to_replica = RespConnection(lambda: resolve(replica.port), connect_timeout_s=1, op_timeout_s=1)
        with pytest.raises(RespConnectionError, match="not a primary"):
            await to_replica.execute("PING")
        to_primary = RespConnection(lambda: resolve(redis_server.port), connect_timeout_s=1, op_timeout_s=1)
        assert await to_primary.execute("PING") == "PONG"
        assert asked == [replica.port, redis_server.port]
        await to_replica.close()
        await to_primary.close()
    finally:
        replica.stop()

"""How the Redis store reaches Redis: script calls, batched, on the lean connection; the rest on redis-py.

Script calls (the request path) go over one lean pipelined connection (budgets/redis/resp.py),
and concurrent acquires and releases leave together as one ``batch`` script call
(budgets/redis/batch.py). redis-py keeps pub/sub, the snapshot, layout and epoch reads. TLS URLs
and an injected client send scripts through redis-py too.

Every call is bounded by the configured timeouts. A call that fails for want of Redis (connection
refused or lost, timeout) reports the failure (``on_down``: the store is then down until a
recovery) and raises ``Down``. While the store is down only the recovery talks to Redis (its
calls are ``internal``): a grant made before the in-flight leases are re-registered could
overcommit a pool.

Every script returns ``{ reply, LOCAL }``: LOCAL are the wake-ups for this replica's own tickets,
handed to ``on_wake`` before the caller resumes, exactly as the memory store would.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Sequence
from typing import Any

from redis.asyncio import BlockingConnectionPool, Redis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import AskError, ClusterDownError, MovedError, ReadOnlyError, TryAgainError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from budgets.redis.batch import FastSend, ScriptBatcher, SendAgain
from budgets.redis.cluster import SlotOwner
from budgets.redis.keys import KeyLayout
from budgets.redis.nodes import Resolver, pool_kwargs, resolver_for
from budgets.redis.options import RedisOptions
from budgets.redis.resp import RespConnection, address_from_url
from budgets.redis.scripts import ScriptRunner


class Down(Exception):
    """Redis is unreachable (internal: mapped to StoreUnavailable or the fail-open path)."""


class Transport:
    def __init__(
        self,
        options: RedisOptions,
        keys: KeyLayout,
        replica: str,
        *,
        client: Redis | None,
        clock: Callable[[], float] | None,
        is_down: Callable[[], bool],
        on_down: Callable[[BaseException], None],
        on_wake: Callable[[str], None],
    ) -> None:
        self._opts = options
        self._keys = keys
        self._replica = replica
        # Tests drive decisions with their own clock (passed to every script); production uses
        # Redis server TIME so replicas never disagree about ages and expiries.
        self._clock = clock
        self._is_down = is_down
        self._on_down = on_down
        self._on_wake = on_wake
        # Through Sentinel (sentinel.py) or on a Cluster (cluster.py): both connections ask where
        # the primary is as they connect.
        self.resolver = (
            resolver_for(options.url, keys.tag, options.connect_timeout_s) if client is None else None
        )
        self.client = client or Redis(connection_pool=_pool(options, self.resolver))
        address = self.resolver or (address_from_url(options.url) if client is None else None)
        self._resp = (
            RespConnection(
                address, connect_timeout_s=options.connect_timeout_s, op_timeout_s=options.op_timeout_s
            )
            if address is not None
            else None
        )
        self._scripts = ScriptRunner(functions=options.lua == "functions")
        self._batcher = ScriptBatcher(
            self._eval_batch,
            max_in_flight=max(1, options.max_connections // 2),
            fast=FastSend(self._batch_start, self._batch_finish) if self._resp is not None else None,
        )

    def describe(self) -> dict[str, object]:
        """How Redis is reached, and where the script connection is connected now."""
        resolver = self.resolver
        topology = "standalone" if resolver is None else type(resolver).topology
        out: dict[str, object] = {"topology": topology}
        if isinstance(resolver, SlotOwner):
            out["slot"] = resolver.slot
        peer = self._resp.peer if self._resp is not None else None
        out["node"] = None if peer is None else (peer.path or f"{peer.host}:{peer.port}")
        return out

    @property
    def script_reloads(self) -> int:
        """Lua code loaded again after Redis had lost it (a restarted or flushed Redis)."""
        return self._scripts.reloads

    @property
    def lua_mode(self) -> str:
        """How the Lua code runs now: ``functions`` (FCALL) or ``scripts`` (EVALSHA)."""
        return self._scripts.mode

    @property
    def ops_per_batch(self) -> float:
        """Acquires and releases per batch script call so far (how much batching saves)."""
        return self._batcher.ops / max(1, self._batcher.batches)

    async def call(self, awaitable: Any) -> Any:
        """A redis-py call, bounded by the call timeout."""
        try:
            async with asyncio.timeout(self._opts.call_timeout_s):
                return await awaitable
        except TimeoutError as err:
            # asyncio's timeout has no text: say which bound ran out.
            timeout = TimeoutError(str(err) or f"redis did not answer within {self._opts.call_timeout_s}s")
            self._on_down(timeout)
            raise Down(str(timeout)) from err
        except (RedisConnectionError, RedisTimeoutError, OSError) as err:
            self._on_down(err)
            raise Down(str(err)) from err
        except (ReadOnlyError, MovedError, AskError, TryAgainError, ClusterDownError) as err:
            # Served elsewhere now (a failover demoted it; a cluster slot moved) or moving: nothing
            # ran. Down until the recovery connects again, to the primary named then.
            await self.client.connection_pool.disconnect()
            self._on_down(err)
            raise Down(str(err)) from err

    async def eval(self, name: str, args: Sequence[str], *, internal: bool = False) -> Any:
        """One script call on its own (not batched); its reply, unparsed."""
        if self._is_down() and not internal:
            raise Down("redis is down")
        argv = [self._now_arg(), self._replica, *args]
        if self._resp is not None:
            # Bounded by the connection itself (connect_s to connect, op_s per request; an expiry
            # tears the connection down), without a timeout context per call.
            try:
                reply, mine = await self._scripts.call_resp(self._resp, name, self._keys.layout, argv)
            except (OSError, TimeoutError) as err:
                self._on_down(err)
                raise Down(str(err)) from err
        else:
            keys = [self._keys.layout]
            reply, mine = await self.call(self._scripts.call(self.client, name, keys, argv))
        for payload in mine:
            self._on_wake(payload)
        return reply

    def submit(self, name: str, args: Sequence[str]) -> asyncio.Future[Any]:
        """An acquire or release, sent with the next batch; the future gets its reply, unparsed."""
        return self._batcher.submit(name, args)

    async def ping(self) -> bool:
        """Both connections answer (the probe of a down store)."""
        try:
            async with asyncio.timeout(self._opts.call_timeout_s):
                if self._resp is not None:
                    await self._resp.execute("PING")  # the connection the scripts use
                await self.client.ping()  # type: ignore[misc]
        except Exception:
            return False
        return True

    async def drain(self, timeout_s: float) -> None:
        """Wait (bounded) until every submitted operation has been answered."""
        await self._batcher.drain(timeout_s)

    async def close(self) -> None:
        if self._resp is not None:
            await self._resp.close()
        with contextlib.suppress(Exception):
            await self.client.aclose()

    def _now_arg(self) -> str:
        return "" if self._clock is None else repr(float(self._clock()))

    async def _eval_batch(self, args: list[str]) -> Any:
        return await self.eval("batch", args)

    def _batch_start(self, args: list[str]) -> asyncio.Future[Any] | None:
        """The batch script written at once on the open lean connection (the batcher's fast path)."""
        if self._is_down() or self._resp is None:
            return None  # _eval_batch raises Down (or the recovery is the one talking to Redis)
        argv = [self._now_arg(), self._replica, *args]
        try:
            return self._scripts.send_resp_nowait(self._resp, "batch", self._keys.layout, argv)
        except (OSError, TimeoutError) as err:  # the write itself failed: an outage, as in eval
            self._on_down(err)
            raise Down(str(err)) from err

    def _batch_finish(self, wire: asyncio.Future[Any]) -> Sequence[Any]:
        """eval's reply handling for a batch sent by _batch_start."""
        err = wire.exception() if not wire.cancelled() else asyncio.CancelledError()
        if err is None:
            reply, mine = wire.result()
            for payload in mine:
                self._on_wake(payload)
            return reply  # type: ignore[no-any-return]
        if self._scripts.must_resend(err):
            raise SendAgain("code not loaded") from err  # nothing ran: reload and retry
        if isinstance(err, (OSError, TimeoutError, asyncio.CancelledError)):
            self._on_down(err)
            raise Down(str(err)) from err
        raise err


def _pool(options: RedisOptions, resolver: Resolver | None) -> BlockingConnectionPool:
    # Blocking: under a burst, callers queue for one of max_connections instead of failing
    # ("too many connections" is not an outage). The wait is bounded by the per-call timeout.
    if resolver is not None:
        return BlockingConnectionPool(**pool_kwargs(resolver), **_pool_settings(options))
    return BlockingConnectionPool.from_url(options.url, **_pool_settings(options))


def _pool_settings(options: RedisOptions) -> dict[str, Any]:
    return dict(
        max_connections=options.max_connections,
        timeout=None,
        socket_connect_timeout=options.connect_timeout_s,
        # No socket_timeout: with one set, redis-py sends through asyncio.wait_for, which on
        # Python 3.11 swallows a task cancellation that races the send, so a cancelled waiter
        # would carry on and leak its grant. Every call is bounded by Transport.call instead.
        socket_timeout=None,
        # One immediate retry on a broken connection (a restarted Redis leaves every pooled
        # connection dead); none on timeouts, which would double the configured bound.
        retry=Retry(NoBackoff(), 1, supported_errors=(RedisConnectionError,)),
        retry_on_error=[RedisConnectionError],  # without it redis-py re-raises instead of retrying
        decode_responses=True,
    )

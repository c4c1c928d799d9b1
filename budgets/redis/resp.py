"""A lean asyncio RESP2 connection for the Redis store's script calls (the request path).

redis-py's asyncio client costs ~100 µs of CPU per command here (pool checkout, retry wrapper,
command packing, a coroutine chain per call); this connection costs a fraction of that: one
``asyncio.Protocol`` whose replies are parsed by ``hiredis.Reader``, every request written at once
(pipelined) and answered in order from a FIFO of futures.

The rules that keep replies matched to their requests:

- **FIFO.** Redis answers a connection's commands in order, so the n-th reply belongs to the n-th
  queued future. A caller that is cancelled leaves its future in the queue: the reply is still
  read and dropped, and the queue stays in step.
- **Timeouts tear down.** A request unanswered after ``op_timeout_s`` fails with TimeoutError and
  the connection is closed (every other request on it fails with ConnectionError): a reply that
  arrives late can never be taken for the answer to a later request. The next call reconnects.
- **Errors.** Connection failures raise ``ConnectionError`` (an ``OSError``), expiries raise
  ``TimeoutError``: what the store already treats as "Redis unavailable". An error reply raises
  ``ReplyError`` (``NoScriptError`` for NOSCRIPT and "Function not found"); ``LOADING`` / ``MASTERDOWN`` count as
  unavailable, as in redis-py.

A request that may have reached Redis is never retried here: a script call is not idempotent.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, cast

import hiredis
from redis.asyncio.connection import SSLConnection, parse_url

# Error replies that mean "this server cannot serve now" rather than "this command failed".
# Replies that say this node cannot serve now (nothing ran): loading its dataset, its master down,
# a replica (a demoted primary, after a failover), or, on Redis Cluster, the slot served elsewhere
# or moving. Those that name another node also tear the connection down: reconnecting asks where
# the primary is now (sentinel.py, cluster.py).
_UNAVAILABLE = ("LOADING", "MASTERDOWN", "READONLY", "MOVED", "ASK", "TRYAGAIN", "CLUSTERDOWN")
_ELSEWHERE = ("READONLY", "MOVED", "ASK")


class ReplyError(Exception):
    """Redis answered the command with an error reply."""


class NoScriptError(ReplyError):
    """EVALSHA of a script, or FCALL of a function, Redis does not have (restarted or flushed):
    nothing ran; load the code and send the call again."""


class RespConnectionError(ConnectionError):
    """The connection failed or was torn down; the request's outcome is unknown."""


def encode_arg(value: str | bytes) -> bytes:
    """One bulk string: ``$<len>\\r\\n<bytes>\\r\\n``."""
    b = value.encode() if isinstance(value, str) else value
    return b"$%d\r\n%s\r\n" % (len(b), b)


def encode_command(args: Sequence[str | bytes]) -> bytes:
    return b"*%d\r\n" % len(args) + b"".join(encode_arg(a) for a in args)


class CommandPrefix:
    """A command whose first arguments never change (``EVALSHA <sha> 1 <key>``), encoded once."""

    def __init__(self, *head: str | bytes) -> None:
        self.count = len(head)
        self.encoded = b"".join(encode_arg(a) for a in head)

    def build(self, args: Sequence[str]) -> bytes:
        parts = [b"*%d\r\n" % (self.count + len(args)), self.encoded]
        for a in args:
            b = a.encode()
            parts.append(b"$%d\r\n%s\r\n" % (len(b), b))
        return b"".join(parts)


def _reply_exception(err: Exception) -> Exception:
    msg = str(err)
    if msg.startswith(("NOSCRIPT", "ERR Function not found")):
        return NoScriptError(msg)
    if msg.startswith(_UNAVAILABLE):
        return RespConnectionError(msg)
    return ReplyError(msg)


@dataclass(frozen=True, slots=True)
class Address:
    host: str = "127.0.0.1"
    port: int = 6379
    path: str | None = None  # a unix socket instead of host:port
    db: int = 0
    username: str | None = None
    password: str | None = None


def address_from_url(url: str) -> Address | None:
    """The address of a ``redis://`` or ``unix://`` URL; None for TLS (``rediss://``), not handled here."""
    kw = parse_url(url)
    if kw.get("connection_class") is SSLConnection:
        return None
    return Address(
        host=str(kw.get("host") or "127.0.0.1"),
        port=int(kw.get("port") or 6379),
        path=kw.get("path"),
        db=int(kw.get("db") or 0),
        username=kw.get("username"),
        password=kw.get("password"),
    )


class _Protocol(asyncio.Protocol):
    """One TCP/unix connection: writes requests, matches replies to the FIFO of futures."""

    def __init__(self, loop: asyncio.AbstractEventLoop, op_timeout_s: float) -> None:
        self._loop = loop
        self._op_timeout_s = op_timeout_s
        self._reader = hiredis.Reader(encoding="utf-8", replyError=ReplyError)
        self._pending: collections.deque[tuple[asyncio.Future[Any], float]] = collections.deque()
        self._transport: asyncio.Transport | None = None
        self._timer: asyncio.TimerHandle | None = None
        self.closed = False

    # -- asyncio.Protocol --

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports are not asyncio.Transport subclasses, only alike.
        self._transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        reader = self._reader
        reader.feed(data)
        pending = self._pending
        while True:
            try:
                reply = reader.gets()
            except hiredis.ProtocolError as err:
                self.teardown(RespConnectionError(f"redis protocol error: {err}"))
                return
            if reply is False:
                return
            if not pending:
                self.teardown(RespConnectionError("redis sent a reply nobody asked for"))
                return
            fut = pending.popleft()[0]
            if isinstance(reply, ReplyError) and str(reply).startswith(_ELSEWHERE):
                refused = _reply_exception(reply)
                if not fut.done():
                    fut.set_exception(refused)
                self.teardown(refused)  # served elsewhere now: connect again, to where it is
                return
            if fut.done():
                continue  # its caller was cancelled: the reply is read and dropped
            if isinstance(reply, ReplyError):
                fut.set_exception(_reply_exception(reply))
            else:
                fut.set_result(reply)

    def connection_lost(self, exc: Exception | None) -> None:
        self._fail_all(RespConnectionError(f"redis connection lost: {exc or 'closed by the server'}"))

    # -- requests --

    @property
    def open(self) -> bool:
        """Writable: not torn down, and the transport is not closing (a reset can close the
        transport before connection_lost has run)."""
        return not self.closed and self._transport is not None and not self._transport.is_closing()

    def send(self, payload: bytes) -> asyncio.Future[Any]:
        """Write one request; the future gets its reply (or the connection's failure)."""
        transport = self._transport
        if self.closed or transport is None or transport.is_closing():
            raise RespConnectionError("redis connection is closed")
        fut = self._loop.create_future()
        deadline = self._loop.time() + self._op_timeout_s
        self._pending.append((fut, deadline))
        transport.write(payload)
        if self._timer is None:
            self._timer = self._loop.call_at(deadline, self._check_deadline)
        return fut

    def _check_deadline(self) -> None:
        # One timer for the whole FIFO: replies come in order and every request has the same
        # timeout, so the head is always the first to expire. Re-armed lazily, not per request.
        self._timer = None
        if not self._pending:
            return
        deadline = self._pending[0][1]
        if deadline <= self._loop.time():
            self.teardown(TimeoutError(f"redis did not answer within {self._op_timeout_s}s"))
        else:
            self._timer = self._loop.call_at(deadline, self._check_deadline)

    def teardown(self, err: BaseException) -> None:
        """Close the connection and fail every request on it (the first with ``err``)."""
        if self._transport is not None:
            self._transport.abort()
        self._fail_all(err)

    def _fail_all(self, first: BaseException) -> None:
        self.closed = True
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        err: BaseException = first
        while self._pending:
            fut = self._pending.popleft()[0]
            if not fut.done():
                fut.set_exception(err)
            err = RespConnectionError(f"redis connection torn down: {first}")


def check_primary(role: Any, address: Address) -> None:
    """``ROLE``'s reply names a primary; else RespConnectionError (the caller connects again later)."""
    if not isinstance(role, list) or not role or role[0] != "master":
        kind = role[0] if isinstance(role, list) and role else role
        raise RespConnectionError(f"{address.host}:{address.port} is not a primary (ROLE: {kind})")


class RespConnection:
    """Pipelined requests over one lazily (re)connected connection. Not thread-safe.

    ``address``: where to connect, or a resolver asked at each connect (Sentinel: the primary now,
    checked with ``ROLE`` once connected)."""

    def __init__(
        self,
        address: Address | Callable[[], Awaitable[Address]],
        *,
        connect_timeout_s: float,
        op_timeout_s: float,
    ) -> None:
        self.address = address
        self._connect_timeout_s = connect_timeout_s
        self._op_timeout_s = op_timeout_s
        self._proto: _Protocol | None = None
        self._connecting: asyncio.Lock | None = None
        self._closed = False
        self.connects = 0  # connections opened (observability, tests)
        self._peer: Address | None = None  # where the open connection goes (resolved, if a resolver)

    @property
    def peer(self) -> Address | None:
        """The address of the open connection; None when not connected."""
        return self._peer if self.connected else None

    @property
    def connected(self) -> bool:
        return self._proto is not None and self._proto.open

    async def execute(self, *args: str | bytes) -> Any:
        return await self.request(encode_command(args))

    async def request(self, payload: bytes) -> Any:
        """Send one encoded command and wait for its reply (bounded by ``op_timeout_s``)."""
        proto = self._proto
        if proto is None or not proto.open:
            proto = await self._connect()
        return await proto.send(payload)

    def send_nowait(self, payload: bytes) -> asyncio.Future[Any] | None:
        """Send on the open connection and return the reply's future; None when not connected."""
        proto = self._proto
        if proto is None or not proto.open:
            return None
        return proto.send(payload)

    async def _connect(self) -> _Protocol:
        if self._closed:
            raise RespConnectionError("connection closed")
        if self._connecting is None:
            self._connecting = asyncio.Lock()
        async with self._connecting:
            proto = self._proto
            if proto is not None and proto.open:
                return proto  # another caller connected meanwhile
            self._proto = None
            loop = asyncio.get_running_loop()
            new = _Protocol(loop, self._op_timeout_s)
            try:
                async with asyncio.timeout(self._connect_timeout_s):
                    a = self.address if isinstance(self.address, Address) else await self.address()
                    if a.path is not None:
                        await loop.create_unix_connection(lambda: new, a.path)
                    else:
                        await loop.create_connection(lambda: new, a.host, a.port)
                    await self._handshake(new, a)
            except BaseException as err:
                new.teardown(RespConnectionError(f"connect failed: {err!r}"))
                if isinstance(err, ReplyError):
                    raise RespConnectionError(f"redis refused the connection: {err}") from err
                if isinstance(err, TimeoutError) and not str(err):
                    raise TimeoutError(
                        f"redis did not accept a connection within {self._connect_timeout_s}s"
                    ) from err
                raise
            if self._closed:
                new.teardown(RespConnectionError("connection closed"))
                raise RespConnectionError("connection closed")
            self._proto = new
            self._peer = a
            self.connects += 1
            return new

    async def _handshake(self, proto: _Protocol, a: Address) -> None:
        if a.password is not None:
            auth = ("AUTH", a.username, a.password) if a.username else ("AUTH", a.password)
            await proto.send(encode_command(auth))
        if a.db:
            await proto.send(encode_command(("SELECT", str(a.db))))
        if not isinstance(self.address, Address):  # resolved: a sentinel may name a primary no more
            check_primary(await proto.send(encode_command(("ROLE",))), a)

    def disconnect(self) -> None:
        """Drop the connection now (pending requests fail); the next request reconnects."""
        proto, self._proto = self._proto, None
        if proto is not None:
            proto.teardown(RespConnectionError("disconnected"))

    async def close(self) -> None:
        self._closed = True
        with contextlib.suppress(Exception):
            self.disconnect()

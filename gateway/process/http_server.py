"""The HTTP server's own limits: what a client can hold before the app sees a request.

uvicorn's httptools protocol accepts headers of any size, waits forever for a client that never
finishes its headers (the keep-alive timer is cancelled by the first byte), and answers a
connection flood with a plain-text 503 only after the headers. Each of these lets a slow or
hostile client hold gateway resources without ever being priced. ``guarded_protocol`` returns the
same protocol with three limits added, each answered in OpenAI's error shape and then closed:

* ``max_header_bytes``: request line + headers above this -> 431;
* ``header_timeout_s``: a request whose headers are not complete this long after the connection
  opened (or after its first byte, on a kept-alive connection) -> 408;
* ``max_connections``: a connection beyond this many open ones -> 503 at once.

The request body's own deadline (``body_timeout_s``) is enforced where the body is read
(``gateway.request.proxy.read_body``), because only the app knows when it wants the body.

Each request also gets its ``RequestSignals`` (``gateway.process.signals``) in ``scope["extensions"]``:
whether its body is complete, and a callback for a lost connection, so the app needs neither a
body timer for a body that came with the headers nor a task per request to watch for a hang-up.

This subclasses uvicorn's ``HttpToolsProtocol`` and relies on its parser callbacks
(``on_url``, ``on_header``, ``on_headers_complete``, ``on_message_begin``); the tests in
``tests/adversarial/test_slow_clients.py`` pin that behaviour over real sockets.
"""

from __future__ import annotations

import asyncio
from collections import deque
from dataclasses import dataclass
from itertools import chain
from typing import Any, ClassVar

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from gateway.config.schema import GatewayConfig
from gateway.process.signals import SIGNALS, Connection, RequestSignals
from gateway.request.errors import ApiError, quiet_answer_cuts


@dataclass(frozen=True, slots=True)
class ConnectionLimits:
    max_header_bytes: int = 32 * 1024
    header_timeout_s: float = 10.0
    max_connections: int = 4096


def _error_response(exc: ApiError) -> bytes:
    body = exc.body()
    reason = {408: b"Request Timeout", 431: b"Request Header Fields Too Large", 503: b"Service Unavailable"}
    head = [
        b"HTTP/1.1 %d %s" % (exc.status, reason.get(exc.status, b"Error")),
        b"content-type: application/json",
        b"content-length: %d" % len(body),
        b"connection: close",
    ]
    if exc.retry_after_s is not None:
        head.append(b"retry-after: %d" % max(1, round(exc.retry_after_s)))
    return b"\r\n".join(head) + b"\r\n\r\n" + body


class GuardedHttpToolsProtocol(HttpToolsProtocol):
    limits: ClassVar[ConnectionLimits] = ConnectionLimits()

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # Bytes received since the current request's headers began (an upper bound of their size until
        # the first one completes): the exact count is only taken when this passes the limit.
        self._raw_bytes = 0
        self._in_headers = False
        self._header_timer: asyncio.TimerHandle | None = None
        self._refused = False
        # One per request parsed and not yet answered, oldest first (more than one only when a
        # client pipelines): a lost connection is every one of them's hang-up.
        self._signals: deque[RequestSignals] = deque()
        self._connection = Connection()  # which tenant uses it (gateway.request.tenant_connections)

    # ---- connection ----

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if len(self.connections) > self.limits.max_connections:
            self._refuse(
                ApiError(
                    503,
                    "The gateway has too many open connections; retry shortly",
                    code="too_many_connections",
                    retry_after_s=1.0,
                )
            )
            return
        self._arm_header_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_header_timer()
        super().connection_lost(exc)
        # uvicorn tells only its latest cycle; a request still running ahead of a pipelined one
        # would otherwise go on upstream for a client that is gone.
        while self._signals:
            self._signals.popleft().disconnected()
        self._connection.closed()

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return
        self._raw_bytes += len(data)
        super().data_received(data)
        # Headers still arriving and more bytes than the limit since they began: count them exactly
        # now, so a client cannot make us hold more than a read's worth past the limit.
        if self._in_headers and self._raw_bytes > self.limits.max_header_bytes and not self._refused:
            if self._header_size() > self.limits.max_header_bytes:
                self._refuse(self._too_large())

    def send_400_response(self, msg: str) -> None:
        if not self._refused:  # a refusal already answered; the parser only noticed now
            super().send_400_response(msg)

    # ---- parser callbacks ----

    def on_message_begin(self) -> None:
        super().on_message_begin()
        signals = RequestSignals(self._connection)
        self._signals.append(signals)
        ext = self.scope.get("extensions")  # (none from uvicorn today; kept if it ever adds some)
        self.scope["extensions"] = {**ext, SIGNALS: signals} if ext else {SIGNALS: signals}  # type: ignore[dict-item]
        self._raw_bytes = 0
        self._in_headers = True
        if self._header_timer is None:
            self._arm_header_timer()

    # No on_url / on_header overrides: a Python call per header was the guard's largest cost per
    # request; the size is summed once from what uvicorn collected.

    def on_headers_complete(self) -> None:
        self._disarm_header_timer()
        self._in_headers = False
        self._raw_bytes = 0
        if self._refused:
            return
        if self._header_size() > self.limits.max_header_bytes:
            self._refuse(self._too_large())
            raise _Refused  # stop the parser: the callback's exception aborts feed_data
        super().on_headers_complete()

    def on_body(self, body: bytes) -> None:
        if not self._refused:
            super().on_body(body)

    def on_message_complete(self) -> None:
        if not self._refused:
            super().on_message_complete()
            if self._signals:  # empty when the answer went out before the body was all read
                self._signals[-1].body_complete = True

    def on_response_complete(self) -> None:
        if self._signals:  # HTTP/1.1 answers in order: the oldest request is the one answered
            self._signals.popleft()
        super().on_response_complete()

    # ---- limits ----

    def _header_size(self) -> int:
        """The request line's target and headers as the limit counts them (name, value, ": ", CRLF)."""
        headers = self.headers
        return len(self.url) + 4 * len(headers) + sum(map(len, chain.from_iterable(headers)))

    def _too_large(self) -> ApiError:
        return ApiError(
            431,
            f"Request headers exceed {self.limits.max_header_bytes} bytes (limits.max_header_bytes); "
            "send less in headers",
            code="headers_too_large",
        )

    def _arm_header_timer(self) -> None:
        self._disarm_header_timer()
        self._header_timer = self.loop.call_later(self.limits.header_timeout_s, self._header_timeout)

    def _disarm_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _header_timeout(self) -> None:
        self._header_timer = None
        if self._refused or self.transport.is_closing():
            return
        if self.cycle is not None and not self.cycle.response_complete:
            return  # a request is being served: its headers did complete
        self._refuse(
            ApiError(
                408,
                f"The request headers did not arrive within {self.limits.header_timeout_s:g} s "
                "(limits.header_timeout_s)",
                code="header_timeout",
            )
        )

    def _refuse(self, exc: ApiError) -> None:
        self._refused = True
        self._disarm_header_timer()
        if not self.transport.is_closing():
            self.transport.write(_error_response(exc))
            self.transport.close()


class _Refused(Exception):
    """Raised from a parser callback to stop parsing a refused request."""


def connection_limits(config: GatewayConfig) -> ConnectionLimits:
    lim = config.limits
    return ConnectionLimits(lim.max_header_bytes, lim.header_timeout_s, lim.max_connections)


def guarded_protocol(limits: ConnectionLimits) -> type[GuardedHttpToolsProtocol]:
    """The protocol class for ``uvicorn.Config(http=...)`` with these limits."""
    quiet_answer_cuts()
    return type("GuardedHttpToolsProtocol", (GuardedHttpToolsProtocol,), {"limits": limits})

"""One ext_proc stream: one HTTP request through Envoy, handled by the gateway as one ASGI request.

Envoy's external-processing filter opens a gRPC stream per request and sends what it is configured
to (the shipped config, deploy/envoy: request headers, the request body buffered whole, response
headers, the response body streamed); each message waits for the processor's answer.
``EnvoyStream`` turns that conversation into what the gateway's request path already handles:

* the request headers and body become an ASGI request (scope, ``receive``) given to the gateway's
  own ASGI app, so routing, authentication, pricing, classes, quotas, queueing and admission, the
  access line and metrics are the proxy's, not copies of them;
* an answer the gateway makes itself (a refusal, ``/v1/models``) arrives through ``send`` and goes
  to Envoy as an ``ImmediateResponse``;
* an admitted request reaches the stream's :meth:`forward` (the request's ``Forwarder``): the
  answer to Envoy's last message lets the request go, with the gateway's changes to its headers
  (the pool for Envoy's ``cluster_header`` route, the tenant and tier for an endpoint picker, the
  credentials and private headers taken out) and its body as the proxy would send it; then each
  response message is read as the proxy's relays read the backend's bytes (usage, stream events,
  lease growth, the usage event cut out again where the client did not ask for it), and the
  request ends with the response's end, releasing its tokens;
* the stream closing before that (the client gone, Envoy reset or killed) is the request's client
  disconnecting: the request is cancelled and releases exactly once, as any other.

While a request is priced or waits in the queue, Envoy's message timeout is extended once
(``extproc.extend_after_s`` after the body came, to ``extproc.max_message_timeout_s``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, MutableMapping
from time import perf_counter
from typing import Any
from urllib.parse import unquote

import grpc.aio

from gateway.config.schema import ExtprocConfig
from gateway.extproc import messages
from gateway.extproc.wire_pb2 import HttpHeaders, ProcessingRequest, ProcessingResponse
from gateway.process.signals import SIGNALS, RequestSignals
from gateway.request.errors import AnswerCut, ApiError
from gateway.request.exchange import Exchange, RouteKind
from gateway.request.proxy import ClientGone
from gateway.upstream.pools import Backend
from gateway.upstream.relay import (
    WHOLE_MAX_BYTES,
    stream_ended,
    stream_finish_reasons,
    usage_in_tail,
    whole_usage,
)
from gateway.upstream.sse import UsageRelay

log = logging.getLogger("tokengate.extproc")

App = Callable[[MutableMapping[str, Any], Any, Any], Awaitable[None]]
Write = Callable[[ProcessingResponse], Awaitable[None]]

# Request headers the gateway leaves to Envoy whatever it forwards: the routing pseudo-headers, and
# the framing of a body Envoy re-frames itself.
_ENVOYS = frozenset({"host", "content-length", "transfer-encoding"})
# Response headers the gateway sets on every answer it lets through.
_ANSWER_HEADERS = ("x-request-id", "x-tokengate-class", "x-tokengate-cost", "x-tokengate-queue-ms")


class EnvoyStream:
    """One request through Envoy; the gateway's ``Forwarder`` for it once admitted."""

    def __init__(
        self, settings: ExtprocConfig, write: Write, inbox: AsyncIterator[ProcessingRequest]
    ) -> None:
        self.settings = settings
        self._write = write
        self._incoming = inbox
        self._inbox: asyncio.Queue[ProcessingRequest | None] = asyncio.Queue()
        self._lock = asyncio.Lock()  # one write at a time: an answer and a timeout extension may race
        self._pending = False  # a message of Envoy's waits for its answer
        self._pending_kind = "request_headers"
        self._gone = asyncio.Event()
        # Envoy sent the response's last message: its stream closing from then on is the exchange
        # done, not the client gone (Envoy closes it as soon as it has that message's answer).
        self._response_ended = False
        self.signals = RequestSignals(forwarder=self)
        self.signals.body_complete = True  # Envoy buffered it whole: the first receive() returns it
        self._headers: list[tuple[bytes, bytes]] = []
        self._raw: bytes | None = b""
        self._body_unread: bytes | None = None
        self._start: MutableMapping[str, Any] | None = None
        self._parts: list[bytes] = []
        self._extension: asyncio.TimerHandle | None = None

    # ---- the request, from Envoy to the gateway ----

    async def run(self, app: App, first: HttpHeaders) -> None:
        """Handle the request whose headers Envoy sent first, to its end."""
        method, path, scheme, authority = "GET", "/", "http", b""
        headers = self._headers
        for name, value in messages.header_list(first.headers):
            if name[:1] == b":":
                if name == b":method":
                    method = value.decode("latin-1")
                elif name == b":path":
                    path = value.decode("latin-1")
                elif name == b":scheme":
                    scheme = value.decode("latin-1")
                elif name == b":authority":
                    authority = value
            else:
                headers.append((name, value))
        if authority and not any(n == b"host" for n, _ in headers):
            headers.append((b"host", authority))
        self._pending = True
        if first.end_of_stream:
            body = b""
        else:
            await self._answer(messages.CONTINUE_REQUEST_HEADERS)
            came = await self._request_body()
            if came is None:
                return  # Envoy closed the stream before the body came
            body = came
        self._raw = self._body_unread = body
        target, _, query = path.partition("?")
        scope: MutableMapping[str, Any] = {
            "type": "http",
            "asgi": {"version": "3.0", "spec_version": "2.3"},
            "http_version": "1.1",
            "method": method,
            "scheme": scheme,
            "path": unquote(target),
            "raw_path": target.encode("latin-1"),
            "query_string": query.encode("latin-1"),
            "root_path": "",
            "headers": headers,
            "client": None,
            "server": None,
            "extensions": {SIGNALS: self.signals},
        }
        loop = asyncio.get_running_loop()
        self._extension = loop.call_later(self.settings.extend_after_s, self._extend_soon)
        pump = asyncio.create_task(self._pump(), name="tokengate-extproc-pump")
        task = asyncio.create_task(self._app(app, scope), name="tokengate-extproc-request")
        try:
            await asyncio.shield(task)
        except asyncio.CancelledError:
            # gRPC cancelled the stream (Envoy reset it): the client is gone; the request unwinds and
            # releases what it holds before the stream's task ends.
            self._hang_up()
            with contextlib.suppress(Exception, asyncio.CancelledError):
                await task
            raise
        finally:
            if self._extension is not None:
                self._extension.cancel()
            pump.cancel()

    async def _request_body(self) -> bytes | None:
        """The request's body: one message in Envoy's BUFFERED mode (chunks in other modes, each
        answered as it comes and joined here)."""
        parts: list[bytes] = []
        async for msg in self._incoming:
            which = msg.WhichOneof("request")
            if which == "request_body":
                parts.append(msg.request_body.body)
                if msg.request_body.end_of_stream:
                    self._pending, self._pending_kind = True, "request_body"
                    return b"".join(parts)
                await self._write(messages.CONTINUE_REQUEST_BODY)
            elif which == "request_trailers":  # the body ended before its trailers
                self._pending, self._pending_kind = True, "request_trailers"
                return b"".join(parts)
            else:
                log.warning("ext_proc: %s before the request's body ended; closing the stream", which)
                return None
        return None

    async def _app(self, app: App, scope: MutableMapping[str, Any]) -> None:
        try:
            await app(scope, self._receive, self._send)
        except AnswerCut:
            pass  # the answer was under way through Envoy: the stream's end cuts it
        except ClientGone:
            pass  # Envoy reset the stream while the gateway's own answer was going
        except Exception:
            log.exception("ext_proc: the request failed outside the request path")
        if self._pending and not self._gone.is_set():
            # Never end the stream with a message unanswered: Envoy would take a stream closed
            # cleanly as "go on without the processor" and send the request on unadmitted.
            with contextlib.suppress(ClientGone):  # (Envoy reset it meanwhile: nobody to answer)
                await self._answer(
                    messages.immediate(
                        500,
                        [("content-type", b"application/json")],
                        ApiError(500, "Internal gateway error", code="internal_error").body(),
                        "tokengate_internal_error",
                    )
                )

    async def _pump(self) -> None:
        """Envoy's messages after the request's body, into the inbox; its end is the client's."""
        try:
            async for msg in self._incoming:
                self._inbox.put_nowait(msg)
                if _ends_response(msg):
                    self._response_ended = True
        except Exception:
            pass  # a reset stream: the same as its end
        finally:
            self._hang_up()

    def _hang_up(self) -> None:
        if not self._gone.is_set():
            self._gone.set()
            self._inbox.put_nowait(None)
            if not self._response_ended:
                self.signals.disconnected()

    async def _receive(self) -> MutableMapping[str, Any]:
        body, self._body_unread = self._body_unread, None
        if body is not None:
            return {"type": "http.request", "body": body, "more_body": False}
        await self._gone.wait()
        return {"type": "http.disconnect"}

    async def _send(self, message: MutableMapping[str, Any]) -> None:
        """An answer the gateway makes itself: Envoy sends it in place of the request's (or in
        place of the backend's failure). Anything sent once the backend's answer is under way
        (an SSE error event after a failure mid-stream) has no message to go with: Envoy ends it."""
        if message["type"] == "http.response.start":
            self._start = message
            self._parts = []
            return
        self._parts.append(message.get("body", b""))
        if message.get("more_body", False) or self._start is None or not self._pending:
            return
        start, self._start = self._start, None
        status: int = start["status"]
        headers: list[tuple[str, bytes]] = [
            (n.decode("latin-1"), v) for n, v in start["headers"] if n != b"content-length"
        ]
        await self._answer(messages.immediate(status, headers, b"".join(self._parts), f"tokengate_{status}"))

    async def _answer(self, response: ProcessingResponse) -> None:
        """The answer to Envoy's message now waiting."""
        self._pending = False
        if self._extension is not None:
            self._extension.cancel()
            self._extension = None
        async with self._lock:
            try:
                await self._write(response)
            except grpc.aio.BaseError:
                # Envoy reset the stream before the answer could go (the client went): a hang-up.
                raise ClientGone from None

    def _extend_soon(self) -> None:
        self._extension = None
        if self._pending and not self._gone.is_set():
            asyncio.get_running_loop().create_task(self._extend())

    async def _extend(self) -> None:
        async with self._lock:
            if self._pending and not self._gone.is_set():
                with contextlib.suppress(Exception):  # (a stream closing meanwhile: its end says so)
                    await self._write(messages.extend(self.settings.max_message_timeout_s))

    # ---- the admitted request, through Envoy to the backend and back ----

    async def forward(
        self,
        x: Exchange,
        backend: Backend,
        payload: bytes,
        headers: list[tuple[str, str]],
        grow: Callable[[Exchange], Awaitable[None]] | None,
    ) -> Any:
        await self._answer(self._let_go(x, payload, headers))
        return await self._relay(x, backend, grow)

    def _let_go(self, x: Exchange, payload: bytes, headers: list[tuple[str, str]]) -> ProcessingResponse:
        """The answer that sends the request on: routed to its pool, its headers and body as the
        proxy would send them."""
        s, rec = self.settings, x.record
        came = set(self._headers)
        set_headers: list[tuple[str, bytes]] = [
            (s.pool_header, (rec.pool or "").encode()),
            (s.fairness_header, rec.tenant.encode()),
            (s.objective_header, rec.tier.encode()),
        ]
        kept: set[str] = set()
        for name, value in headers:
            low = name.lower()
            kept.add(low)
            raw = value.encode("latin-1")
            if (low.encode("latin-1"), raw) not in came:
                set_headers.append((low, raw))
        remove = {
            n.decode("latin-1")
            for n, _ in self._headers
            if n.decode("latin-1") not in kept and n.decode("latin-1") not in _ENVOYS
        }
        body: bytes | None = None
        if payload != self._raw:
            body = payload
            set_headers.append(("content-length", str(len(payload)).encode()))
        self._raw = None  # (not needed again: let a large body go)
        mutation = messages.mutation(set_headers, sorted(remove))
        if self._pending_kind == "request_headers":  # a request without a body
            return messages.headers_answer(mutation, response=False, route_again=True)
        return messages.body_answer(mutation, body, route_again=True)

    async def _next(self) -> ProcessingRequest:
        msg = await self._inbox.get()
        if msg is None:
            raise ClientGone  # the stream ended before the response did: the client is gone
        self._pending = True
        return msg

    async def _relay(
        self, x: Exchange, backend: Backend, grow: Callable[[Exchange], Awaitable[None]] | None
    ) -> Any:
        """Read the response as Envoy relays it; the usage it carried (None: none)."""
        rec = x.record
        t_up = rec.upstream_at or perf_counter()
        relay: UsageRelay | None = None
        metered = False
        parts: list[bytes] = []
        size = 0
        tail = b""
        first = True
        traced = rec.trace is not None
        while True:
            msg = await self._next()
            which = msg.WhichOneof("request")
            if which == "response_headers":
                status, ctype, encoded, names = _response_facts(msg.response_headers)
                backend.progressed = True
                if status >= 500:
                    rec.backend_s = perf_counter() - t_up
                    rec.error = f"{backend.name}: HTTP {status} (through Envoy)"
                    x.completion_tokens = 0
                    log.warning("upstream error on pool %s: %s", rec.pool, rec.error)
                    raise ApiError(
                        502,
                        f"The backend for pool {rec.pool!r} failed with HTTP {status}",
                        code="upstream_error",
                    )
                rec.status = status
                x.started = True
                if status >= 400:
                    rec.outcome = rec.reason = "backend_4xx"
                    x.completion_tokens = 0
                x.sse = ctype.startswith("text/event-stream")
                ok = 200 <= status < 300 and not encoded and x.kind is not RouteKind.PASSTHROUGH
                if ok and x.sse and status == 200 and x.kind is not RouteKind.EMBEDDING:
                    relay = UsageRelay(drop_usage=not x.client_wants_usage)
                else:
                    metered = ok
                await self._answer(messages.headers_answer(self._answer_headers(x, names), response=True))
                if msg.response_headers.end_of_stream:
                    break
            elif which == "response_body":
                chunk = msg.response_body.body
                end = msg.response_body.end_of_stream
                backend.progressed = True
                if first and chunk:
                    first = False
                    rec.ttft_s = perf_counter() - rec.start
                    if x.gate is not None:
                        x.gate.release()  # the prompt is prefilled: the next one may go
                if relay is not None:
                    x.streamed_tokens += chunk.count(b"data:")
                    if traced:
                        stream_finish_reasons(rec, chunk)
                    if x.streamed_tokens >= x.grow_at and grow is not None:
                        await grow(x)
                    out = relay.feed(chunk)
                    if end:
                        out += relay.flush()
                    if relay.finished and not x.stream_complete:
                        stream_ended(x, relay, t_up)
                    await self._answer(messages.response_body_answer(None if out == chunk else out))
                else:
                    if metered:
                        if size <= WHOLE_MAX_BYTES:
                            parts.append(chunk)
                            size += len(chunk)
                        else:
                            tail = (tail + chunk)[-(64 << 10) :]
                    await self._answer(messages.CONTINUE_RESPONSE_BODY)
                if end:
                    break
            elif which == "response_trailers":
                await self._answer(messages.CONTINUE_RESPONSE_TRAILERS)
                break
            else:  # (not sent in this state by a filter configured as deploy/envoy's)
                await self._answer(messages.continue_for(which))
        rec.backend_s = perf_counter() - t_up
        x.done = True
        if relay is not None:
            return relay.usage
        if not metered:
            return None
        if size <= WHOLE_MAX_BYTES:
            return whole_usage(b"".join(parts), rec)
        return usage_in_tail(b"".join(parts)[-(64 << 10) :] + tail)

    def _answer_headers(self, x: Exchange, names: list[str]) -> Any:
        rec = x.record
        values = (
            rec.request_id.encode(),
            rec.klass.encode(),
            str(rec.prefill + rec.decode).encode(),
            f"{(rec.queue_s or 0.0) * 1000.0:.1f}".encode(),
        )
        set_headers = list(zip(_ANSWER_HEADERS, values, strict=True))
        if x.ratelimit:
            set_headers.extend((n.decode("latin-1"), v) for n, v in x.ratelimit)
        private = x.private_headers
        remove = [n for n in names if n.encode("latin-1") in private]
        return messages.mutation(set_headers, remove)


def _ends_response(msg: ProcessingRequest) -> bool:
    """Whether Envoy's message is the response's last (nothing follows it on the stream)."""
    which = msg.WhichOneof("request")
    if which == "response_body":
        return msg.response_body.end_of_stream
    if which == "response_headers":
        return msg.response_headers.end_of_stream
    return which == "response_trailers"


def _response_facts(headers: HttpHeaders) -> tuple[int, str, bool, list[str]]:
    """(status, content type, whether the body is encoded, the header names) of a response."""
    status, ctype, encoded = 0, "", False
    names: list[str] = []
    for h in headers.headers.headers:
        name = h.key
        value = h.raw_value or h.value.encode("latin-1")
        if name == ":status":
            status = int(value) if value.isdigit() else 0
        elif name == "content-type":
            ctype = value.decode("latin-1").lower()
        elif name == "content-encoding":
            encoded = value.strip().lower() not in (b"", b"identity")
        if name[:1] != ":":
            names.append(name)
    return status, ctype, encoded, names


__all__ = ["EnvoyStream"]

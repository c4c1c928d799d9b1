"""Relaying the backend's answer to the client: a whole JSON body, an SSE stream chunk by chunk, or a
pass-through answer untouched; and the error a tenant sees when the backend fails.

Each relay fills the exchange's record (status, TTFT, time on the backend) and returns the usage
object the answer carried, if any. Upstream failures become an ``ApiError`` with the pool's name and
a stable code; backend addresses and exception text go to the operator's log only.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from time import perf_counter
from typing import Any

import aiohttp
import orjson

from gateway.errors import ApiError
from gateway.exchange import Exchange
from gateway.sse import UsageRelay
from gateway.upstream.client import UpstreamFailure, classify_error, response_headers
from gateway.upstream.pools import Backend

log = logging.getLogger("tokengate.proxy")

UPSTREAM_ERRORS = (TimeoutError, aiohttp.ClientError, OSError)


def upstream_failed(x: Exchange, failure: UpstreamFailure) -> ApiError:
    """The tenant's answer to an upstream failure; the details go to the operator's log only."""
    x.record.error = failure.detail
    log.warning("upstream failure on pool %s: %s", x.record.pool, failure.detail)
    return ApiError(failure.status, failure.public, code=failure.code)


def _answer_headers(x: Exchange, resp: aiohttp.ClientResponse) -> list[tuple[bytes, bytes]]:
    rec = x.record
    headers = response_headers(resp.raw_headers)
    headers.append((b"x-request-id", rec.request_id.encode()))
    headers.append((b"x-tokengate-class", rec.klass.encode()))
    headers.append((b"x-tokengate-cost", str(rec.prefill + rec.decode).encode()))
    headers.append((b"x-tokengate-queue-ms", f"{(rec.queue_s or 0.0) * 1000.0:.1f}".encode()))
    return headers


def _upstream_message(data: bytes) -> str:
    try:
        obj = orjson.loads(data)
        msg = (
            obj["error"]["message"]
            if isinstance(obj.get("error"), dict)
            else obj.get("message") or obj.get("detail")
        )
        if msg:
            return str(msg)[:500]
    except (orjson.JSONDecodeError, AttributeError, KeyError, TypeError):
        pass
    return data[:200].decode("utf-8", "replace")


async def relay_whole(x: Exchange, resp: aiohttp.ClientResponse, backend: Backend, t_up: float) -> Any:
    """A non-streamed answer (or any answer >= 500): read it all, relay it with a content-length."""
    rec = x.record
    data = await resp.read()
    rec.backend_s = perf_counter() - t_up
    status = resp.status
    if status >= 500:
        rec.error = f"{backend.name}: HTTP {status}: {_upstream_message(data)}"
        log.warning("upstream error on pool %s: %s", rec.pool, rec.error)
        raise ApiError(
            502, f"The backend for pool {rec.pool!r} failed with HTTP {status}", code="upstream_error"
        )
    usage = None
    if 200 <= status < 300 and b'"usage"' in data and "Content-Encoding" not in resp.headers:
        try:
            obj = orjson.loads(data)
            usage = obj.get("usage") if isinstance(obj, dict) else None
        except orjson.JSONDecodeError:
            pass
    headers = _answer_headers(x, resp)
    headers.append((b"content-length", str(len(data)).encode()))
    rec.status = status
    if status >= 400:
        rec.outcome = rec.reason = "backend_4xx"
    x.started = True
    x.done = True
    await x.send({"type": "http.response.start", "status": status, "headers": headers})
    await x.send({"type": "http.response.body", "body": data, "more_body": False})
    return usage


Grow = Callable[[Exchange], Awaitable[None]]


async def relay_sse(x: Exchange, resp: aiohttp.ClientResponse, t_up: float, grow: Grow | None = None) -> Any:
    """A stream, event by event as it arrives; the usage event is cut out when the client did not ask."""
    rec = x.record
    relay = UsageRelay(drop_usage=not x.client_wants_usage)
    rec.status = 200
    x.started = True
    send = x.send
    await send({"type": "http.response.start", "status": 200, "headers": _answer_headers(x, resp)})
    content = resp.content
    first = True
    try:
        while True:
            chunk = await content.readany()
            if not chunk:
                break
            if first:
                rec.ttft_s = perf_counter() - rec.start
                first = False
                if x.gate is not None:
                    x.gate.release()  # the prompt is prefilled: the next one may go
            # About one output token per event: count events (a C-level scan, no parsing).
            x.streamed_tokens += chunk.count(b"data:")
            if x.streamed_tokens >= x.grow_at and grow is not None:
                await grow(x)  # before the output outgrows what the lease holds
            out = relay.feed(chunk)
            if out:
                await send({"type": "http.response.body", "body": out, "more_body": True})
    except UPSTREAM_ERRORS as exc:
        rec.backend_s = perf_counter() - t_up
        rec.outcome = "upstream_error"
        failure = classify_error(exc, pool=rec.pool or "?", backend=rec.backend or "?")
        raise upstream_failed(x, failure) from None
    rec.backend_s = perf_counter() - t_up
    tail = relay.flush()
    x.done = True
    await send({"type": "http.response.body", "body": tail, "more_body": False})
    return relay.usage


async def relay_raw(x: Exchange, resp: aiohttp.ClientResponse, t_up: float) -> None:
    """Pass-through routes: any answer below 500, relayed chunk by chunk without looking inside."""
    rec = x.record
    rec.status = resp.status
    if resp.status >= 400:
        rec.outcome = rec.reason = "backend_4xx"
    x.started = True
    await x.send({"type": "http.response.start", "status": resp.status, "headers": _answer_headers(x, resp)})
    content = resp.content
    while True:
        chunk = await content.readany()
        if not chunk:
            break
        await x.send({"type": "http.response.body", "body": chunk, "more_body": True})
    rec.backend_s = perf_counter() - t_up
    x.done = True
    await x.send({"type": "http.response.body", "body": b"", "more_body": False})

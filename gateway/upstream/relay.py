"""Relaying the backend's answer to the client: a whole JSON body, an SSE stream chunk by chunk, or a
pass-through answer untouched; and the error a tenant sees when the backend fails.

Each relay fills the exchange's record (status, TTFT, time on the backend) and returns the usage
object the answer carried, if any. Upstream failures become an ``ApiError`` with the pool's name and
a stable code; backend addresses and exception text go to the operator's log only.

Each chunk read sets ``backend.progressed``: a bare attribute store, the cheapest mark on the hot
path (no clock read, no counter arithmetic). The health checker reads and clears the flag once per
probe of that backend, so a probe that times out while the backend's answers are flowing is not
held against it (``gateway.upstream.health``).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Awaitable, Callable
from time import perf_counter
from typing import Any

import aiohttp
import orjson

from gateway.observe.accesslog import Record
from gateway.request.errors import ApiError
from gateway.request.exchange import Exchange
from gateway.request.usage import reported
from gateway.upstream.client import UpstreamFailure, classify_error, response_headers
from gateway.upstream.pools import Backend
from gateway.upstream.sse import UsageRelay

log = logging.getLogger("tokengate.proxy")

UPSTREAM_ERRORS = (TimeoutError, aiohttp.ClientError, OSError)


def upstream_failed(x: Exchange, failure: UpstreamFailure) -> ApiError:
    """The tenant's answer to an upstream failure; the details go to the operator's log only."""
    x.record.error = failure.detail
    log.warning("upstream failure on pool %s: %s", x.record.pool, failure.detail)
    return ApiError(failure.status, failure.public, code=failure.code)


def _answer_headers(x: Exchange, resp: aiohttp.ClientResponse) -> list[tuple[bytes, bytes]]:
    rec = x.record
    headers = response_headers(resp.raw_headers, x.private_headers)
    headers.append((b"x-request-id", rec.request_id.encode()))
    headers.append((b"x-tokengate-class", rec.klass.encode()))
    headers.append((b"x-tokengate-cost", str(rec.prefill + rec.decode).encode()))
    headers.append((b"x-tokengate-queue-ms", f"{(rec.queue_s or 0.0) * 1000.0:.1f}".encode()))
    if x.ratelimit:
        headers.extend(x.ratelimit)
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


# A non-streamed answer up to this size is read whole and its usage parsed from it; a larger one
# (a long generation with logprobs runs to hundreds of MB) is relayed chunk by chunk as it arrives,
# keeping only its last ``_TAIL_BYTES`` to find the usage object, so the gateway never holds it
# whole, nor parses it on the event loop.
WHOLE_MAX_BYTES = 1 << 20
_TAIL_BYTES = 64 << 10
# What is read of a failed (>= 500) answer: its message goes to the operator's log, cut anyway.
_ERROR_BYTES = 64 << 10


async def relay_whole(x: Exchange, resp: aiohttp.ClientResponse, backend: Backend, t_up: float) -> Any:
    """A non-streamed answer (or any answer >= 500): up to ``WHOLE_MAX_BYTES`` read whole and relayed
    with a content-length; larger (or of unknown length and found larger), relayed as it arrives."""
    rec = x.record
    status = resp.status
    if status >= 500:
        data = await resp.content.read(_ERROR_BYTES)
        rec.backend_s = perf_counter() - t_up
        rec.error = f"{backend.name}: HTTP {status}: {_upstream_message(data)}"
        log.warning("upstream error on pool %s: %s", rec.pool, rec.error)
        raise ApiError(
            502, f"The backend for pool {rec.pool!r} failed with HTTP {status}", code="upstream_error"
        )
    length = resp.content_length
    if length is not None and length <= WHOLE_MAX_BYTES:
        data = await resp.read()
    else:
        data = await _read_upto(resp, backend, WHOLE_MAX_BYTES)
        if len(data) > WHOLE_MAX_BYTES:
            return await _relay_large(x, resp, backend, status, data, t_up)
    rec.backend_s = perf_counter() - t_up
    usage = whole_usage(data, rec) if 200 <= status < 300 and "Content-Encoding" not in resp.headers else None
    headers = _answer_headers(x, resp)
    headers.append((b"content-length", str(len(data)).encode()))
    _answered(x, status)
    x.done = True
    await x.send({"type": "http.response.start", "status": status, "headers": headers})
    await x.send({"type": "http.response.body", "body": data, "more_body": False})
    return usage


def whole_usage(data: bytes, rec: Record) -> Any:
    """The top-level usage object of a whole JSON answer, if it has one (and, while the request is
    traced, the answer's id, model and finish reasons for its span)."""
    if b'"usage"' not in data and rec.trace is None:
        return None
    try:
        obj = orjson.loads(data)
    except orjson.JSONDecodeError:
        return None
    if not isinstance(obj, dict):
        return None
    if rec.trace is not None:
        _response_facts(rec, obj)
    return obj.get("usage")


def _response_facts(rec: Record, obj: dict[str, Any]) -> None:
    rid, model, choices = obj.get("id"), obj.get("model"), obj.get("choices")
    rec.response_id = rid[:256] if isinstance(rid, str) else None
    rec.response_model = model[:256] if isinstance(model, str) else None
    if isinstance(choices, list):
        reasons = [c.get("finish_reason") for c in choices[:64] if isinstance(c, dict)]
        found = tuple(r[:64] for r in reasons if isinstance(r, str))
        if found:  # (a stream's usage event has no choices: its reasons came with the events before)
            rec.finish_reasons = found
    elif obj.get("object") == "response":  # the Responses API: its status is the finish
        status = obj.get("status")
        rec.finish_reasons = (status[:64],) if isinstance(status, str) else None


def _answered(x: Exchange, status: int) -> None:
    """The answer's headers go out now with ``status``."""
    x.record.status = status
    if status >= 400:
        x.record.outcome = x.record.reason = "backend_4xx"
    x.started = True


async def _read_upto(resp: aiohttp.ClientResponse, backend: Backend, limit: int) -> bytes:
    """The answer's bytes until its end or until more than ``limit`` have come (then a little more)."""
    parts: list[bytes] = []
    size = 0
    while size <= limit:
        chunk = await resp.content.readany()
        if not chunk:
            break
        backend.progressed = True
        parts.append(chunk)
        size += len(chunk)
    return b"".join(parts)


async def _relay_large(
    x: Exchange, resp: aiohttp.ClientResponse, backend: Backend, status: int, head: bytes, t_up: float
) -> Any:
    """Relay an answer larger than ``WHOLE_MAX_BYTES``: what was read so far, then the rest as it
    arrives; the usage object is looked for in its last ``_TAIL_BYTES``."""
    headers = _answer_headers(x, resp)  # (no content-length: sent chunked, as a stream is)
    _answered(x, status)
    send = x.send
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": head, "more_body": True})
    tail = head[-_TAIL_BYTES:]
    content = resp.content
    while True:
        chunk = await content.readany()
        if not chunk:
            break
        backend.progressed = True
        await send({"type": "http.response.body", "body": chunk, "more_body": True})
        tail = (tail + chunk)[-_TAIL_BYTES:] if len(chunk) < _TAIL_BYTES else chunk[-_TAIL_BYTES:]
    x.record.backend_s = perf_counter() - t_up
    x.done = True
    await send({"type": "http.response.body", "body": b"", "more_body": False})
    if not 200 <= status < 300 or "Content-Encoding" in resp.headers:
        return None
    return usage_in_tail(tail)


def usage_in_tail(tail: bytes) -> Any:
    """The usage object found in the last bytes of a JSON answer: the last ``"usage":{...}`` there
    (a key: inside a JSON string its quotes would be escaped), parsed alone; None when there is
    none or it does not parse. Engines write usage after the choices, near the end."""
    at = max(tail.rfind(b'"usage":{'), tail.rfind(b'"usage": {'))
    if at < 0:
        return None
    start = tail.index(b"{", at)
    depth = 0
    in_string = False
    escaped = False
    for i in range(start, len(tail)):
        c = tail[i]
        if in_string:
            if escaped:
                escaped = False
            elif c == 0x5C:  # backslash
                escaped = True
            elif c == 0x22:  # quote
                in_string = False
        elif c == 0x22:
            in_string = True
        elif c == 0x7B:  # {
            depth += 1
        elif c == 0x7D:  # }
            depth -= 1
            if depth == 0:
                try:
                    usage = orjson.loads(tail[start : i + 1])
                except orjson.JSONDecodeError:
                    return None
                return usage if isinstance(usage, dict) else None
    return None


Grow = Callable[[Exchange], Awaitable[None]]


async def relay_sse(
    x: Exchange, resp: aiohttp.ClientResponse, backend: Backend, t_up: float, grow: Grow | None = None
) -> Any:
    """A stream, event by event as it arrives; the usage event is cut out when the client did not ask."""
    rec = x.record
    relay = UsageRelay(drop_usage=not x.client_wants_usage)
    rec.status = 200
    x.started = x.sse = True
    send = x.send
    await send({"type": "http.response.start", "status": 200, "headers": _answer_headers(x, resp)})
    content = resp.content
    first = True
    traced = rec.trace is not None
    try:
        while True:
            chunk = await content.readany()
            if not chunk:
                break
            backend.progressed = True
            if first:
                rec.ttft_s = perf_counter() - rec.start
                first = False
                if x.gate is not None:
                    x.gate.release()  # the prompt is prefilled: the next one may go
            # About one output token per event: count events (a C-level scan, no parsing).
            x.streamed_tokens += chunk.count(b"data:")
            if traced:
                stream_finish_reasons(rec, chunk)
            if x.streamed_tokens >= x.grow_at and grow is not None:
                await grow(x)  # before the output outgrows what the lease holds
            out = relay.feed(chunk)
            if out:
                await send({"type": "http.response.body", "body": out, "more_body": True})
            if relay.finished and not x.stream_complete:
                stream_ended(x, relay, t_up)
    except UPSTREAM_ERRORS as exc:
        if x.stream_complete:  # the engine dropped the connection after its last event: complete
            rec.backend_s = perf_counter() - t_up
            x.done = True
            await send({"type": "http.response.body", "body": relay.flush(), "more_body": False})
            return relay.usage
        rec.backend_s = perf_counter() - t_up
        rec.outcome = "upstream_error"
        failure = classify_error(exc, pool=rec.pool or "?", backend=rec.backend or "?")
        raise upstream_failed(x, failure) from None
    rec.backend_s = perf_counter() - t_up
    tail = relay.flush()
    if relay.finished and not x.stream_complete:
        stream_ended(x, relay, t_up)
    x.done = True
    await send({"type": "http.response.body", "body": tail, "more_body": False})
    return relay.usage


# A choice's finish reason in a stream's events (engines write it with or without a space).
_FINISH = re.compile(rb'"finish_reason":\s*"([^"\\]{1,64})"')


def stream_finish_reasons(rec: Record, chunk: bytes) -> None:
    """A traced stream's finish reasons, read off the events' bytes (a regex scan, no parsing)."""
    found = _FINISH.findall(chunk)
    if found:
        have = list(rec.finish_reasons or ())
        for r in found:
            if len(have) < 64:
                have.append(r.decode("utf-8", "replace"))
        rec.finish_reasons = tuple(have)


def stream_ended(x: Exchange, relay: UsageRelay, t_up: float) -> None:
    """The stream's last event went out: the answer is whole from here on, and its usage (if the
    engine sent any) is recorded now, before a client that hangs up at [DONE] cancels the rest."""
    x.stream_complete = True
    x.record.backend_s = perf_counter() - t_up  # (measured again at the stream's end, if it comes)
    if relay.usage is not None:
        reported(x, relay.usage)
        if x.record.trace is not None and relay.usage_event is not None:
            _response_facts(x.record, relay.usage_event)  # (its id and model; choices are not read)


async def relay_raw(x: Exchange, resp: aiohttp.ClientResponse, backend: Backend, t_up: float) -> None:
    """Pass-through routes: any answer below 500, relayed chunk by chunk without looking inside."""
    rec = x.record
    rec.status = resp.status
    if resp.status >= 400:
        rec.outcome = rec.reason = "backend_4xx"
    x.started = True
    x.sse = resp.content_type == "text/event-stream"
    await x.send({"type": "http.response.start", "status": resp.status, "headers": _answer_headers(x, resp)})
    content = resp.content
    while True:
        chunk = await content.readany()
        if not chunk:
            break
        backend.progressed = True
        await x.send({"type": "http.response.body", "body": chunk, "more_body": True})
    rec.backend_s = perf_counter() - t_up
    x.done = True
    await x.send({"type": "http.response.body", "body": b"", "more_body": False})

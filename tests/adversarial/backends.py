"""Backends that misbehave on purpose, as raw ASGI apps for ``tests.conftest.serve_asgi``."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import orjson

from tests.conftest import Receive, Scope, Send


async def lifespan(receive: Receive, send: Send) -> None:
    """Answer an ASGI lifespan conversation: started, then stopped."""
    while (await receive())["type"] != "lifespan.shutdown":
        await send({"type": "lifespan.startup.complete"})
    await send({"type": "lifespan.shutdown.complete"})


async def _start(send: Send, content_type: bytes, status: int = 200) -> None:
    await send(
        {"type": "http.response.start", "status": status, "headers": [(b"content-type", content_type)]}
    )


async def _json(send: Send, status: int, obj: Any) -> None:
    await _start(send, b"application/json", status)
    await send({"type": "http.response.body", "body": orjson.dumps(obj)})


async def _read_body(receive: Receive) -> bytes:
    raw = b""
    while True:
        m = await receive()
        raw += m.get("body", b"")
        if not m.get("more_body"):
            return raw


class _Backend:
    """Lifespan and ``/v1/models`` answered; every other request goes to ``answer`` with its body."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await lifespan(receive, send)
            return
        if scope["path"] == "/v1/models":
            await _json(send, 200, {"data": [{"id": "stub-model"}]})
            return
        await self.answer(scope, await _read_body(receive), send)

    async def answer(self, scope: Scope, raw: bytes, send: Send) -> None:
        raise NotImplementedError


class LyingUsage(_Backend):
    """Answers chat completions with whatever usage the request's ``x-usage`` header holds (raw JSON
    text, inserted verbatim), streamed or not."""

    async def answer(self, scope: Scope, raw: bytes, send: Send) -> None:
        body = orjson.loads(raw) if raw else {}
        usage = dict(scope["headers"]).get(b"x-usage", b"null")
        if not body.get("stream"):
            data = (
                b'{"id":"x","object":"chat.completion","choices":[{"index":0,"message":{"role":"assistant","content":"ok"}}],"usage":'
                + usage
                + b"}"
            )
            await _start(send, b"application/json")
            await send({"type": "http.response.body", "body": data})
            return
        await _start(send, b"text/event-stream")
        frames = [
            b'data: {"choices":[{"index":0,"delta":{"content":"ok"}}]}\n\n',
            b'data: {"choices":[],"usage":' + usage + b"}\n\n",
            b"data: [DONE]\n\n",
        ]
        for frame in frames:
            await send({"type": "http.response.body", "body": frame, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})


class HalfStream(_Backend):
    """Starts an SSE answer, sends two events, then drops the connection."""

    async def answer(self, scope: Scope, raw: bytes, send: Send) -> None:
        await _start(send, b"text/event-stream")
        for i in range(2):
            frame = {"choices": [{"index": 0, "delta": {"content": f"t{i}"}}]}
            body = b"data: " + orjson.dumps(frame) + b"\n\n"
            await send({"type": "http.response.body", "body": body, "more_body": True})
            await asyncio.sleep(0.01)  # the scenario: a stream under way when the backend dies
        raise RuntimeError("backend crashed mid-stream at /opt/secret/engine.py")


class MediaFetching(_Backend):
    """Fetches every http(s) media URL of a request before answering, as an engine's media connector
    does (vLLM: any host, redirects followed): each ``url`` / ``image_url`` / ``file_url`` string
    found anywhere in the body. Records what it fetched and how that went in ``fetched``."""

    def __init__(self) -> None:
        self.fetched: list[tuple[str, str]] = []
        self.bodies: list[Any] = []

    async def answer(self, scope: Scope, raw: bytes, send: Send) -> None:
        body = orjson.loads(raw) if raw else {}
        if raw:
            self.bodies.append(body)
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2)) as session:
            for url in _media_urls(body):
                try:
                    async with session.get(url) as r:
                        self.fetched.append((url, str(r.status)))
                except Exception as exc:  # what the engine makes of it is not this test's concern
                    self.fetched.append((url, type(exc).__name__))
        await _json(
            send,
            200,
            {
                "id": "x",
                "object": "chat.completion",
                "choices": [{"index": 0, "message": {"role": "assistant", "content": "a cat"}}],
                "usage": {"prompt_tokens": 10, "completion_tokens": 2, "total_tokens": 12},
            },
        )


def _media_urls(value: Any) -> list[str]:
    found: list[str] = []
    if isinstance(value, dict):
        for key, v in value.items():
            if key in ("url", "image_url", "file_url") and isinstance(v, str) and v[:4].lower() == "http":
                found.append(v)
            else:
                found += _media_urls(v)
    elif isinstance(value, list):
        for v in value:
            found += _media_urls(v)
    return found


class RoutingStack(_Backend):
    """Stands for a routing layer behind the gateway (SGLang's model gateway, an llm-d inference
    gateway): records the headers each request arrived with, and answers - JSON, or SSE when the body
    asks to stream - with headers that say where the request ran."""

    SERVED = (
        (b"x-smg-worker-id", b"0f3a9c12"),
        (b"x-gateway-destination-endpoint-served", b"10.0.3.7:8000"),
        (b"x-answer-other", b"kept"),
    )

    def __init__(self) -> None:
        self.headers: list[dict[str, str]] = []

    async def answer(self, scope: Scope, raw: bytes, send: Send) -> None:
        if scope["method"] == "POST":  # (not the gateway's own health probes)
            self.headers.append({k.decode(): v.decode() for k, v in scope["headers"]})
        body = orjson.loads(raw) if raw else {}
        stream = isinstance(body, dict) and body.get("stream") is True
        kind = b"text/event-stream" if stream else b"application/json"
        headers = [(b"content-type", kind), *self.SERVED]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        if stream:
            frames = b'data: {"choices":[{"index":0,"delta":{"content":"ok"}}]}\n\ndata: [DONE]\n\n'
            await send({"type": "http.response.body", "body": frames})
            return
        answer = {
            "id": "x",
            "object": "chat.completion",
            "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}}],
            "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4},
        }
        await send({"type": "http.response.body", "body": orjson.dumps(answer)})

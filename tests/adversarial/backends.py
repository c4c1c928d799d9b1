"""Backends that misbehave on purpose, as raw ASGI apps for ``tests.conftest.serve_asgi``."""

from __future__ import annotations

from typing import Any

import orjson

from tests.conftest import Receive, Scope, Send


async def _lifespan(receive: Receive, send: Send) -> None:
    while (await receive())["type"] != "lifespan.shutdown":
        await send({"type": "lifespan.startup.complete"})
    await send({"type": "lifespan.shutdown.complete"})


async def _json(send: Send, status: int, obj: Any) -> None:
    body = orjson.dumps(obj)
    await send(
        {"type": "http.response.start", "status": status, "headers": [(b"content-type", b"application/json")]}
    )
    await send({"type": "http.response.body", "body": body})


class LyingUsage:
    """Answers chat completions with whatever usage the request's ``x-usage`` header holds (raw JSON
    text, inserted verbatim), streamed or not."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await _lifespan(receive, send)
            return
        if scope["path"] == "/v1/models":
            await _json(send, 200, {"data": [{"id": "stub-model"}]})
            return
        raw = b""
        while True:
            m = await receive()
            raw += m.get("body", b"")
            if not m.get("more_body"):
                break
        body = orjson.loads(raw) if raw else {}
        usage = dict(scope["headers"]).get(b"x-usage", b"null")
        if not body.get("stream"):
            data = (
                b'{"id":"x","object":"chat.completion","choices":[{"index":0,"message":{"role":"assistant","content":"ok"}}],"usage":'
                + usage
                + b"}"
            )
            await send(
                {
                    "type": "http.response.start",
                    "status": 200,
                    "headers": [(b"content-type", b"application/json")],
                }
            )
            await send({"type": "http.response.body", "body": data})
            return
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [(b"content-type", b"text/event-stream")],
            }
        )
        frames = [
            b'data: {"choices":[{"index":0,"delta":{"content":"ok"}}]}\n\n',
            b'data: {"choices":[],"usage":' + usage + b"}\n\n",
            b"data: [DONE]\n\n",
        ]
        for frame in frames:
            await send({"type": "http.response.body", "body": frame, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

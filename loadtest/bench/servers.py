"""The servers the overhead benchmark measures against, each run in its own process:

* ``stub``: a zero-delay OpenAI-compatible backend (raw ASGI on uvicorn + uvloop + httptools,
  pre-encoded answers) so the backend costs as little as possible;
* ``bare``: the same stack as the gateway without admission: Starlette + one shared aiohttp
  session, body forwarded, answer relayed (streamed chunk by chunk for SSE).

Run one: ``python -m loadtest.bench.servers stub --port 9001`` or
``python -m loadtest.bench.servers bare --port 9002 --upstream http://127.0.0.1:9001``.

The tests' stub backend (tests/conftest.py) is a different animal: it records every request and
misbehaves on demand; this one only answers, as fast as it can.
"""

from __future__ import annotations

import argparse
import contextlib
from typing import Any

MODEL = "bench"
PACED_MODEL = "bench-paced"  # its streams pace their events (one chunk each), as an engine decodes
CHUNKS = 16  # content chunks per streamed answer


def stub_app(event_gap_s: float = 0.001) -> Any:
    """A zero-delay OpenAI-compatible backend: pre-encoded answers, so it costs as little as possible.
    A stream for ``PACED_MODEL`` waits ``event_gap_s`` before each event, so each is its own chunk."""
    import asyncio

    import orjson

    usage = {"prompt_tokens": 25, "completion_tokens": CHUNKS, "total_tokens": 25 + CHUNKS}
    whole = orjson.dumps(
        {
            "id": "cmpl-bench",
            "object": "chat.completion",
            "created": 0,
            "model": MODEL,
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": " word" * CHUNKS},
                    "finish_reason": "length",
                }
            ],
            "usage": usage,
        }
    )
    frames = [
        b"data: "
        + orjson.dumps(
            {
                "id": "cmpl-bench",
                "object": "chat.completion.chunk",
                "created": 0,
                "model": MODEL,
                "choices": [{"index": 0, "delta": {"content": " word"}, "finish_reason": None}],
            }
        )
        + b"\n\n"
        for _ in range(CHUNKS)
    ]
    usage_frame = (
        b"data: "
        + orjson.dumps({"id": "cmpl-bench", "object": "chat.completion.chunk", "choices": [], "usage": usage})
        + b"\n\n"
    )
    json_headers = [(b"content-type", b"application/json"), (b"content-length", str(len(whole)).encode())]
    sse_headers = [(b"content-type", b"text/event-stream")]

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while True:
                m = await receive()
                await send({"type": m["type"] + ".complete"})
                if m["type"] == "lifespan.shutdown":
                    return
        body = b""
        while True:
            m = await receive()
            body += m.get("body", b"")
            if not m.get("more_body"):
                break
        if scope["path"] == "/v1/models":
            data = orjson.dumps({"object": "list", "data": [{"id": MODEL, "object": "model"}]})
            await send(
                {
                    "type": "http.response.start",
                    "status": 200,
                    "headers": [(b"content-type", b"application/json")],
                }
            )
            await send({"type": "http.response.body", "body": data})
            return
        if b'"stream":true' not in body.replace(b" ", b""):
            await send({"type": "http.response.start", "status": 200, "headers": json_headers})
            await send({"type": "http.response.body", "body": whole})
            return
        await send({"type": "http.response.start", "status": 200, "headers": sse_headers})
        paced = b'"model":"' + PACED_MODEL.encode() + b'"' in body.replace(b" ", b"")
        for f in frames:
            if paced:
                await asyncio.sleep(event_gap_s)
            await send({"type": "http.response.body", "body": f, "more_body": True})
        if b'"include_usage":true' in body.replace(b" ", b""):
            await send({"type": "http.response.body", "body": usage_frame, "more_body": True})
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": False})

    return app


def bare_app(upstream: str) -> Any:
    """The gateway's stack without admission: Starlette + one shared aiohttp session, body forwarded,
    answer relayed (streamed chunk by chunk for SSE)."""
    import aiohttp
    from starlette.applications import Starlette
    from starlette.background import BackgroundTask
    from starlette.requests import Request
    from starlette.responses import Response, StreamingResponse
    from starlette.routing import Route

    from gateway.upstream.client import make_session

    state: dict[str, aiohttp.ClientSession] = {}
    drop = {"host", "content-length", "connection", "keep-alive", "transfer-encoding", "accept-encoding"}

    async def proxy(request: Request) -> Response:
        body = await request.body()
        headers = {k: v for k, v in request.headers.items() if k not in drop}
        resp = await state["s"].post(upstream + request.url.path, data=body, headers=headers)
        out_headers = {"content-type": resp.headers.get("content-type", "application/json")}
        if resp.content_type == "text/event-stream":
            return StreamingResponse(
                resp.content.iter_any(),
                status_code=resp.status,
                headers=out_headers,
                background=BackgroundTask(resp.release),
            )
        data = await resp.read()
        return Response(data, status_code=resp.status, headers=out_headers)

    async def lifespan(app: Starlette) -> Any:
        state["s"] = make_session()
        yield
        await state["s"].close()

    return Starlette(
        routes=[Route("/v1/chat/completions", proxy, methods=["POST"])],
        lifespan=contextlib.asynccontextmanager(lifespan),
    )


def serve(app: Any, port: int) -> None:
    """Run ``app`` on 127.0.0.1:``port`` as the gateway runs: uvloop + httptools, no access log."""
    import uvicorn

    uvicorn.run(
        app,
        host="127.0.0.1",
        port=port,
        log_level="warning",
        access_log=False,
        loop="uvloop",
        http="httptools",
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m loadtest.bench.servers",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("role", choices=["stub", "bare"])
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--upstream", help="bare: the stub's base URL")
    p.add_argument(
        "--event-gap-ms", type=float, default=1.0, help=f"stub: the gap before each event of {PACED_MODEL}"
    )
    args = p.parse_args(argv)
    if args.role == "bare" and not args.upstream:
        p.error("bare needs --upstream")
    app = stub_app(args.event_gap_ms / 1e3) if args.role == "stub" else bare_app(args.upstream)
    serve(app, args.port)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

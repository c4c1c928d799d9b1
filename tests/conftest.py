"""Shared fixtures: free ports, a controllable stub OpenAI backend and a running gateway, all
over real sockets (uvicorn inside the test's event loop).

The stub backend is raw ASGI so it is cheap and fully under the test's control. Per request,
behaviour comes from headers the gateway forwards untouched:

* ``x-stub-delay``: seconds to wait before answering (non-streaming) or before the first chunk;
* ``x-stub-status``: answer with this HTTP status and an OpenAI-style error body;
* ``x-stub-chunks`` / ``x-stub-interval``: number of content chunks in a stream and the pause
  between them;
* ``x-stub-drop``: close the connection without answering;
* ``x-stub-no-usage``: never send usage, whatever ``stream_options`` asks (llama-cpp-python's server);
* ``x-stub-linger``: seconds a stream stays open after its ``data: [DONE]`` before it ends.

It records every request (headers, parsed body), the exact bytes of every stream it sent, and
when a client went away before the answer was complete (``cancelled``).
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, MutableMapping
from dataclasses import dataclass, field
from typing import Any

import orjson
import pytest
import uvicorn
from hypothesis import settings

from loadtest.processes import free_port
from tests.support import LONG, eventually

# ``make test`` runs the same examples every time (a property test never turns a run red by the
# luck of its seed); ``make test-long`` explores with fresh seeds and keeps what fails in
# .hypothesis/ to replay first next time.
settings.register_profile("deterministic", derandomize=True, database=None, print_blob=True)
settings.register_profile("explore", print_blob=True)
settings.load_profile("explore" if LONG else "deterministic")

Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


@dataclass
class Served:
    url: str
    server: uvicorn.Server
    task: asyncio.Task[None]

    async def stop(self) -> None:
        self.server.should_exit = True
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.wait_for(self.task, timeout=10)


class _TestServer(uvicorn.Server):
    """uvicorn checks ``should_exit`` every 0.1 s; a test stops dozens of servers, so check every
    10 ms (``on_tick`` still refreshes the Date header and the other housekeeping)."""

    async def main_loop(self) -> None:
        counter = 0
        while not await self.on_tick(counter):
            counter = (counter + 1) % 864000
            await asyncio.sleep(0.01)

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        """uvicorn's shutdown, polled every 5 ms: uvicorn sleeps 0.1 s after asking connections to
        close and polls them every 0.1 s, which cost every test that stops a gateway, its ops
        listener and a stub ~0.3 s of waiting for connections already closed."""
        for server in self.servers:
            server.close()
        for sock in sockets or []:
            sock.close()
        for connection in list(self.server_state.connections):
            connection.shutdown()
        state = self.server_state
        try:
            async with asyncio.timeout(self.config.timeout_graceful_shutdown):
                while state.connections or state.tasks:  # noqa: ASYNC110 (uvicorn keeps no event)
                    await asyncio.sleep(0.005)
                for server in self.servers:
                    await server.wait_closed()
        except TimeoutError:
            for task in state.tasks:
                task.cancel(msg="Task cancelled, timeout graceful shutdown exceeded")
        if not self.force_exit:
            await self.lifespan.shutdown()


async def serve_asgi(
    app: Any, *, port: int | None = None, graceful_s: float = 1.0, http: Any = "httptools"
) -> Served:
    """Serve ``app`` on 127.0.0.1 in the running loop; returns once it accepts connections."""
    # proto=IPPROTO_TCP: asyncio only sets TCP_NODELAY on accepted sockets whose proto says TCP
    # (a proto-0 listener costs every keep-alive response a 40 ms delayed-ACK stall).
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", port or 0))
    actual = sock.getsockname()[1]
    config = uvicorn.Config(
        app,
        log_level="warning",
        access_log=False,
        lifespan="on",
        http=http,
        timeout_graceful_shutdown=graceful_s,
    )
    server = _TestServer(config)
    # Tests run inside pytest's loop: let pytest keep its own signal handlers.
    server.capture_signals = contextlib.nullcontext  # type: ignore[method-assign,assignment]
    task = asyncio.create_task(server.serve(sockets=[sock]))
    await eventually(lambda: server.started or task.done(), timeout_s=10, message="server did not start")
    if task.done():
        task.result()
        raise RuntimeError("server exited during start-up")
    return Served(url=f"http://127.0.0.1:{actual}", server=server, task=task)


# ---- stub OpenAI backend ----


@dataclass
class StubRequest:
    path: str
    method: str
    headers: dict[str, str]
    body: Any
    raw: bytes
    received_at: float
    cancelled_at: float | None = None
    completed: bool = False
    sent: bytes = b""
    raw_target: str = ""  # the request target exactly as it arrived: raw path + "?" + query


@dataclass
class StubBackend:
    """Raw-ASGI OpenAI-compatible stub. Answers are deterministic."""

    models: tuple[str, ...] = ("stub-model",)
    default_chunks: int = 3
    default_interval: float = 0.0
    health_status: int = 200
    requests: list[StubRequest] = field(default_factory=list)

    def by_header(self, name: str, value: str) -> StubRequest:
        for r in self.requests:
            if r.headers.get(name) == value:
                return r
        raise KeyError(f"no request with {name}={value}")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            while True:
                m = await receive()
                if m["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                else:
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        path, method = scope["path"], scope["method"]
        headers = {k.decode(): v.decode() for k, v in scope["headers"]}
        chunks = []
        while True:
            m = await receive()
            if m["type"] == "http.disconnect":
                return
            chunks.append(m.get("body", b""))
            if not m.get("more_body"):
                break
        raw = b"".join(chunks)
        try:
            body = orjson.loads(raw) if raw else None
        except orjson.JSONDecodeError:
            body = None
        req = StubRequest(path, method, headers, body, raw, time.monotonic())
        qs = scope.get("query_string") or b""
        req.raw_target = (scope.get("raw_path") or path.encode()).decode("latin-1") + (
            "?" + qs.decode("latin-1") if qs else ""
        )
        if path == "/health":
            await _json(send, self.health_status, {"status": "ok"})
            return
        if path == "/metrics":
            # Scraped by the gateway's observer: answered, never recorded as a proxied request.
            await send(
                {"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]}
            )
            await send({"type": "http.response.body", "body": b"# no engine metrics in the stub\n"})
            return
        if path == "/v1/models":
            await _json(
                send, 200, {"object": "list", "data": [{"id": m, "object": "model"} for m in self.models]}
            )
            return
        self.requests.append(req)
        gone = asyncio.Event()

        async def watch() -> None:
            while True:
                msg = await receive()
                if msg["type"] == "http.disconnect":
                    if not req.completed:
                        req.cancelled_at = time.monotonic()
                    gone.set()
                    return

        watcher = asyncio.create_task(watch())
        try:
            await self._answer(req, send, gone)
        finally:
            watcher.cancel()

    async def _answer(self, req: StubRequest, send: Send, gone: asyncio.Event) -> None:
        h = req.headers
        delay = float(h.get("x-stub-delay", "0"))
        if "x-stub-drop" in h:
            raise RuntimeError("stub: dropping the connection")  # uvicorn closes it: no answer
        if delay and await _wait_or_gone(gone, delay):
            return
        status = int(h.get("x-stub-status", "200"))
        if status != 200:
            req.completed = True
            await _json(
                send,
                status,
                {"error": {"message": f"stub error {status}", "type": "stub", "param": None, "code": None}},
            )
            return
        body = req.body if isinstance(req.body, dict) else {}
        if req.path == "/v1/embeddings":
            req.completed = True
            await _json(
                send,
                200,
                {
                    "object": "list",
                    "data": [{"embedding": [0.0, 1.0], "index": 0}],
                    "usage": {"prompt_tokens": 5, "total_tokens": 5},
                },
            )
            return
        if req.path == "/v1/responses":
            await self._responses(req, body, send, gone)
            return
        if req.path not in ("/v1/chat/completions", "/v1/completions"):
            req.completed = True
            await _json(send, 200, {"echo": req.path, "method": req.method, "body": body})
            return
        n_chunks = int(h.get("x-stub-chunks", str(self.default_chunks)))
        interval = float(h.get("x-stub-interval", str(self.default_interval)))
        chat = req.path == "/v1/chat/completions"
        usage = {"prompt_tokens": 11, "completion_tokens": n_chunks, "total_tokens": 11 + n_chunks}
        if not body.get("stream"):
            if interval and await _wait_or_gone(gone, interval * n_chunks):
                return
            text = "".join(f"tok{i} " for i in range(n_chunks))
            choice = (
                {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "length"}
                if chat
                else {"index": 0, "text": text, "finish_reason": "length"}
            )
            req.completed = True
            answer = {
                "id": "stub-1",
                "object": "chat.completion",
                "model": body.get("model"),
                "choices": [choice],
            }
            if "x-stub-no-usage" not in h:
                answer["usage"] = usage
            await _json(send, 200, answer)
            return
        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
        if "x-stub-no-usage" in h:
            include_usage = False
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [(b"content-type", b"text/event-stream; charset=utf-8"), (b"x-stub-id", b"s1")],
            }
        )
        frames = []
        for i in range(n_chunks):
            delta = {"content": f"tok{i} "} if chat else None
            choice = (
                {"index": 0, "delta": delta, "finish_reason": None}
                if chat
                else {"index": 0, "text": f"tok{i} ", "finish_reason": None}
            )
            frames.append({"id": "stub-1", "object": "chat.completion.chunk", "choices": [choice]})
        frames.append(
            {
                "id": "stub-1",
                "object": "chat.completion.chunk",
                "choices": [{"index": 0, "delta": {}, "finish_reason": "length"}],
            }
        )
        if include_usage:
            # (as engines send it: the model named, which a traced request's span reads)
            frames.append(
                {"id": "stub-1", "object": "chat.completion.chunk", "model": (body or {}).get("model"),
                 "choices": [], "usage": usage}
            )  # fmt: skip
        for frame in frames:
            if gone.is_set():
                return
            data = b"data: " + orjson.dumps(frame) + b"\n\n"
            req.sent += data
            await send({"type": "http.response.body", "body": data, "more_body": True})
            if interval and await _wait_or_gone(gone, interval):
                return
        req.sent += b"data: [DONE]\n\n"
        req.completed = True
        linger = float(h.get("x-stub-linger", "0"))
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": bool(linger)})
        if linger:
            await _wait_or_gone(gone, linger)
            await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def _responses(
        self, req: StubRequest, body: dict[str, Any], send: Send, gone: asyncio.Event
    ) -> None:
        """The OpenAI Responses API's shape: output items, usage as input/output tokens, and as a
        stream typed events ending with ``response.completed`` (which carries the usage)."""
        n = int(req.headers.get("x-stub-chunks", str(self.default_chunks)))
        usage = {"input_tokens": 11, "output_tokens": n, "total_tokens": 11 + n}
        text = "".join(f"tok{i} " for i in range(n))
        response = {
            "id": "resp-1",
            "object": "response",
            "status": "completed",
            "model": body.get("model"),
            "output": [
                {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": text}]}
            ],
            "usage": usage,
        }
        if not body.get("stream"):
            req.completed = True
            await _json(send, 200, response)
            return
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [(b"content-type", b"text/event-stream")],
            }
        )
        events = [
            (
                "response.created",
                {
                    "type": "response.created",
                    "response": {**response, "status": "in_progress", "usage": None},
                },
            )
        ]
        events += [
            ("response.output_text.delta", {"type": "response.output_text.delta", "delta": f"tok{i} "})
            for i in range(n)
        ]
        events.append(("response.completed", {"type": "response.completed", "response": response}))
        for name, data in events:
            if gone.is_set():
                return
            frame = b"event: " + name.encode() + b"\ndata: " + orjson.dumps(data) + b"\n\n"
            req.sent += frame
            await send({"type": "http.response.body", "body": frame, "more_body": True})
        req.completed = True
        await send({"type": "http.response.body", "body": b"", "more_body": False})


async def _wait_or_gone(gone: asyncio.Event, seconds: float) -> bool:
    """Sleep ``seconds``; True if the client disconnected meanwhile."""
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(gone.wait(), timeout=seconds)
    return gone.is_set()


async def _json(send: Send, status: int, obj: Any) -> None:
    data = orjson.dumps(obj)
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())],
        }
    )
    await send({"type": "http.response.body", "body": data, "more_body": False})


@pytest.fixture
def port() -> int:
    return free_port()


@pytest.fixture
async def stub_backend() -> AsyncIterator[tuple[StubBackend, str]]:
    stub = StubBackend()
    served = await serve_asgi(stub)
    try:
        yield stub, served.url
    finally:
        await served.stop()


# ---- a running gateway ----


@dataclass
class RunningGateway:
    url: str
    app: Any  # gateway.app.Gateway
    served: Served
    ops: Served | None = None  # the ops listener (/metrics, /stats, /dashboard, /admin)

    @property
    def ops_url(self) -> str:
        """Where operator routes are: the ops listener, or the API port when ``ops.port`` is null."""
        return self.ops.url if self.ops is not None else self.url

    @property
    def store(self) -> Any:
        return self.app.store

    async def in_flight(self) -> dict[str, int]:
        snap = await self.app.store.snapshot()
        return {name: p.in_flight for name, p in snap.pools.items()}

    async def wait_idle(self, within_s: float = 5.0) -> dict[str, int]:
        """Wait until every pool is back to zero (or time out); returns the last in-flight map, so
        ``assert await gw.wait_idle() == {...: 0}`` shows what is still held when it fails."""

        async def idle() -> bool:
            return not any((await self.in_flight()).values())

        with contextlib.suppress(AssertionError):
            await eventually(idle, timeout_s=within_s, interval_s=0.01)
        return await self.in_flight()


GatewayFactory = Callable[[Mapping[str, Any]], Awaitable[RunningGateway]]


def stub_pools(url: str, capacity: int = 100_000, **backend: Any) -> dict[str, Any]:
    return {"default": {"backends": [{"url": url, "capacity_tokens": capacity, **backend}]}}


@pytest.fixture
async def gateway_factory() -> AsyncIterator[GatewayFactory]:
    """Start gateways from config dicts (parsed by the real loader); stopped at teardown."""
    from gateway.app import build_app
    from gateway.config.loader import parse_config
    from gateway.process.http_server import connection_limits, guarded_protocol

    started: list[Served] = []

    async def start(config: Mapping[str, Any]) -> RunningGateway:
        app = build_app(parse_config(dict(config)), raw=dict(config))
        # The gateway's own protocol and limits, as `tokengate serve` runs it.
        protocol = guarded_protocol(connection_limits(app.config))
        served = await serve_asgi(app, http=protocol)
        started.append(served)
        ops = None
        if app.config.ops.port is not None:  # served on a free port, not the configured one
            ops = await serve_asgi(app.ops_app, http=protocol)
            started.append(ops)
        return RunningGateway(url=served.url, app=app, served=served, ops=ops)

    try:
        yield start
    finally:
        for s in reversed(started):
            await s.stop()


@pytest.fixture
async def gateway(stub_backend: tuple[StubBackend, str], gateway_factory: GatewayFactory) -> RunningGateway:
    """An open-mode gateway (no tenants) in front of the stub backend."""
    _, url = stub_backend
    return await gateway_factory({"pools": stub_pools(url), "drain_timeout_s": 1})

"""A tiny OpenAI-compatible stub server with known delays, for testing the load tester itself.

It streams ``max_tokens`` one-word chunks (fewer with the benchmark field ``tokengate_stop_after``,
as the reference backend does): the first after ``first_token_delay_s``, the rest every
``inter_token_delay_s``, then the usage chunk (when asked) and ``data: [DONE]``. API keys listed in
``fail_keys`` get that HTTP status instead. Prompt tokens are counted as whitespace-separated words,
which is exact for the load tester's own prompt text.
"""

from __future__ import annotations

import asyncio
import socket
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field

import orjson
from aiohttp import web


@dataclass(frozen=True)
class StubConfig:
    first_token_delay_s: float = 0.05
    inter_token_delay_s: float = 0.005
    fail_keys: Mapping[str, int] = field(default_factory=dict)
    headers: Mapping[str, str] = field(default_factory=dict)  # added to every answer (e.g. x-tokengate-*)
    model: str = "tokengate-sim"
    max_output: int = 32768


def _prompt_words(body: Mapping[str, object]) -> int:
    messages = body.get("messages")
    if isinstance(messages, list):
        total = 0
        for m in messages:
            if isinstance(m, dict) and isinstance(m.get("content"), str):
                total += len(m["content"].split())
        return total
    prompt = body.get("prompt")
    return len(prompt.split()) if isinstance(prompt, str) else 0


class StubBackend:
    def __init__(self, config: StubConfig) -> None:
        self.config = config
        self.requests = 0
        self.by_key: Counter[str] = Counter()
        # Per request: (max_tokens, tokengate_stop_after, x-tokengate-oracle-output) as received.
        self.limits: list[tuple[object, object, str | None]] = []
        self._runner: web.AppRunner | None = None
        self.port = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def app(self) -> web.Application:
        # (bodies as large as the gateway's limits.max_body_bytes may allow; aiohttp's default is 1 MiB)
        app = web.Application(client_max_size=256 * 1024 * 1024)
        app.router.add_post("/v1/chat/completions", self._complete)
        app.router.add_post("/v1/completions", self._complete)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/health", self._health)
        return app

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def _models(self, request: web.Request) -> web.Response:
        body = {"object": "list", "data": [{"id": self.config.model, "object": "model"}]}
        return web.Response(body=orjson.dumps(body), content_type="application/json")

    async def _complete(self, request: web.Request) -> web.StreamResponse:
        self.requests += 1
        key = request.headers.get("Authorization", "").removeprefix("Bearer ").strip()
        self.by_key[key] += 1
        status = self.config.fail_keys.get(key)
        headers = dict(self.config.headers)
        if status is not None:
            err = {"error": {"message": "stub failure", "type": "stub", "param": None, "code": status}}
            return web.Response(
                status=status, body=orjson.dumps(err), content_type="application/json", headers=headers
            )
        body = orjson.loads(await request.read())
        requested, stop_after = body.get("max_tokens"), body.get("tokengate_stop_after")
        self.limits.append((requested, stop_after, request.headers.get("x-tokengate-oracle-output")))
        # A real engine refuses what its context cannot hold; the stub just stops at max_output.
        n_out = min(requested if type(requested) is int and requested > 0 else 16, self.config.max_output)
        if type(stop_after) is int and stop_after > 0:
            n_out = min(n_out if type(requested) is int else self.config.max_output, stop_after)
        chat = "messages" in body
        usage = {"prompt_tokens": _prompt_words(body), "completion_tokens": n_out, "total_tokens": 0}
        usage["total_tokens"] = usage["prompt_tokens"] + n_out
        if not body.get("stream"):
            await asyncio.sleep(
                self.config.first_token_delay_s + self.config.inter_token_delay_s * (n_out - 1)
            )
            text = " tok" * n_out
            choice = (
                {"index": 0, "message": {"role": "assistant", "content": text}}
                if chat
                else {"index": 0, "text": text}
            )
            answer = {"id": "stub", "object": "chat.completion", "choices": [choice], "usage": usage}
            return web.Response(body=orjson.dumps(answer), content_type="application/json", headers=headers)
        resp = web.StreamResponse(headers={**headers, "Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await asyncio.sleep(self.config.first_token_delay_s)
        for i in range(n_out):
            if i:
                await asyncio.sleep(self.config.inter_token_delay_s)
            piece = {"index": 0, "delta": {"content": " tok"}} if chat else {"index": 0, "text": " tok"}
            await resp.write(b"data: " + orjson.dumps({"id": "stub", "choices": [piece]}) + b"\n\n")
        if (body.get("stream_options") or {}).get("include_usage"):
            await resp.write(
                b"data: " + orjson.dumps({"id": "stub", "choices": [], "usage": usage}) + b"\n\n"
            )
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    async def start(self, port: int = 0) -> StubBackend:
        self._runner = web.AppRunner(
            self.app(),
            access_log=None,
            handler_cancellation=True,
            shutdown_timeout=1.0,
            # Header lines as long as the gateway forwards (limits.max_header_bytes), as uvicorn-served
            # engines take them; aiohttp's own 8 KB limit refused them with a traceback per request.
            max_line_size=64 * 1024,
            max_field_size=64 * 1024,
        )
        await self._runner.setup()
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", port))
        self.port = sock.getsockname()[1]
        site = web.SockSite(self._runner, sock)
        await site.start()
        return self

    async def close(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None


def main() -> None:
    """``python -m loadtest.stub_backend PORT [FIRST_TOKEN_S] [INTER_TOKEN_S]``: serve until interrupted."""
    import sys

    port = int(sys.argv[1]) if len(sys.argv) > 1 else 8001
    first = float(sys.argv[2]) if len(sys.argv) > 2 else 0.05
    inter = float(sys.argv[3]) if len(sys.argv) > 3 else 0.005

    async def serve() -> None:
        stub = await StubBackend(StubConfig(first, inter)).start(port)
        print(f"stub backend on {stub.url}", flush=True)
        try:
            await asyncio.Event().wait()
        finally:
            await stub.close()

    try:
        asyncio.run(serve())
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()

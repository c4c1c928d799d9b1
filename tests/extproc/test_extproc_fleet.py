"""``tokengate extproc`` as its own process behind a real Envoy: the processor killed (Envoy's failure
mode both ways), and a mixed fleet — one ``tokengate serve`` replica and one ``tokengate extproc``
on one Redis — holding one tenant's budget between them."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import sys
from collections.abc import AsyncIterator, MutableMapping
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest
from redis.asyncio import Redis

from loadtest.envoy import envoy_config
from loadtest.processes import free_port
from tests.budgets.redis_fixtures import RedisServer, unique_prefix
from tests.conftest import StubBackend, serve_asgi
from tests.extproc.support import ROOT, running_envoy, spawn_extproc

pytestmark = pytest.mark.slow


def chat(max_tokens: int = 5) -> bytes:
    return orjson.dumps(
        {"model": "stub-model", "messages": [{"role": "user", "content": "hello"}], "max_tokens": max_tokens}
    )


@contextlib.asynccontextmanager
async def stopping(proc: asyncio.subprocess.Process) -> AsyncIterator[asyncio.subprocess.Process]:
    try:
        yield proc
    finally:
        if proc.returncode is None:
            proc.send_signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(proc.wait(), 15)
            except TimeoutError:
                proc.kill()
                await proc.wait()


async def test_processor_killed_envoy_fails_closed_or_open_as_configured(tmp_path: Path) -> None:
    stub = StubBackend()
    served = await serve_asgi(stub)
    backend = ("127.0.0.1", int(served.url.rsplit(":", 1)[1]))
    grpc_port = free_port()
    config = tmp_path / "tokengate.yaml"
    config.write_text(
        f"listen: {{host: 127.0.0.1, port: {free_port()}}}\nops: {{port: null}}\n"
        f"pools: {{chat: {{backends: [{{url: '{served.url}', capacity_tokens: 10000}}]}}}}\n"
        "tenants: {a: {keys: [sk-a]}}\n"
    )
    try:
        proc = await spawn_extproc(config, tmp_path / "extproc.log", grpc_port)
        async with stopping(proc):
            ports = {"closed": (free_port(), free_port()), "open": (free_port(), free_port())}
            envoys = {
                mode: envoy_config(
                    listen_port=listen,
                    admin_port=admin,
                    processor=("127.0.0.1", grpc_port),
                    pools={"chat": backend},
                    failure_mode_allow=mode == "open",
                )
                for mode, (listen, admin) in ports.items()
            }
            async with (
                running_envoy(envoys["closed"], tmp_path) as closed,
                running_envoy(envoys["open"], tmp_path) as opened,
                aiohttp.ClientSession() as http,
            ):
                auth = {"Authorization": "Bearer sk-a", "Content-Type": "application/json"}
                for envoy in (closed, opened):
                    async with http.post(envoy.url + "/v1/chat/completions", data=chat(), headers=auth) as r:
                        assert r.status == 200
                        assert "x-tokengate-class" in r.headers
                assert [r.headers["x-tokengate-pool"] for r in stub.requests] == ["chat", "chat"]
                proc.send_signal(signal.SIGKILL)
                await proc.wait()
                async with http.post(closed.url + "/v1/chat/completions", data=chat(), headers=auth) as r:
                    assert r.status == 500  # fail closed: nothing unadmitted reaches a backend
                    error = (await r.json())["error"]  # Envoy's own answer, in OpenAI's shape
                    assert (error["type"], error["code"]) == ("server_error", "gateway_unavailable")
                assert len(stub.requests) == 2
                async with http.post(opened.url + "/v1/chat/completions", data=chat(), headers=auth) as r:
                    assert r.status == 200  # fail open: through, unadmitted, on the fallback route
                    assert "x-tokengate-class" not in r.headers
                assert len(stub.requests) == 3
                assert "x-tokengate-pool" not in stub.requests[-1].headers
                # A new processor on the same port: Envoy reconnects and admits again.
                proc = await spawn_extproc(config, tmp_path / "extproc2.log", grpc_port)
                async with stopping(proc):
                    async with http.post(closed.url + "/v1/chat/completions", data=chat(), headers=auth) as r:
                        assert r.status == 200
                        assert r.headers["x-tokengate-class"] == "default"
    finally:
        await served.stop()


class Counting:
    """The stub behind a counter: requests (and their priced tokens) at the backend at once."""

    def __init__(self, stub: StubBackend) -> None:
        self.stub = stub
        self.now = 0
        self.peak = 0

    async def __call__(self, scope: MutableMapping[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["path"] != "/v1/chat/completions":
            await self.stub(scope, receive, send)
            return
        self.now += 1
        self.peak = max(self.peak, self.now)
        try:
            await self.stub(scope, receive, send)
        finally:
            self.now -= 1


async def test_a_proxy_replica_and_a_processor_share_one_tenant_budget(
    tmp_path: Path, fresh_redis: RedisServer
) -> None:
    """Each request costs ~60 tokens, the tenant's budget is 300: whichever front end a request comes
    through, never more than 5 are at the backend at once, and every lease is released."""
    stub = StubBackend()
    counting = Counting(stub)
    served = await serve_asgi(counting)
    prefix = unique_prefix()
    api_port, grpc_port = free_port(), free_port()
    base = (
        f"store: {{kind: redis, url: '{fresh_redis.url}', key_prefix: {prefix}}}\n"
        f"ops: {{port: null}}\n"
        f"pools: {{chat: {{backends: [{{url: '{served.url}', capacity_tokens: 100000}}]}}}}\n"
        "tenants: {a: {keys: [sk-a], budget_tokens: 300}}\n"
    )
    serve_cfg = tmp_path / "serve.yaml"
    serve_cfg.write_text(f"listen: {{host: 127.0.0.1, port: {api_port}}}\n" + base)
    ext_cfg = tmp_path / "extproc.yaml"
    ext_cfg.write_text(f"listen: {{host: 127.0.0.1, port: {free_port()}}}\n" + base)
    serve_proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "gateway.cli", "serve", "--config", str(serve_cfg), "--log-level", "warning",
        cwd=ROOT, stdout=asyncio.subprocess.DEVNULL, stderr=(tmp_path / "serve.log").open("ab"),
    )  # fmt: skip
    try:
        async with stopping(serve_proc):
            ext_proc = await spawn_extproc(ext_cfg, tmp_path / "extproc.log", grpc_port)
            async with stopping(ext_proc):
                envoy_cfg = envoy_config(
                    listen_port=free_port(),
                    admin_port=free_port(),
                    processor=("127.0.0.1", grpc_port),
                    pools={"chat": ("127.0.0.1", int(served.url.rsplit(":", 1)[1]))},
                )
                async with running_envoy(envoy_cfg, tmp_path) as envoy, aiohttp.ClientSession() as http:
                    proxy_url = f"http://127.0.0.1:{api_port}/v1/chat/completions"
                    await _wait_up(http, f"http://127.0.0.1:{api_port}/readyz")
                    headers = {
                        "Authorization": "Bearer sk-a",
                        "Content-Type": "application/json",
                        "x-stub-delay": "0.2",
                    }
                    costs: list[int] = []

                    async def one(url: str) -> int:
                        async with http.post(url, data=chat(50), headers=headers) as r:
                            await r.read()
                            if r.status == 200:
                                costs.append(int(r.headers["x-tokengate-cost"]))
                            return r.status

                    urls = [proxy_url, envoy.url + "/v1/chat/completions"] * 12
                    statuses = await asyncio.gather(*(one(u) for u in urls))
                    assert statuses == [200] * len(urls)
                    cost = max(costs)
                    assert 300 // cost == 5, costs
                    assert counting.peak <= 300 // cost  # one budget across both front ends
                    assert counting.peak >= 2  # (and the budget, not something else, was the limit)
                    await _drained(fresh_redis.url, prefix)
    finally:
        await served.stop()


async def _wait_up(http: aiohttp.ClientSession, url: str) -> None:
    for _ in range(300):
        with contextlib.suppress(aiohttp.ClientError):
            async with http.get(url) as r:
                if r.status == 200:
                    return
        await asyncio.sleep(0.1)
    raise AssertionError(f"{url} never became ready")


async def _drained(url: str, prefix: str) -> None:
    """Every lease released and no pool holding tokens, in the shared store."""
    redis = Redis.from_url(url)
    try:
        for _ in range(100):
            used = await redis.hgetall("{tg:" + prefix + "}:used")  # type: ignore[misc]
            leases = await redis.hlen("{tg:" + prefix + "}:leases")  # type: ignore[misc]
            if not any(int(v) for v in used.values()) and not leases:
                return
            await asyncio.sleep(0.05)
        raise AssertionError(f"not drained: {used}, {leases} leases")
    finally:
        await redis.aclose()

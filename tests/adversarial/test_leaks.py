"""Upstream failures tell the tenant which pool failed and a stable code, never where the backends
are or what exception the gateway's HTTP client raised; the operator's log keeps the details."""

from __future__ import annotations

import logging
from typing import Any

import httpx
import orjson
import pytest

from tests.adversarial.backends import HalfStream
from tests.conftest import GatewayFactory, StubBackend, free_port, serve_asgi, stub_pools

FORBIDDEN = ("127.0.0.1", "localhost", "Errno", "Error:", "aiohttp", "Connector", "Traceback", "http://")


def assert_no_internals(text: str, *extra: str) -> None:
    for needle in (*FORBIDDEN, *extra):
        assert needle not in text, f"{needle!r} leaked to the tenant: {text[:300]}"


def chat(**extra: Any) -> dict[str, Any]:
    return {"model": "stub-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **extra}


async def test_an_unreachable_backend_is_named_by_its_pool_only(
    gateway_factory: GatewayFactory, caplog: pytest.LogCaptureFixture
) -> None:
    dead = free_port()
    gw = await gateway_factory(
        {
            "pools": {
                "short": {
                    "backends": [
                        {
                            "url": f"http://127.0.0.1:{dead}",
                            "capacity_tokens": 10_000,
                            "models": ["stub-model"],
                        }
                    ]
                }
            }
        }
    )
    caplog.set_level(logging.WARNING, logger="tokengate.proxy")
    async with httpx.AsyncClient(base_url=gw.url) as c:
        for stream in (False, True):
            r = await c.post("/v1/chat/completions", json=chat(stream=stream))
            assert r.status_code == 502
            err = r.json()["error"]
            assert err["code"] == "upstream_unreachable" and "'short'" in err["message"]
            assert_no_internals(r.text, str(dead))
    assert str(dead) in caplog.text  # the operator still learns which backend it was
    assert await gw.wait_idle() == {name: 0 for name in await gw.in_flight()}


async def test_a_backend_500_body_is_not_relayed(
    stub_backend: tuple[StubBackend, str], gateway_factory: GatewayFactory
) -> None:
    _, url = stub_backend
    gw = await gateway_factory({"pools": stub_pools(url)})
    async with httpx.AsyncClient(base_url=gw.url) as c:
        r = await c.post("/v1/chat/completions", json=chat(), headers={"x-stub-status": "500"})
    assert r.status_code == 502
    assert r.json()["error"]["code"] == "upstream_error"
    assert "stub error" not in r.text
    assert_no_internals(r.text, url.rsplit(":", 1)[1])


async def test_a_read_timeout_does_not_name_the_backend(
    stub_backend: tuple[StubBackend, str], gateway_factory: GatewayFactory
) -> None:
    _, url = stub_backend
    gw = await gateway_factory({"pools": stub_pools(url, timeouts={"connect_s": 1, "read_s": 0.2})})
    async with httpx.AsyncClient(base_url=gw.url) as c:
        r = await c.post("/v1/chat/completions", json=chat(), headers={"x-stub-delay": "1"})
    assert r.status_code == 504 and r.json()["error"]["code"] == "upstream_timeout"
    assert_no_internals(r.text, url.rsplit(":", 1)[1])
    assert await gw.wait_idle() == {name: 0 for name in await gw.in_flight()}


async def test_a_stream_cut_mid_way_ends_with_a_clean_error_event(gateway_factory: GatewayFactory) -> None:
    served = await serve_asgi(HalfStream())
    try:
        gw = await gateway_factory({"pools": stub_pools(served.url)})
        async with httpx.AsyncClient(base_url=gw.url) as c:
            r = await c.post("/v1/chat/completions", json=chat(stream=True))
        assert r.status_code == 200  # the headers were out before the backend failed
        last = [line for line in r.text.splitlines() if line.startswith("data: ")][-1]
        err = orjson.loads(last[6:])["error"]
        assert err["code"] == "upstream_error" and "pool 'default'" in err["message"]
        assert_no_internals(r.text, served.url.rsplit(":", 1)[1], "secret", "ClientPayloadError")
        assert await gw.wait_idle() == {name: 0 for name in await gw.in_flight()}
    finally:
        await served.stop()

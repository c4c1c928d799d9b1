"""Live reconfiguration (reload, admin API): the new config applies while requests flow, running
requests are never failed by it, and the books still return to zero."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from gateway.config.fields import ConfigError
from gateway.config.loader import parse_config
from tests.conftest import GatewayFactory, RunningGateway, StubBackend, serve_asgi, stub_pools
from tests.gateway.gw_support import chat


def config(url: str, *, budget: int = 3000, capacity: int = 100_000, **extra: Any) -> dict[str, Any]:
    return {
        "pools": stub_pools(url, capacity=capacity),
        "tenants": {"t": {"keys": ["k"], "budget_tokens": budget}, "u": {"keys": ["ku"]}},
        "drain_timeout_s": 1,
        **extra,
    }


async def post(
    c: httpx.AsyncClient, delay: float = 0.0, max_tokens: int = 990, key: str = "k"
) -> httpx.Response:
    headers = {"authorization": f"Bearer {key}", "x-stub-delay": str(delay)}
    return await c.post("/v1/chat/completions", json=chat(max_tokens=max_tokens), headers=headers)


async def pool_state(gw: RunningGateway, pool: str) -> tuple[int, int]:
    p = (await gw.store.snapshot()).pools[pool]
    return p.in_flight, p.capacity


async def wait_in_flight(gw: RunningGateway, pool: str, at_least: int) -> None:
    deadline = time.monotonic() + 5
    while (await pool_state(gw, pool))[0] < at_least:
        assert time.monotonic() < deadline, "requests never got in flight"
        await asyncio.sleep(0.01)


async def test_lowering_a_budget_below_what_is_in_flight_lets_running_requests_finish_and_new_ones_wait(
    stub_backend: tuple[StubBackend, str], gateway_factory: GatewayFactory
) -> None:
    _, url = stub_backend
    gw = await gateway_factory(config(url, budget=3000))
    async with httpx.AsyncClient(base_url=gw.url, timeout=30) as c:
        running = [asyncio.create_task(post(c, delay=0.6)) for _ in range(2)]
        await wait_in_flight(gw, "tenant:t", 1900)
        await gw.app.apply(parse_config(config(url, budget=1000)))
        assert await pool_state(gw, "tenant:t") == (1996, 1000)  # over the new budget, nobody failed
        t0 = time.monotonic()
        late = await post(c)  # waits until the running ones are gone
        assert late.status_code == 200
        assert [r.result().status_code for r in running] == [200, 200]
        assert float(late.headers["x-tokengate-queue-ms"]) > 200
        assert time.monotonic() - t0 > 0.2
    assert await gw.wait_idle() == {"tenant:t": 0, "tenant:u": 0, "backend:default": 0}


async def test_raising_a_budget_or_a_pool_capacity_wakes_waiting_requests_at_once(
    stub_backend: tuple[StubBackend, str], gateway_factory: GatewayFactory
) -> None:
    _, url = stub_backend
    gw = await gateway_factory(config(url, budget=1000, capacity=1200))
    async with httpx.AsyncClient(base_url=gw.url, timeout=30) as c:
        holder = asyncio.create_task(post(c, delay=3.0))
        await wait_in_flight(gw, "tenant:t", 900)
        waiter = asyncio.create_task(post(c))
        await asyncio.sleep(0.2)  # it is queued behind the holder
        assert not waiter.done()
        t0 = time.monotonic()
        await gw.app.apply(parse_config(config(url, budget=2000, capacity=1200)))  # budget fits, pool not
        await asyncio.sleep(0.2)
        assert not waiter.done()
        await gw.app.apply(parse_config(config(url, budget=2000, capacity=4000)))
        r = await asyncio.wait_for(waiter, 2.0)
        assert r.status_code == 200 and time.monotonic() - t0 < 2.0  # long before the holder ends
        assert not holder.done()
        assert (await holder).status_code == 200
    assert await gw.wait_idle() == {"tenant:t": 0, "tenant:u": 0, "backend:default": 0}


async def test_deleting_a_tenant_refuses_its_new_requests_at_once_and_lets_running_ones_finish(
    stub_backend: tuple[StubBackend, str], gateway_factory: GatewayFactory
) -> None:
    _, url = stub_backend
    gw = await gateway_factory(config(url))
    async with httpx.AsyncClient(base_url=gw.url, timeout=30) as c:
        running = asyncio.create_task(post(c, delay=0.5))
        await wait_in_flight(gw, "tenant:t", 900)
        gone = config(url)
        del gone["tenants"]["t"]
        await gw.app.apply(parse_config(gone))
        refused = await post(c)
        assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_api_key"
        assert (await post(c, max_tokens=5, key="ku")).status_code == 200  # others are untouched
        assert (await running).status_code == 200
    assert await gw.wait_idle() == {"tenant:u": 0, "backend:default": 0}


async def test_backends_are_added_drained_and_removed_while_requests_run(
    stub_backend: tuple[StubBackend, str], gateway_factory: GatewayFactory
) -> None:
    first, url_a = stub_backend
    second = StubBackend()
    served = await serve_asgi(second)
    url_b = served.url
    try:
        gw = await gateway_factory(config(url_a))
        both = config(url_a)
        both["pools"]["default"]["backends"] = [
            {"url": url_a, "capacity_tokens": 100_000, "draining": True},
            {"url": url_b, "capacity_tokens": 100_000},
        ]
        async with httpx.AsyncClient(base_url=gw.url, timeout=30) as c:
            on_a = asyncio.create_task(post(c, delay=0.5))
            await wait_in_flight(gw, "tenant:t", 900)
            await gw.app.apply(parse_config(both))
            for _ in range(3):
                assert (await post(c, max_tokens=5)).status_code == 200
            assert len(first.requests) == 1 and len(second.requests) == 3  # the drained one gets nothing new
            await gw.app.apply(parse_config(config(url_b)))  # A removed with its request still running
            assert (await on_a).status_code == 200
            assert (await post(c, max_tokens=5)).status_code == 200
            assert len(second.requests) == 4
        assert [b.spec.url for b in gw.app.router.backends] == [url_b]
        assert await gw.wait_idle() == {"tenant:t": 0, "tenant:u": 0, "backend:default": 0}
    finally:
        await served.stop()


def write(path: Path, data: dict[str, Any]) -> None:
    path.write_text(yaml.safe_dump(data))


async def test_reload_applies_a_good_file_and_keeps_the_old_config_on_a_bad_one(
    stub_backend: tuple[StubBackend, str], gateway_factory: GatewayFactory, tmp_path: Path
) -> None:
    _, url = stub_backend
    path = tmp_path / "tokengate.yaml"
    write(path, config(url, budget=3000))
    gw = await gateway_factory(config(url, budget=3000))
    gw.app.config_path = str(path)
    write(path, config(url, budget=5000, limits={"max_body_bytes": 1000}))
    assert await gw.app.reload() == ["limits"]  # needs a restart; everything else applied
    assert (await pool_state(gw, "tenant:t"))[1] == 5000
    path.write_text("tenants: {t: {budget_tokens: -1}}\n")
    with pytest.raises(ConfigError, match="budget_tokens"):
        await gw.app.reload()
    path.write_text("pools: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        await gw.app.reload()
    assert (await pool_state(gw, "tenant:t"))[1] == 5000  # the old config still runs
    async with httpx.AsyncClient(base_url=gw.url) as c:
        assert (await post(c, max_tokens=5)).status_code == 200


async def test_a_change_to_any_section_that_shapes_the_process_is_named_as_needing_a_restart(
    stub_backend: tuple[StubBackend, str], gateway_factory: GatewayFactory
) -> None:
    _, url = stub_backend
    gw = await gateway_factory(config(url, budget=3000))
    changed = {
        **config(url, budget=4000),
        "ops": {"port": None},
        "gc": {"threshold0": 700},
        "leases": {"ttl_s": 30},
        "metrics": {"top_tenants": 3},
    }
    # Applied at start only: a reload that said nothing would leave the operator believing it ran.
    assert sorted(await gw.app.apply(parse_config(changed))) == ["gc", "leases", "metrics", "ops"]
    before = parse_config(config(url))
    assert (gw.app.config.gc, gw.app.config.ops) == (before.gc, before.ops)  # running values kept
    assert (await pool_state(gw, "tenant:t"))[1] == 4000  # the rest applied


async def test_reloading_under_load_fails_no_request(
    stub_backend: tuple[StubBackend, str], gateway_factory: GatewayFactory
) -> None:
    first, url_a = stub_backend
    second = StubBackend()
    served = await serve_asgi(second)
    try:
        gw = await gateway_factory(config(url_a, budget=20_000))
        variants = []
        for i in range(6):
            v = config(url_a, budget=20_000 + 1000 * i, capacity=100_000 + 1000 * i)
            backends = [{"url": url_a, "capacity_tokens": 100_000}]
            if i % 2:
                backends = [{"url": url_a, "capacity_tokens": 100_000, "draining": True},
                            {"url": served.url, "capacity_tokens": 100_000}]  # fmt: skip
            v["pools"]["default"]["backends"] = backends
            variants.append(v)
        statuses: list[int] = []
        stop = asyncio.Event()

        async def client() -> None:
            async with httpx.AsyncClient(base_url=gw.url, timeout=30) as c:
                while not stop.is_set():
                    r = await post(c, delay=0.05, max_tokens=200)
                    statuses.append(r.status_code)

        clients = [asyncio.create_task(client()) for _ in range(12)]
        for v in variants:
            await asyncio.sleep(0.25)
            await gw.app.apply(parse_config(v))
        await asyncio.sleep(0.25)
        stop.set()
        await asyncio.gather(*clients)
        assert len(statuses) > 50 and set(statuses) == {200}
        assert len(first.requests) > 0 and len(second.requests) > 0
        assert await gw.wait_idle() == {"tenant:t": 0, "tenant:u": 0, "backend:default": 0}
    finally:
        await served.stop()

"""Ops surface: /metrics, /healthz, /readyz, the access log, lease heartbeats, health probes."""

from __future__ import annotations

import asyncio
import logging

import httpx
import orjson
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import GatewayFactory, RunningGateway, StubBackend, serve_asgi, stub_pools
from tests.gateway.gw_support import RawRequest, chat
from tests.support import eventually


def samples(text: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out.setdefault(s.name, []).append((s.labels, s.value))
    return out


async def test_metrics_labels_and_state(
    stub_backend: tuple[StubBackend, str], gateway_factory: GatewayFactory
) -> None:
    _, url = stub_backend
    tenants = {name: {"keys": [f"k-{name}"], "budget_tokens": 50_000} for name in ("a", "b", "c")}
    gw = await gateway_factory({"pools": stub_pools(url), "tenants": tenants, "metrics": {"top_tenants": 2}})
    async with httpx.AsyncClient(base_url=gw.url) as c:
        for name in ("a", "b", "c"):
            r = await c.post(
                "/v1/chat/completions", json=chat(max_tokens=3), headers={"authorization": f"Bearer k-{name}"}
            )
            assert r.status_code == 200
        await c.post(
            "/v1/chat/completions",
            json=chat(stream=True, max_tokens=3),
            headers={"authorization": "Bearer k-a"},
        )
        await c.post("/v1/chat/completions", json=chat(), headers={"authorization": "Bearer nope"})
        r = await c.get(gw.ops_url + "/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    m = samples(r.text)
    requests = {(s["tenant"], s["outcome"]): v for s, v in m["tokengate_requests_total"] if v}
    assert requests[("a", "ok")] == 2 and requests[("b", "ok")] == 1
    assert requests[("other", "ok")] == 1  # c is beyond top_tenants=2
    assert requests[("other", "rejected")] == 1  # the unknown key
    assert {s["tier"] for s, v in m["tokengate_requests_total"] if v} >= {"standard"}
    ttft = [v for s, v in m["tokengate_ttft_seconds_count"] if s["class"] == "default"]
    assert ttft == [1.0]  # streaming requests only
    e2e = [v for s, v in m["tokengate_request_duration_seconds_count"] if s["class"] == "default"]
    assert e2e == [4.0]  # the 401 has no class yet: "unclassified"
    caps = {(s["pool"], s["kind"]): v for s, v in m["tokengate_pool_capacity_tokens"]}
    assert caps[("default", "backend")] == 100_000 and caps[("a", "tenant")] == 50_000
    assert {s["tier"] for s, _ in m["tokengate_queue_depth"]} == {"critical", "standard", "batch"}
    assert all(v == 0 for _, v in m["tokengate_pool_in_flight_tokens"])
    ratio = [s for s, v in m["tokengate_token_estimate_ratio_count"] if v]
    assert {s["kind"] for s in ratio} == {"prompt", "output"}
    assert [v for _, v in m["tokengate_backend_healthy"]] == [1.0]


async def test_healthz_readyz(gateway: RunningGateway) -> None:
    async with httpx.AsyncClient(base_url=gateway.url) as c:
        assert (await c.get("/healthz")).json() == {"status": "ok"}
        assert (await c.get("/readyz")).json() == {"status": "ready"}


async def test_access_log_line(gateway: RunningGateway, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="tokengate.access")
    async with httpx.AsyncClient(base_url=gateway.url) as c:
        await c.post(
            "/v1/chat/completions",
            json=chat(stream=True, max_tokens=3),
            headers={"authorization": "Bearer secret-key"},
        )
    lines = [orjson.loads(r.getMessage()) for r in caplog.records if r.name == "tokengate.access"]
    assert len(lines) == 1
    line = lines[0]
    assert line["status"] == 200 and line["tenant"] == "default" and line["class"] == "default"
    assert line["tier"] == "standard" and line["cost"] == line["prefill"] + line["decode"]
    for key in ("queue_ms", "ttft_ms", "backend_ms", "total_ms"):
        assert isinstance(line[key], float)
    assert line["completion_tokens"] == 3
    assert "secret-key" not in caplog.text


async def test_heartbeat_keeps_long_requests_alive(
    stub_backend: tuple[StubBackend, str], gateway_factory: GatewayFactory
) -> None:
    _, url = stub_backend
    gw = await gateway_factory({"pools": stub_pools(url), "leases": {"ttl_s": 0.3}})
    req = await RawRequest.post(
        gw.url, "/v1/chat/completions", chat(stream=True), {"x-stub-chunks": "100", "x-stub-interval": "0.01"}
    )
    assert (await req.read_head())[0] == 200
    await asyncio.sleep(0.8)  # well past the TTL: only heartbeats keep the lease
    await gw.store.reap_expired()
    snap = await gw.store.snapshot()
    assert snap.leases == 1 and snap.pools["backend:default"].in_flight > 0
    await req.close()
    assert await gw.wait_idle() == {"tenant:default": 0, "backend:default": 0}


async def test_active_probe_closes_the_breaker(gateway_factory: GatewayFactory) -> None:
    stub = StubBackend()
    first = await serve_asgi(stub)
    port = int(first.url.rsplit(":", 1)[1])
    gw = await gateway_factory(
        {
            "pools": stub_pools(first.url, models=["stub-model"]),
            "health": {
                "failure_threshold": 1,
                "cooldown_s": 0.1,
                "unhealthy_interval_s": 0.05,
                "interval_s": 0.05,
            },
        }
    )
    await first.stop()
    async with httpx.AsyncClient(base_url=gw.url) as c:
        assert (await c.post("/v1/chat/completions", json=chat())).status_code in (502, 503)
        backend = next(iter(gw.app.router.backends))
        await eventually(lambda: not backend.healthy)
        second = await serve_asgi(stub, port=port)
        try:
            await eventually(lambda: backend.healthy)
            assert (await c.post("/v1/chat/completions", json=chat(max_tokens=1))).status_code == 200
        finally:
            await second.stop()


async def test_request_hooks_see_every_finished_request(gateway: RunningGateway) -> None:
    seen: list[tuple[str, int, str]] = []
    gateway.app.request_hooks.append(lambda rec, end: seen.append((rec.klass, rec.status, rec.outcome)))
    gateway.app.request_hooks.append(lambda rec, end: 1 / 0)  # a broken hook changes nothing
    async with httpx.AsyncClient(base_url=gateway.url) as c:
        assert (await c.post("/v1/chat/completions", json=chat(max_tokens=2))).status_code == 200
        assert (await c.post("/v1/chat/completions", json={"model": "stub-model"})).status_code == 400
    assert seen == [("default", 200, "ok"), ("unclassified", 400, "rejected")]


async def test_ops_route_errors_keep_the_openai_shape(gateway: RunningGateway) -> None:
    async def broken() -> None:
        raise RuntimeError("store exploded")

    gateway.app.store.snapshot = broken  # /metrics reads a snapshot first
    async with httpx.AsyncClient(base_url=gateway.ops_url) as c:
        r = await c.get("/metrics")
    assert r.status_code == 500
    assert r.json()["error"]["code"] == "internal_error"


async def test_readyz_is_not_ready_while_no_backend_has_ever_answered(
    gateway_factory: GatewayFactory,
) -> None:
    from tests.conftest import free_port

    dead = f"http://127.0.0.1:{free_port()}"
    gw = await gateway_factory({"pools": stub_pools(dead, models=["stub-model"])})
    async with httpx.AsyncClient(base_url=gw.url) as c:
        r = await c.get("/readyz")
    assert r.status_code == 503
    assert r.json()["problems"] == ["no healthy backend (1 configured: 0 down, 1 never answered)"]
    assert dead not in r.text  # backend addresses are operator data


async def test_readyz_turns_ready_when_a_backend_first_answers(gateway_factory: GatewayFactory) -> None:
    stub = StubBackend(health_status=500)  # up, but its health probe fails: unknown at start-up
    served = await serve_asgi(stub)
    try:
        gw = await gateway_factory({"pools": stub_pools(served.url, models=["stub-model"])})
        async with httpx.AsyncClient(base_url=gw.url) as c:
            assert (await c.get("/readyz")).status_code == 503
            backend = next(iter(gw.app.router.backends))
            assert backend.state == "unknown"
            assert (await c.post("/v1/chat/completions", json=chat(max_tokens=1))).status_code == 200
            assert backend.state == "up"  # an answered request is an answer too
            assert (await c.get("/readyz")).json() == {"status": "ready"}
    finally:
        await served.stop()

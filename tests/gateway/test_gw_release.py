"""Release exactly once on every path: pools return to zero (read from store.snapshot())."""

from __future__ import annotations

import asyncio
import random
import time

import httpx
import orjson
import pytest

from tests.conftest import GatewayFactory, RunningGateway, StubBackend, free_port, serve_asgi, stub_pools
from tests.gateway.gw_support import ZERO, RawRequest, chat, dead_then_live
from tests.support import eventually


async def tenant_waiting(gw: RunningGateway, tenant: str, n: int) -> bool:
    return (await gw.store.snapshot()).tenant_queue_depth.get(tenant, 0) == n


async def tier_waiting(gw: RunningGateway, tier: str, n: int) -> bool:
    return (await gw.store.snapshot()).queue_depth.get(tier, 0) == n


async def holds_tokens(gw: RunningGateway, pool: str) -> bool:
    return (await gw.in_flight()).get(pool, 0) > 0


async def _outcomes(gw: RunningGateway) -> str:
    async with httpx.AsyncClient(base_url=gw.ops_url) as c:
        return (await c.get("/metrics")).text


async def test_disconnect_mid_stream_cancels_upstream_fast(
    gateway: RunningGateway, stub_backend: tuple[StubBackend, str]
) -> None:
    stub, _ = stub_backend
    req = await RawRequest.post(
        gateway.url,
        "/v1/chat/completions",
        chat(stream=True),
        {"x-stub-chunks": "500", "x-stub-interval": "0.01", "x-t": "mid"},
    )
    status, _ = await req.read_head()
    assert status == 200
    assert await req.read_some(64)
    assert any((await gateway.in_flight()).values())  # tokens are held while streaming
    closed_at = time.monotonic()
    await req.close()
    upstream = stub.by_header("x-t", "mid")
    await eventually(lambda: upstream.cancelled_at is not None)
    assert upstream.cancelled_at is not None and upstream.cancelled_at - closed_at < 0.1
    assert not upstream.completed
    assert await gateway.wait_idle() == ZERO
    assert 'outcome="client_disconnect"' in await _outcomes(gateway)


async def hang_up_while_waiting_cancels_upstream_fast(url: str, stub: StubBackend, tag: str) -> None:
    """A non-streaming request the backend takes 5 s to answer; the client hangs up once it is there."""
    req = await RawRequest.post(url, "/v1/chat/completions", chat(), {"x-stub-delay": "5", "x-t": tag})
    await eventually(lambda: any(r.headers.get("x-t") == tag for r in stub.requests))
    closed_at = time.monotonic()
    await req.close()
    upstream = stub.by_header("x-t", tag)
    await eventually(lambda: upstream.cancelled_at is not None)
    assert upstream.cancelled_at is not None and upstream.cancelled_at - closed_at < 0.1


async def test_disconnect_while_waiting_for_non_streaming_answer(
    gateway: RunningGateway, stub_backend: tuple[StubBackend, str]
) -> None:
    await hang_up_while_waiting_cancels_upstream_fast(gateway.url, stub_backend[0], "wait")
    assert await gateway.wait_idle() == ZERO


async def test_disconnect_while_queued_withdraws_the_ticket(
    stub_backend: tuple[StubBackend, str], gateway_factory: GatewayFactory
) -> None:
    stub, url = stub_backend
    gw = await gateway_factory(
        {
            "pools": stub_pools(url),
            "tenants": {"t": {"keys": ["k"], "budget_tokens": 1200, "default_max_tokens": 1000}},
        }
    )
    auth = {"authorization": "Bearer k"}
    holder = await RawRequest.post(
        gw.url,
        "/v1/chat/completions",
        chat(stream=True),
        {**auth, "x-stub-chunks": "1000", "x-stub-interval": "0.01"},
    )
    assert (await holder.read_head())[0] == 200
    queued = await RawRequest.post(gw.url, "/v1/chat/completions", chat(), {**auth, "x-t": "queued"})
    await eventually(lambda: tenant_waiting(gw, "t", 1))
    snap = await gw.store.snapshot()
    assert snap.queue_depth["standard"] == 1
    await queued.close()
    await eventually(lambda: tier_waiting(gw, "standard", 0))
    assert not any(r.headers.get("x-t") == "queued" for r in stub.requests)  # never reached the backend
    await holder.close()
    assert await gw.wait_idle() == {"tenant:t": 0, "backend:default": 0}


async def test_a_hang_up_with_a_pipelined_request_behind_cancels_the_one_running(
    gateway: RunningGateway, stub_backend: tuple[StubBackend, str]
) -> None:
    # uvicorn tells only its newest request (the pipelined one, not started) that the client is
    # gone; the gateway's protocol tells every request it has parsed and not answered.
    stub, _ = stub_backend
    host, port = gateway.url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    for tag, delay in (("first", "5"), ("second", "0")):
        body = orjson.dumps(chat())
        writer.write(
            (
                f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(body)}\r\nx-stub-delay: {delay}\r\nx-t: {tag}\r\n\r\n"
            ).encode()
            + body
        )
    await writer.drain()
    await eventually(lambda: any(r.headers.get("x-t") == "first" for r in stub.requests))
    assert await holds_tokens(gateway, "backend:default")
    closed_at = time.monotonic()
    writer.close()
    await writer.wait_closed()
    upstream = stub.by_header("x-t", "first")
    await eventually(lambda: upstream.cancelled_at is not None)
    assert upstream.cancelled_at is not None and upstream.cancelled_at - closed_at < 0.1
    assert await gateway.wait_idle() == ZERO
    assert not any(r.headers.get("x-t") == "second" for r in stub.requests)
    del reader


async def test_a_hang_up_cancels_the_request_under_a_plain_asgi_server_too(
    stub_backend: tuple[StubBackend, str],
) -> None:
    # Without the gateway's protocol there are no request signals: a task per request watches
    # receive() for the disconnect instead.
    from gateway.app import build_app
    from gateway.config.loader import parse_config

    stub, url = stub_backend
    app = build_app(parse_config({"pools": stub_pools(url)}))
    served = await serve_asgi(app, http="httptools")
    try:
        await hang_up_while_waiting_cancels_upstream_fast(served.url, stub, "plain")

        async def idle() -> bool:
            snap = await app.store.snapshot()
            return not any(p.in_flight for p in snap.pools.values())

        await eventually(idle)
    finally:
        await served.stop()


async def test_upstream_5xx_is_502_and_released(gateway: RunningGateway) -> None:
    async with httpx.AsyncClient(base_url=gateway.url) as c:
        r = await c.post("/v1/chat/completions", json=chat(), headers={"x-stub-status": "503"})
        assert r.status_code == 502
        err = r.json()["error"]
        # The pool and the status, not the backend's own text (it may name internals).
        assert err["type"] == "upstream_error" and "HTTP 503" in err["message"]
        assert "pool 'default'" in err["message"] and "stub error" not in err["message"]
        r = await c.post("/v1/chat/completions", json=chat(stream=True), headers={"x-stub-status": "500"})
        assert r.status_code == 502
    assert await gateway.wait_idle() == ZERO


async def test_connect_refused_is_502_and_opens_breaker(gateway_factory: GatewayFactory) -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    gw = await gateway_factory(
        {
            "pools": stub_pools(dead, models=["stub-model"]),
            "health": {"failure_threshold": 2, "cooldown_s": 60},
        }
    )
    async with httpx.AsyncClient(base_url=gw.url) as c:
        for _ in range(2):
            r = await c.post("/v1/chat/completions", json=chat())
            assert r.status_code == 502 and r.json()["error"]["code"] == "upstream_unreachable"
        r = await c.post("/v1/chat/completions", json=chat())
        assert r.status_code == 503 and r.json()["error"]["code"] == "no_healthy_backend"
        assert "retry-after" in r.headers
        ready = await c.get("/readyz")
        assert ready.status_code == 503 and "no healthy backend" in ready.text
    assert await gw.wait_idle() == ZERO


async def test_connect_failure_retries_the_pools_next_backend(
    stub_backend: tuple[StubBackend, str], gateway_factory: GatewayFactory
) -> None:
    stub, url = stub_backend
    gw = await gateway_factory(
        {
            "pools": dead_then_live(url),  # the dead backend is picked first
            "health": {"failure_threshold": 2, "cooldown_s": 60},
        }
    )
    async with httpx.AsyncClient(base_url=gw.url) as c:
        for stream in (False, True, False):
            r = await c.post("/v1/chat/completions", json=chat(stream=stream))
            assert r.status_code == 200, r.text
    # The request never reached the dead backend, so it went to the live one; after two connect
    # failures the breaker keeps the dead one out of the rotation.
    assert len(stub.requests) == 3
    dead_backend, live_backend = gw.app.router.pools["default"].backends
    assert not dead_backend.healthy and live_backend.healthy
    # A retried request was re-serialized from the client's own body: usage was asked for upstream
    # only on the stream, and the client's body was not changed for the next attempt.
    assert [r.body.get("stream_options") for r in stub.requests] == [None, {"include_usage": True}, None]
    assert await gw.wait_idle() == ZERO
    assert all(b.in_flight_tokens == 0 and b.in_flight_requests == 0 for b in gw.app.router.backends)


async def test_upstream_timeout_is_504_released_and_cancelled(
    stub_backend: tuple[StubBackend, str], gateway_factory: GatewayFactory
) -> None:
    stub, url = stub_backend
    gw = await gateway_factory({"pools": stub_pools(url, timeouts={"read_s": 0.2})})
    async with httpx.AsyncClient(base_url=gw.url) as c:
        r = await c.post("/v1/chat/completions", json=chat(), headers={"x-stub-delay": "3", "x-t": "slow"})
        assert r.status_code == 504 and r.json()["error"]["type"] == "timeout_error"
        # A stream that stalls half way ends with an SSE error event.
        r = await c.post(
            "/v1/chat/completions",
            json=chat(stream=True),
            headers={"x-stub-chunks": "3", "x-stub-interval": "0.05", "x-stub-delay": "0"},
        )
        assert r.status_code == 200 and r.text.endswith("data: [DONE]\n\n")
        r = await c.post(
            "/v1/chat/completions",
            json=chat(stream=True),
            headers={"x-stub-chunks": "3", "x-stub-interval": "1"},
        )
        assert r.status_code == 200 and '"type":"timeout_error"' in r.text
    upstream = stub.by_header("x-t", "slow")
    await eventually(lambda: upstream.cancelled_at is not None)
    assert await gw.wait_idle() == ZERO


@pytest.mark.slow  # 200 concurrent requests
async def test_pools_back_to_zero_after_concurrent_load(
    stub_backend: tuple[StubBackend, str], gateway_factory: GatewayFactory
) -> None:
    _, url = stub_backend
    tenants = {
        name: {
            "keys": [f"k-{name}"],
            "budget_tokens": 600,
            "default_max_tokens": 100,
            "tier": tier,
            "max_queue_len": 200,
        }
        for name, tier in (("a", "critical"), ("b", "standard"), ("c", "batch"))
    }
    gw = await gateway_factory({"pools": stub_pools(url, capacity=1000), "tenants": tenants})
    rng = random.Random(7)
    statuses: list[int] = []
    limits = httpx.Limits(max_connections=200)

    async def one(c: httpx.AsyncClient, i: int) -> None:
        tenant = "abc"[i % 3]
        headers = {
            "authorization": f"Bearer k-{tenant}",
            "x-stub-interval": str(rng.choice([0, 0.002, 0.005])),
        }
        if i % 2:
            async with c.stream("POST", "/v1/chat/completions", json=chat(stream=True), headers=headers) as r:
                async for _ in r.aiter_raw():
                    pass
                statuses.append(r.status_code)
        else:
            r = await c.post("/v1/chat/completions", json=chat(), headers=headers)
            statuses.append(r.status_code)

    async with httpx.AsyncClient(base_url=gw.url, limits=limits, timeout=60) as c:
        await asyncio.gather(*(one(c, i) for i in range(200)))
    assert statuses.count(200) == 200
    snap = await gw.store.snapshot()
    assert all(p.in_flight == 0 for p in snap.pools.values()), snap.pools
    assert snap.leases == 0 and sum(snap.queue_depth.values()) == 0
    assert all(b.in_flight_tokens == 0 for b in gw.app.router.backends)


AUTH_K = {"authorization": "Bearer k"}


async def _full_budget(
    url: str, gateway_factory: GatewayFactory, *, max_queue_wait_s: float, max_queue_len: int
) -> tuple[RunningGateway, RawRequest]:
    """A gateway whose only tenant's budget is held by one slow stream: the next request queues."""
    gw = await gateway_factory(
        {
            "pools": stub_pools(url),
            "tiers": {"standard": {"rank": 0, "max_queue_wait_s": max_queue_wait_s}},
            "tenants": {
                "t": {
                    "keys": ["k"],
                    "budget_tokens": 1200,
                    "default_max_tokens": 1000,
                    "max_queue_len": max_queue_len,
                }
            },
        }
    )
    holder = await RawRequest.post(
        gw.url,
        "/v1/chat/completions",
        chat(stream=True),
        {**AUTH_K, "x-stub-chunks": "1000", "x-stub-interval": "0.01"},
    )
    assert (await holder.read_head())[0] == 200
    return gw, holder


async def test_queue_timeout_is_429_with_retry_after(
    stub_backend: tuple[StubBackend, str], gateway_factory: GatewayFactory
) -> None:
    gw, holder = await _full_budget(stub_backend[1], gateway_factory, max_queue_wait_s=0.2, max_queue_len=1)
    async with httpx.AsyncClient(base_url=gw.url, headers=AUTH_K) as c:
        r = await c.post("/v1/chat/completions", json=chat())
    assert r.status_code == 429
    assert r.json()["error"]["code"] == "queue_timeout"
    assert int(r.headers["retry-after"]) >= 1
    await holder.close()
    assert await gw.wait_idle() == {"tenant:t": 0, "backend:default": 0}


async def test_client_may_shorten_the_queue_wait_with_a_header(
    stub_backend: tuple[StubBackend, str], gateway_factory: GatewayFactory
) -> None:
    gw, holder = await _full_budget(stub_backend[1], gateway_factory, max_queue_wait_s=30, max_queue_len=4)
    async with httpx.AsyncClient(base_url=gw.url, headers=AUTH_K, timeout=10) as c:
        t0 = asyncio.get_running_loop().time()
        r = await c.post("/v1/chat/completions", json=chat(), headers={"x-tokengate-max-queue-wait": "0.2"})
        waited = asyncio.get_running_loop().time() - t0
        assert r.status_code == 429 and r.json()["error"]["code"] == "queue_timeout"
        assert waited < 5  # the tier would have let it wait 30 s
        bad = await c.post(
            "/v1/chat/completions", json=chat(), headers={"x-tokengate-max-queue-wait": "soon"}
        )
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "x-tokengate-max-queue-wait"
    await holder.close()
    assert await gw.wait_idle() == {"tenant:t": 0, "backend:default": 0}


async def test_drain_finishes_in_flight_rejects_new_and_queued(
    stub_backend: tuple[StubBackend, str], gateway_factory: GatewayFactory
) -> None:
    _, url = stub_backend
    gw = await gateway_factory(
        {
            "pools": stub_pools(url),
            "tenants": {"t": {"keys": ["k"], "budget_tokens": 1200, "default_max_tokens": 1000}},
        }
    )
    auth = {"authorization": "Bearer k"}
    async with httpx.AsyncClient(base_url=gw.url, headers=auth, timeout=10) as c:
        finishing = asyncio.create_task(
            c.post("/v1/chat/completions", json=chat(), headers={"x-stub-delay": "0.3"})
        )
        await eventually(lambda: holds_tokens(gw, "tenant:t"))  # admitted: the next one must queue
        queued = asyncio.create_task(c.post("/v1/chat/completions", json=chat()))
        await eventually(lambda: tenant_waiting(gw, "t", 1))
        drain = asyncio.create_task(gw.app.drain(5.0))
        r_queued = await queued
        assert r_queued.status_code == 503 and r_queued.json()["error"]["code"] == "draining"
        r_new = await c.post("/v1/chat/completions", json=chat())
        assert r_new.status_code == 503
        assert (await c.get("/readyz")).status_code == 503
        r_fin = await finishing
        assert r_fin.status_code == 200
        await drain
    assert await gw.wait_idle(0.1) == {"tenant:t": 0, "backend:default": 0}


async def test_drain_deadline_cancels_and_releases(
    gateway: RunningGateway, stub_backend: tuple[StubBackend, str]
) -> None:
    stub, _ = stub_backend
    req = await RawRequest.post(
        gateway.url,
        "/v1/chat/completions",
        chat(stream=True),
        {"x-stub-chunks": "1000", "x-stub-interval": "0.01", "x-t": "long"},
    )
    assert (await req.read_head())[0] == 200
    waiting = await RawRequest.post(gateway.url, "/v1/chat/completions", chat(), {"x-stub-delay": "10"})
    await eventually(lambda: len(stub.requests) == 2)  # both admitted and at the backend
    started = time.monotonic()
    await gateway.app.drain(0.2)
    assert time.monotonic() - started < 2
    assert await gateway.wait_idle(0.5) == ZERO
    rest = await asyncio.wait_for(req.reader.readuntil(b"\r\n0\r\n\r\n"), 5)  # the last HTTP chunk
    assert b"shut down" in rest  # the stream ended with an error event
    status, _ = await waiting.read_head()
    assert status == 503
    upstream = stub.by_header("x-t", "long")
    await eventually(lambda: upstream.cancelled_at is not None)
    await req.close()
    await waiting.close()


async def test_release_charges_the_tenant_the_output_the_backend_reported(
    stub_backend: tuple[StubBackend, str], gateway_factory: GatewayFactory
) -> None:
    # Fair share counts service, not reservations: the prompt at the grant, then at release the
    # completion tokens of the backend's usage (2 per token, the default decode weight). A request
    # whose usage never arrives is charged its whole reservation.
    _, url = stub_backend
    gw = await gateway_factory({"pools": stub_pools(url), "tenants": {"t": {"keys": ["k"]}}})

    async def counter() -> float:
        return float((await gw.store.snapshot()).virtual_service.get("t", 0.0))

    async with httpx.AsyncClient(base_url=gw.url) as c:
        for stream, chunks in ((False, 3), (True, 5)):
            before = await counter()
            body = chat(max_tokens=500, stream=stream)
            r = await c.post(
                "/v1/chat/completions", json=body, headers={**AUTH_K, "x-stub-chunks": str(chunks)}
            )
            assert r.status_code == 200
            prefill = int(r.headers["x-tokengate-cost"]) - 500
            assert await gw.wait_idle() == {"tenant:t": 0, "backend:default": 0}
            assert await counter() - before == prefill + 2 * chunks, f"stream={stream}"
    before = await counter()
    cut = await RawRequest.post(
        gw.url,
        "/v1/chat/completions",
        chat(max_tokens=500, stream=True),
        {**AUTH_K, "x-stub-chunks": "400", "x-stub-interval": "0.01"},
    )
    status, head = await cut.read_head()
    assert status == 200 and await cut.read_some(64)
    await cut.close()  # no usage ever arrives
    assert await gw.wait_idle() == {"tenant:t": 0, "backend:default": 0}
    prefill = int(head["x-tokengate-cost"]) - 500
    assert await counter() - before == prefill + 2 * 500


async def test_a_request_the_backend_refused_or_never_saw_is_charged_its_prompt_only(
    stub_backend: tuple[StubBackend, str], gateway_factory: GatewayFactory
) -> None:
    # Nothing was generated, so no output service is charged (the prompt was admitted, so it is).
    _, url = stub_backend
    dead = f"http://127.0.0.1:{free_port()}"
    pools = {
        "default": {"backends": [{"url": url, "capacity_tokens": 100_000, "models": ["stub-model"]}]},
        "dead": {"backends": [{"url": dead, "capacity_tokens": 100_000, "models": ["gone-model"]}]},
    }
    gw = await gateway_factory({"pools": pools, "tenants": {"t": {"keys": ["k"]}}})

    async def counter() -> float:
        return float((await gw.store.snapshot()).virtual_service.get("t", 0.0))

    async with httpx.AsyncClient(base_url=gw.url) as c:
        for model, headers, status in (
            ("stub-model", {"x-stub-status": "422"}, 422),
            ("stub-model", {"x-stub-status": "500"}, 502),
            ("gone-model", {}, 502),
        ):
            before = await counter()
            body = chat(max_tokens=500) | {"model": model}
            r = await c.post("/v1/chat/completions", json=body, headers={**AUTH_K, **headers})
            assert r.status_code == status, model
            prefill = int(r.headers["x-tokengate-cost"]) - 500
            assert await gw.wait_idle() == {"tenant:t": 0, "backend:default": 0, "backend:dead": 0}
            assert await counter() - before == prefill, (model, headers)

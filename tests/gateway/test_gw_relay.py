"""What the backend receives and what the client gets back, over real sockets."""

from __future__ import annotations

import httpx
import orjson
import pytest

from classifiers import default_tokenizer
from tests.conftest import GatewayFactory, RunningGateway, StubBackend, serve_asgi, stub_pools
from tests.gateway.gw_support import chat


async def test_non_streaming_relayed_with_gateway_headers(
    gateway: RunningGateway, stub_backend: tuple[StubBackend, str]
) -> None:
    stub, _ = stub_backend
    async with httpx.AsyncClient(base_url=gateway.url) as c:
        r = await c.post("/v1/chat/completions", json=chat(max_tokens=7))
    assert r.status_code == 200
    assert r.json()["choices"][0]["message"]["content"] == "tok0 tok1 tok2 "
    assert r.headers["x-tokengate-class"] == "default"
    cost = int(r.headers["x-tokengate-cost"])
    assert cost > 7 and float(r.headers["x-tokengate-queue-ms"]) >= 0
    assert stub.requests[-1].body["max_tokens"] == 7
    assert await gateway.wait_idle() == {"tenant:default": 0, "backend:default": 0}


async def test_stream_byte_exact_when_client_asked_for_usage(
    gateway: RunningGateway, stub_backend: tuple[StubBackend, str]
) -> None:
    stub, _ = stub_backend
    body = chat(
        stream=True, stream_options={"include_usage": True}, max_tokens=5, some_unknown_field={"a": [1, 2.5]}
    )
    raw = orjson.dumps(body)
    async with httpx.AsyncClient(base_url=gateway.url) as c:
        async with c.stream(
            "POST",
            "/v1/chat/completions",
            content=raw,
            headers={"content-type": "application/json", "x-stub-chunks": "5"},
        ) as r:
            got = b"".join([chunk async for chunk in r.aiter_raw()])
    sent = stub.requests[-1]
    assert got == sent.sent
    assert got.endswith(b"data: [DONE]\n\n") and b'"choices":[],"usage"' in got
    # Nothing needed changing, so the body went upstream byte for byte (unknown field included).
    assert sent.raw == raw


async def test_stream_usage_chunk_dropped_when_not_asked(
    gateway: RunningGateway, stub_backend: tuple[StubBackend, str]
) -> None:
    stub, _ = stub_backend
    async with httpx.AsyncClient(base_url=gateway.url) as c:
        async with c.stream(
            "POST",
            "/v1/completions",
            json={"model": "stub-model", "prompt": "hi", "stream": True, "max_tokens": 4},
        ) as r:
            got = b"".join([chunk async for chunk in r.aiter_raw()])
            assert r.headers["content-type"].startswith("text/event-stream")
    sent = stub.requests[-1]
    assert sent.body["stream_options"] == {"include_usage": True}  # asked upstream anyway
    events = sent.sent.split(b"\n\n")
    usage_event = next(e for e in events if b'"choices":[]' in e)
    assert got == sent.sent.replace(usage_event + b"\n\n", b"")
    assert got.endswith(b"data: [DONE]\n\n")
    # The gateway learned the real usage even though the client never saw it.
    metrics = (await httpx.AsyncClient(base_url=gateway.ops_url).get("/metrics")).text
    assert 'tokengate_tokens_actual_total{class="default",kind="output"} 3.0' in metrics


async def test_max_tokens_injected_only_when_absent(
    stub_backend: tuple[StubBackend, str], gateway_factory: GatewayFactory
) -> None:
    stub, url = stub_backend
    gw = await gateway_factory(
        {"pools": stub_pools(url), "tenants": {"t": {"keys": ["k"], "default_max_tokens": 300}}}
    )
    async with httpx.AsyncClient(base_url=gw.url, headers={"authorization": "Bearer k"}) as c:
        r = await c.post("/v1/chat/completions", json=chat(n=2))
        assert r.status_code == 200
        assert stub.requests[-1].body["max_tokens"] == 300  # per choice, not times n
        await c.post("/v1/chat/completions", json=chat(max_completion_tokens=9))
        assert "max_tokens" not in stub.requests[-1].body
    gw2 = await gateway_factory({"pools": stub_pools(url), "enforce_max_tokens": False})
    async with httpx.AsyncClient(base_url=gw2.url) as c:
        raw = orjson.dumps(chat())
        await c.post("/v1/chat/completions", content=raw, headers={"content-type": "application/json"})
    assert stub.requests[-1].raw == raw


async def test_headers_auth_replaced_hop_by_hop_stripped(
    stub_backend: tuple[StubBackend, str], gateway_factory: GatewayFactory
) -> None:
    stub, url = stub_backend
    gw = await gateway_factory(
        {"pools": stub_pools(url, api_key="backend-secret"), "tenants": {"t": {"keys": ["client-key"]}}}
    )
    async with httpx.AsyncClient(base_url=gw.url) as c:
        r = await c.post(
            "/v1/chat/completions",
            json=chat(),
            headers={
                "authorization": "Bearer client-key",
                "x-custom": "kept",
                "connection": "keep-alive, x-private",
                "x-private": "hop",
                "keep-alive": "timeout=5",
                "te": "trailers",
                "x-tokengate-tier": "batch",
            },
        )
    assert r.status_code == 200
    h = stub.requests[-1].headers
    assert h["authorization"] == "Bearer backend-secret"
    assert h["x-custom"] == "kept"
    assert "te" not in h and "keep-alive" not in h and "x-tokengate-tier" not in h
    assert "x-private" not in h  # named by the client's Connection header: for this hop only
    assert "client-key" not in repr(h)


async def test_open_mode_forwards_client_key(
    gateway: RunningGateway, stub_backend: tuple[StubBackend, str]
) -> None:
    stub, _ = stub_backend
    async with httpx.AsyncClient(base_url=gateway.url) as c:
        await c.post("/v1/chat/completions", json=chat(), headers={"authorization": "Bearer for-the-backend"})
    assert stub.requests[-1].headers["authorization"] == "Bearer for-the-backend"


async def test_priority_from_tier_only_where_accepted(
    stub_backend: tuple[StubBackend, str], gateway_factory: GatewayFactory
) -> None:
    stub, url = stub_backend
    tenants = {"gold": {"keys": ["g"], "tier": "critical"}}
    gw = await gateway_factory({"pools": stub_pools(url, accepts_priority=True), "tenants": tenants})
    async with httpx.AsyncClient(base_url=gw.url, headers={"authorization": "Bearer g"}) as c:
        await c.post("/v1/chat/completions", json=chat(max_tokens=1))
        assert stub.requests[-1].body["priority"] == 0
        await c.post("/v1/chat/completions", json=chat(max_tokens=1), headers={"x-tokengate-tier": "batch"})
        assert stub.requests[-1].body["priority"] == 2
    gw2 = await gateway_factory({"pools": stub_pools(url), "tenants": tenants})
    async with httpx.AsyncClient(base_url=gw2.url, headers={"authorization": "Bearer g"}) as c:
        await c.post("/v1/chat/completions", json=chat(max_tokens=1))
    assert "priority" not in stub.requests[-1].body


@pytest.mark.parametrize("accepts", [True, False])
async def test_a_clients_own_priority_never_reaches_the_engine(
    stub_backend: tuple[StubBackend, str], gateway_factory: GatewayFactory, accepts: bool
) -> None:
    # An engine scheduling by priority (vLLM --scheduling-policy priority) runs lower values first: a
    # batch-tier tenant sending "priority": -1000 would jump every other tenant's requests there.
    stub, url = stub_backend
    tenants = {"low": {"keys": ["b"], "tier": "batch"}}
    gw = await gateway_factory({"pools": stub_pools(url, accepts_priority=accepts), "tenants": tenants})
    routes = [
        ("/v1/chat/completions", chat(max_tokens=1, priority=-1000)),
        ("/v1/completions", {"model": "stub-model", "prompt": "hi", "max_tokens": 1, "priority": -1000}),
        ("/v1/embeddings", {"model": "stub-model", "input": "hi", "priority": -1000}),
        ("/v1/responses", {"model": "stub-model", "input": "hi", "max_output_tokens": 1, "priority": -1000}),
    ]
    async with httpx.AsyncClient(base_url=gw.url, headers={"authorization": "Bearer b"}) as c:
        for path, body in routes:
            r = await c.post(path, json=body)
            assert r.status_code == 200, (path, r.text)
            sent = stub.requests[-1].body
            assert sent.get("priority") == (2 if accepts else None), path
            assert sent["model"] == "stub-model"
    # an allowed pass-through route too: its body goes as it came, but for that field
    routes_cfg = {"passthrough": {"routes": [{"method": "POST", "path": "/v1/rerank"}]}}
    pt = await gateway_factory(
        {"pools": stub_pools(url, accepts_priority=accepts), "tenants": tenants} | routes_cfg
    )
    async with httpx.AsyncClient(base_url=pt.url, headers={"authorization": "Bearer b"}) as c:
        rerank = {"model": "stub-model", "query": "q", "documents": ["a"], "priority": -1000}
        assert (await c.post("/v1/rerank", json=rerank)).status_code == 200
        assert stub.requests[-1].body == {k: v for k, v in rerank.items() if k != "priority"} | (
            {"priority": 2} if accepts else {}
        )
        plain = {"model": "stub-model", "query": "q", "documents": ["a"]}
        assert (await c.post("/v1/rerank", json=plain)).status_code == 200
        assert stub.requests[-1].raw == orjson.dumps(plain)  # no priority sent: the bytes as they came
    for g in (gw, pt):
        assert await g.wait_idle() == {name: 0 for name in await g.in_flight()}


async def test_embeddings_priced_prompt_only(gateway: RunningGateway) -> None:
    async with httpx.AsyncClient(base_url=gateway.url) as c:
        r = await c.post("/v1/embeddings", json={"model": "stub-model", "input": "one two three"})
        assert r.status_code == 200 and r.json()["data"][0]["embedding"] == [0.0, 1.0]
        assert int(r.headers["x-tokengate-cost"]) == 3
    assert await gateway.wait_idle() == {"tenant:default": 0, "backend:default": 0}


async def test_backend_4xx_relayed_as_is(gateway: RunningGateway) -> None:
    async with httpx.AsyncClient(base_url=gateway.url) as c:
        r = await c.post("/v1/chat/completions", json=chat(), headers={"x-stub-status": "422"})
    assert r.status_code == 422
    assert r.json()["error"]["message"] == "stub error 422"
    assert await gateway.wait_idle() == {"tenant:default": 0, "backend:default": 0}


async def test_models_from_configured_backends(
    stub_backend: tuple[StubBackend, str], gateway_factory: GatewayFactory
) -> None:
    _, url = stub_backend
    gw = await gateway_factory(
        {"pools": stub_pools(url, models=["alpha", "beta"]), "tenants": {"t": {"keys": ["k"]}}}
    )
    async with httpx.AsyncClient(base_url=gw.url) as c:
        assert (await c.get("/v1/models")).status_code == 401
        r = await c.get("/v1/models", headers={"authorization": "Bearer k"})
    assert [m["id"] for m in r.json()["data"]] == ["alpha", "beta"]


async def test_classes_route_to_pools_with_overflow(gateway_factory: GatewayFactory) -> None:
    short, long_ = StubBackend(), StubBackend()
    s1, s2 = await serve_asgi(short), await serve_asgi(long_)
    try:
        gw = await gateway_factory(
            {
                "classes": [
                    {
                        "name": "long",
                        "when": {"min_prompt_tokens": 50},
                        "pool": "long",
                        "overflow_pool": "short",
                    },
                    {"name": "short", "pool": "short"},
                ],
                "pools": {
                    "short": {"backends": [{"url": s1.url, "capacity_tokens": 10000}]},
                    "long": {"backends": [{"url": s2.url, "capacity_tokens": 10000}]},
                },
                "health": {"failure_threshold": 1, "cooldown_s": 60},
            }
        )
        async with httpx.AsyncClient(base_url=gw.url) as c:
            r = await c.post("/v1/chat/completions", json=chat("word " * 100, max_tokens=1))
            assert r.headers["x-tokengate-class"] == "long" and len(long_.requests) == 1
            r = await c.post("/v1/chat/completions", json=chat("hi", max_tokens=1))
            assert r.headers["x-tokengate-class"] == "short" and len(short.requests) == 1
            await s2.stop()  # the long pool's only backend goes away
            r = await c.post("/v1/chat/completions", json=chat("word " * 100, max_tokens=1))
            assert r.status_code == 502  # connect refused opens its breaker (threshold 1)
            r = await c.post("/v1/chat/completions", json=chat("word " * 100, max_tokens=1))
            assert r.status_code == 200 and len(short.requests) == 2  # overflow to the short pool
            assert r.headers["x-tokengate-class"] == "long"
        assert not any((await gw.in_flight()).values())
    finally:
        await s1.stop()
        if not s2.task.done():
            await s2.stop()


async def test_class_budget_pool(
    stub_backend: tuple[StubBackend, str], gateway_factory: GatewayFactory
) -> None:
    _, url = stub_backend
    gw = await gateway_factory(
        {
            "classes": [
                {"name": "big", "when": {"min_decode_tokens": 500}, "pool": "default", "budget_tokens": 2000},
                {"name": "small", "pool": "default"},
            ],
            "pools": stub_pools(url),
        }
    )
    async with httpx.AsyncClient(base_url=gw.url) as c:
        r = await c.post("/v1/chat/completions", json=chat(max_tokens=600))
        assert r.status_code == 200 and r.headers["x-tokengate-class"] == "big"
        r = await c.post("/v1/chat/completions", json=chat(max_tokens=5000))
        assert r.status_code == 413 and "class:big" in r.json()["error"]["message"]
        r = await c.post("/v1/chat/completions", json=chat(max_tokens=5))
        assert r.headers["x-tokengate-class"] == "small"
    assert await gw.wait_idle() == {"tenant:default": 0, "backend:default": 0, "class:big": 0}


async def test_structured_output_requests_get_a_class_of_their_own(
    stub_backend: tuple[StubBackend, str], gateway_factory: GatewayFactory
) -> None:
    # Their grammar work slows every step of the engine's batch: an operator bounds how much of it
    # is in flight (a class budget) or sends it to an engine of its own, by the fields that ask for it.
    _, url = stub_backend
    fields = ["guided_json", "guided_regex", "structured_outputs", "response_format"]
    gw = await gateway_factory(
        {
            "classes": [
                {
                    "name": "structured",
                    "when": {"has_field": fields},
                    "pool": "default",
                    "budget_tokens": 3000,
                },
                {"name": "plain", "pool": "default"},
            ],
            "pools": stub_pools(url),
        }
    )
    async with httpx.AsyncClient(base_url=gw.url) as c:
        for extra in ({"guided_regex": "[a-z]+"}, {"response_format": {"type": "json_object"}}):
            r = await c.post("/v1/chat/completions", json=chat(max_tokens=16, **extra))
            assert r.status_code == 200 and r.headers["x-tokengate-class"] == "structured"
        r = await c.post("/v1/chat/completions", json=chat(max_tokens=4000, guided_json={"type": "object"}))
        assert r.status_code == 413 and "class:structured" in r.json()["error"]["message"]
        r = await c.post("/v1/chat/completions", json=chat(max_tokens=16, guided_json=None))
        assert r.headers["x-tokengate-class"] == "plain"
    assert await gw.wait_idle() == {"tenant:default": 0, "backend:default": 0, "class:structured": 0}


async def test_the_injected_limit_keeps_every_prompt_of_a_request_within_its_context(
    stub_backend: tuple[StubBackend, str], gateway_factory: GatewayFactory
) -> None:
    # Two prompts of very different lengths: one max_tokens goes to both, so it is the per-choice
    # reservation that fits the longest prompt's context, not an average over the prompts.
    stub, url = stub_backend
    gw = await gateway_factory(
        {
            "pools": stub_pools(url),
            "models": {"stub-model": {"context_length": 200}},
            "pricing": {"default_max_tokens": 300},
        }
    )
    async with httpx.AsyncClient(base_url=gw.url) as c:
        r = await c.post(
            "/v1/completions", json={"model": "stub-model", "prompt": ["word " * 150, "hi"], "n": 2}
        )
        assert r.status_code == 200
    count = default_tokenizer().count  # the gateway's default (cl100k)
    long_tokens, short_tokens = count("word " * 150), count("hi")
    assert stub.requests[-1].body["max_tokens"] == 200 - long_tokens  # fits the long prompt's context
    assert int(r.headers["x-tokengate-cost"]) == long_tokens + short_tokens + 2 * (
        (200 - long_tokens) + (200 - short_tokens)
    )  # while each prompt still reserves what its own context allows

"""What an engine trusts only from its own serving stack never comes from a tenant.

vLLM reads prefill/decode connector metadata from the request body (``kv_transfer_params``: a
client's ``remote_host`` / ``remote_port`` steered the decode instance's outbound connections,
vLLM PR #47843, and its ``tp_size`` made the engine allocate without bound, #51137); SGLang reads its
prefill/decode bootstrap address the same way, runs a ``custom_logit_processor`` sent as a
serialized Python callable when started with ``--enable-custom-logit-processor``, and takes a
request's engine-wide id from ``rid`` (two requests with one ``rid`` hung or crashed it before
SGLang PR #19035); both pin a request
to the data-parallel rank an ``X-Data-Parallel-Rank`` header names. Over real sockets: such fields are
a 400 on every route before anything is held or forwarded, and the header never reaches a backend."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from gateway.config.schema import ENGINE_INTERNAL_FIELDS
from tests.adversarial.backends import RoutingStack
from tests.adversarial.support import rerank_config as config
from tests.conftest import GatewayFactory, StubBackend, serve_asgi

EVIL: dict[str, Any] = {
    "kv_transfer_params": {"do_remote_prefill": True, "remote_host": "10.0.0.66", "remote_port": 5600},
    "bootstrap_host": "10.0.0.66",
    "bootstrap_port": 8998,
    "bootstrap_room": 1234,
    "custom_logit_processor": '{"callable": "gASV..."}',
    "rid": "req-1",
}
ROUTES: list[tuple[str, dict[str, Any]]] = [
    (
        "/v1/chat/completions",
        {"model": "stub-model", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]},
    ),
    ("/v1/completions", {"model": "stub-model", "max_tokens": 5, "prompt": "hi"}),
    ("/v1/responses", {"model": "stub-model", "max_output_tokens": 5, "input": "hi"}),
    ("/v1/embeddings", {"model": "stub-model", "input": "hi"}),
    ("/v1/rerank", {"model": "stub-model", "query": "q", "documents": ["a"]}),
]


def test_the_default_list_is_every_field_attacked_here() -> None:
    assert set(EVIL) == set(ENGINE_INTERNAL_FIELDS)


@pytest.mark.parametrize(("path", "body"), ROUTES)
async def test_engine_internal_fields_are_a_400_on_every_route(
    stub_backend: tuple[StubBackend, str], gateway_factory: GatewayFactory, path: str, body: dict[str, Any]
) -> None:
    stub, url = stub_backend
    gw = await gateway_factory(config(url))
    async with httpx.AsyncClient(headers={"authorization": "Bearer k"}) as c:
        for field, value in EVIL.items():
            r = await c.post(gw.url + path, json={**body, field: value})
            assert r.status_code == 400, r.text
            error = r.json()["error"]
            assert error["code"] == "unsupported_parameter" and error["param"] == field, error
            assert "limits.refused_fields" in error["message"]
        assert stub.requests == []
        assert (await c.post(gw.url + path, json=body)).status_code == 200
    assert await gw.wait_idle() == {name: 0 for name in await gw.in_flight()}


async def test_an_operator_chooses_the_list(
    stub_backend: tuple[StubBackend, str], gateway_factory: GatewayFactory
) -> None:
    stub, url = stub_backend
    gw = await gateway_factory(config(url, refused_fields=["vllm_xargs"]))
    chat = ROUTES[0][1]
    async with httpx.AsyncClient(headers={"authorization": "Bearer k"}) as c:
        r = await c.post(gw.url + "/v1/chat/completions", json={**chat, "vllm_xargs": {"lp": 1}})
        assert r.status_code == 400 and r.json()["error"]["param"] == "vllm_xargs"
        # Not on the operator's list: forwarded (a deployment whose own router sits behind the gateway).
        r = await c.post(gw.url + "/v1/chat/completions", json={**chat, "kv_transfer_params": {"a": 1}})
        assert r.status_code == 200
    assert stub.requests[-1].body["kv_transfer_params"] == {"a": 1}


# What routing layers behind the gateway read to place a request: SGLang's model gateway (worker by
# index, consistent-hash key, the token ids its cache-aware policy routes by), the Gateway API
# inference extension / llm-d (the fairness id its flow control queues by, the objective that sets
# priority, the endpoint chosen), and the engines' data-parallel rank.
STEERING = {
    "X-SMG-Target-Worker": "0",
    "x-smg-routing-key": "victim-session",
    "X-Smg-Routing-Tokens": "128000,882,25",
    "x-gateway-inference-fairness-id": "victim-tenant",
    "X-Gateway-Inference-Objective": "critical",
    "x-gateway-destination-endpoint": "10.0.3.7:8000",
    "X-Data-Parallel-Rank": "3",
    "x_smg_target_worker": "1",  # (read as x-smg-target-worker behind a CGI-style interface)
}


@pytest.fixture
async def routing_stack() -> AsyncIterator[tuple[RoutingStack, str]]:
    stack = RoutingStack()
    served = await serve_asgi(stack)
    try:
        yield stack, served.url
    finally:
        await served.stop()


@pytest.mark.parametrize("stream", [False, True])
async def test_a_tenant_cannot_steer_the_routing_layer_behind_the_gateway_nor_learn_where_it_ran(
    routing_stack: tuple[RoutingStack, str], gateway_factory: GatewayFactory, stream: bool
) -> None:
    stack, url = routing_stack
    gw = await gateway_factory(config(url))
    async with httpx.AsyncClient(headers={"authorization": "Bearer k"}) as c:
        for path, body in ROUTES:
            sent = {**body, "stream": True} if stream and path != "/v1/embeddings" else body
            r = await c.post(gw.url + path, json=sent, headers={**STEERING, "X-Other": "kept"})
            assert r.status_code == 200, (path, r.text)
            answered = {k.lower() for k in r.headers}
            assert not answered & {"x-smg-worker-id", "x-gateway-destination-endpoint-served"}, path
            assert r.headers["x-answer-other"] == "kept"
    assert len(stack.headers) == len(ROUTES)
    for headers in stack.headers:
        assert not {k.lower() for k in STEERING} & set(headers), headers
        assert headers["x-other"] == "kept"
    assert await gw.wait_idle() == {name: 0 for name in await gw.in_flight()}


async def test_an_operator_chooses_the_private_headers(
    routing_stack: tuple[RoutingStack, str], gateway_factory: GatewayFactory
) -> None:
    stack, url = routing_stack
    gw = await gateway_factory(config(url, private_headers=["x-session-*", "x-smg-worker-id"]))
    async with httpx.AsyncClient(headers={"authorization": "Bearer k"}) as c:
        headers = {"x-session-id": "s", "x-smg-routing-key": "k"}
        r = await c.post(gw.url + ROUTES[0][0], json=ROUTES[0][1], headers=headers)
        assert r.status_code == 200
        assert "x-smg-worker-id" not in r.headers and "x-gateway-destination-endpoint-served" in r.headers
    assert "x-session-id" not in stack.headers[0] and stack.headers[0]["x-smg-routing-key"] == "k"


async def test_a_routing_layer_behind_the_gateway_is_told_the_tenant_not_what_the_client_claims(
    routing_stack: tuple[RoutingStack, str], gateway_factory: GatewayFactory
) -> None:
    stack, url = routing_stack
    cfg = config(url)
    cfg["pools"]["default"]["backends"][0]["tenant_header"] = "X-Gateway-Inference-Fairness-Id"
    cfg["tenants"]["u"] = {"keys": ["ku"]}
    gw = await gateway_factory(cfg)
    async with httpx.AsyncClient() as c:
        for k in ("k", "ku"):
            headers = {"authorization": f"Bearer {k}", "x-gateway-inference-fairness-id": "victim"}
            r = await c.post(gw.url + ROUTES[0][0], json=ROUTES[0][1], headers=headers)
            assert r.status_code == 200
    sent = [[v for name, v in h.items() if name == "x-gateway-inference-fairness-id"] for h in stack.headers]
    assert sent == [["t"], ["u"]]


async def test_a_tenant_cannot_pin_its_requests_to_a_data_parallel_rank(
    stub_backend: tuple[StubBackend, str], gateway_factory: GatewayFactory
) -> None:
    stub, url = stub_backend
    gw = await gateway_factory(config(url))
    async with httpx.AsyncClient(headers={"authorization": "Bearer k"}) as c:
        for path, body in ROUTES:
            headers = {"X-Data-Parallel-Rank": "3", "x-data-parallel-rank": "3", "X-Other": "kept"}
            assert (await c.post(gw.url + path, json=body, headers=headers)).status_code == 200
    assert len(stub.requests) == len(ROUTES)
    for req in stub.requests:
        assert "x-data-parallel-rank" not in {k.lower() for k in req.headers}
        assert req.headers["x-other"] == "kept"


@pytest.mark.parametrize("odd", ["NaN", "Infinity", "1e400", '"\\ud800"'])
async def test_a_pass_through_body_only_a_laxer_json_parser_reads_is_refused_not_forwarded_unchecked(
    stub_backend: tuple[StubBackend, str], gateway_factory: GatewayFactory, odd: str
) -> None:
    # Python's json (the engines' FastAPI) reads NaN, Infinity, 1e400 and lone surrogates; orjson
    # does not. Such a body was forwarded as it came, so nothing in it was checked.
    stub, url = stub_backend
    gw = await gateway_factory(config(url))
    raw = (
        '{"model": "stub-model", "query": "q", "documents": ["a"], "x": ODD, "kv_transfer_params": {"a": 1}}'
    )
    raw = raw.replace("ODD", odd)
    async with httpx.AsyncClient(
        headers={"authorization": "Bearer k", "content-type": "application/json"}
    ) as c:
        r = await c.post(gw.url + "/v1/rerank", content=raw.encode())
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json", r.text
    assert stub.requests == []


@pytest.mark.parametrize("encoding", ["utf-8-sig", "utf-16-be", "utf-16-le", "utf-16", "utf-32-be", "utf-32"])
async def test_a_pass_through_json_body_in_another_encoding_is_refused_not_forwarded_unchecked(
    stub_backend: tuple[StubBackend, str], gateway_factory: GatewayFactory, encoding: str
) -> None:
    # Python's json.loads(bytes) reads a byte-order mark and UTF-16/32 (FastAPI hands it the raw
    # body); orjson reads neither, so such a body skipped every check of its fields.
    stub, url = stub_backend
    gw = await gateway_factory(config(url))
    raw = '{"model": "stub-model", "query": "q", "documents": ["a"], "kv_transfer_params": {"a": 1}}'
    async with httpx.AsyncClient(
        headers={"authorization": "Bearer k", "content-type": "application/json"}
    ) as c:
        r = await c.post(gw.url + "/v1/rerank", content=raw.encode(encoding))
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json", r.text
        assert "UTF-8" in r.json()["error"]["message"]
    assert stub.requests == []

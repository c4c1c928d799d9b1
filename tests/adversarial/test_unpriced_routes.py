"""No route that can make a backend work is free: the Responses API is priced like chat (a 30k-token
request used to hold 16 tokens), its usage is read from its own event stream, and a tenant cannot
reach any other /v1 route unless an operator allowed it."""

from __future__ import annotations

import gzip
import logging

import httpx
import orjson
import pytest

from tests.adversarial.support import WORDS
from tests.conftest import GatewayFactory, StubBackend, stub_pools


def config(url: str, budget: int) -> dict[str, object]:
    return {
        "pools": stub_pools(url, capacity=200_000),
        "tenants": {"t": {"keys": ["k"], "budget_tokens": budget}},
    }


async def refused_small_admitted_big(
    stub_backend: tuple[StubBackend, str], factory: GatewayFactory, path: str, body: dict[str, object]
) -> int:
    """Send ``body`` to a gateway with a 20k budget (a 413: it can never fit) and to one with 100k
    (served); the cost the second one charged. Only the second reaches the backend; pools end at 0."""
    stub, url = stub_backend
    small = await factory(config(url, 20_000))
    big = await factory(config(url, 100_000))
    async with httpx.AsyncClient(headers={"authorization": "Bearer k"}) as c:
        refused = await c.post(small.url + path, json=body)
        assert refused.status_code == 413 and refused.json()["error"]["code"] == "cost_exceeds_capacity"
        r = await c.post(big.url + path, json=body)
        assert r.status_code == 200
    assert len(stub.requests) == 1
    for gw in (small, big):
        assert await gw.wait_idle() == {name: 0 for name in await gw.in_flight()}
    return int(r.headers["x-tokengate-cost"])


async def test_a_30k_token_responses_request_is_priced_at_its_size(
    stub_backend: tuple[StubBackend, str], gateway_factory: GatewayFactory
) -> None:
    body = {"model": "stub-model", "input": [{"role": "user", "content": WORDS}], "max_output_tokens": 500}
    assert await refused_small_admitted_big(stub_backend, gateway_factory, "/v1/responses", body) >= 30_500
    assert stub_backend[0].requests[0].body["max_output_tokens"] == 500


async def test_a_chat_style_embeddings_request_is_priced_by_its_messages_and_cannot_hide_behind_input(
    stub_backend: tuple[StubBackend, str], gateway_factory: GatewayFactory
) -> None:
    # vLLM embeds `messages` (its chat-style request for multimodal embedding models) rendered by
    # the chat template; before, only `input` was priced: 30k tokens of messages cost 1 beside it.
    body = {"model": "stub-model", "messages": [{"role": "user", "content": WORDS}]}
    assert await refused_small_admitted_big(stub_backend, gateway_factory, "/v1/embeddings", body) >= 30_000
    stub, url = stub_backend
    gw = await gateway_factory(config(url, 100_000))
    async with httpx.AsyncClient(headers={"authorization": "Bearer k"}) as c:
        r = await c.post(gw.url + "/v1/embeddings", json={**body, "input": "x"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "messages", r.text
        assert "not both" in r.json()["error"]["message"]
    assert len(stub.requests) == 1


# Prompt text in the fields vLLM's and SGLang's chat templates render beyond OpenAI's: each used to
# cost 12 tokens here whatever it carried.
ENGINE_FIELDS: dict[str, dict[str, object]] = {
    "documents": {"documents": [{"title": "manual", "text": WORDS}]},
    "chat_template_kwargs": {"chat_template_kwargs": {"custom_instructions": WORDS}},
    "reasoning_content": {
        "messages": [
            {"role": "assistant", "content": "4", "reasoning_content": WORDS},
            {"role": "user", "content": "and 3+3?"},
        ]
    },
}


@pytest.mark.parametrize("field", list(ENGINE_FIELDS))
async def test_prompt_text_carried_in_an_engine_field_is_priced_at_its_size(
    stub_backend: tuple[StubBackend, str], gateway_factory: GatewayFactory, field: str
) -> None:
    body = {"model": "stub-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 10}
    body |= ENGINE_FIELDS[field]
    assert (
        await refused_small_admitted_big(stub_backend, gateway_factory, "/v1/chat/completions", body)
        >= 30_000
    )


async def refused_before_the_backend(
    stub_backend: tuple[StubBackend, str], factory: GatewayFactory, path: str, body: dict[str, object]
) -> dict[str, object]:
    """Send ``body`` (a 100k budget); the 400's error object. It never reached the backend, and the
    pools end at 0."""
    stub, url = stub_backend
    gw = await factory(config(url, 100_000))
    async with httpx.AsyncClient(base_url=gw.url, headers={"authorization": "Bearer k"}) as c:
        r = await c.post(path, json=body)
    assert r.status_code == 400
    assert stub.requests == []
    assert await gw.wait_idle() == {name: 0 for name in await gw.in_flight()}
    error: dict[str, object] = r.json()["error"]
    return error


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        (
            "/v1/chat/completions",
            {
                "model": "stub-model",
                "messages": [{"role": "user", "content": "hi"}],
                "chat_template": "{% for i in range(100000) %}{{ messages[0].content }}{% endfor %}",
            },
            "chat_template",
        ),
        (
            "/v1/completions",
            {"model": "stub-model", "prompt": "x", "prompt_embeds": "AAAA" * 1000},
            "prompt_embeds",
        ),
    ],
)
async def test_what_cannot_be_priced_is_refused_before_the_backend(
    stub_backend: tuple[StubBackend, str],
    gateway_factory: GatewayFactory,
    path: str,
    body: dict[str, object],
    param: str,
) -> None:
    error = await refused_before_the_backend(stub_backend, gateway_factory, path, body)
    assert (error["param"], error["code"]) == (param, "unsupported_parameter")
    assert error["type"] == "invalid_request_error"


@pytest.mark.parametrize("stream", [False, True])
async def test_responses_usage_is_recorded_and_the_output_limit_enforced(
    stub_backend: tuple[StubBackend, str],
    gateway_factory: GatewayFactory,
    stream: bool,
    caplog: pytest.LogCaptureFixture,
) -> None:
    stub, url = stub_backend
    gw = await gateway_factory(config(url, 50_000))
    caplog.set_level(logging.INFO, logger="tokengate.access")
    body = {"model": "stub-model", "input": "hello there", "instructions": "be brief", "stream": stream}
    async with httpx.AsyncClient(base_url=gw.url, headers={"authorization": "Bearer k"}) as c:
        r = await c.post("/v1/responses", json=body, headers={"x-stub-chunks": "5"})
    assert r.status_code == 200
    sent = stub.requests[-1]
    assert sent.body["max_output_tokens"] == 1024  # injected: the backend cannot run past the reservation
    assert "stream_options" not in sent.body  # the Responses API has none
    if stream:
        assert r.content == sent.sent  # relayed byte for byte, usage event included
    line = orjson.loads([rec.getMessage() for rec in caplog.records if rec.name == "tokengate.access"][-1])
    assert (line["prompt_tokens"], line["completion_tokens"]) == (11, 5)
    assert await gw.wait_idle() == {name: 0 for name in await gw.in_flight()}


async def test_a_compressed_body_is_refused_not_priced_at_its_compressed_size(
    stub_backend: tuple[StubBackend, str], gateway_factory: GatewayFactory
) -> None:
    # 4 kB of gzip is 2 MB of text to a backend that decodes request bodies; a pass-through route
    # priced the 4 kB (and forwarded it with its Content-Encoding header).
    stub, url = stub_backend
    gw = await gateway_factory(
        config(url, 20_000) | {"passthrough": {"routes": [{"method": "POST", "path": "/v1/rerank"}]}}
    )
    inflated = orjson.dumps({"model": "stub-model", "query": "q", "documents": ["word " * 400_000]})
    body = gzip.compress(inflated)
    assert len(body) * 100 < len(inflated)
    async with httpx.AsyncClient(base_url=gw.url, headers={"authorization": "Bearer k"}) as c:
        for coding in ("gzip", "GZIP", "br", "deflate, gzip"):
            headers = {"content-type": "application/json", "content-encoding": coding}
            r = await c.post("/v1/rerank", content=body, headers=headers)
            assert r.status_code == 415, r.text
            err = r.json()["error"]
            assert err["code"] == "unsupported_content_encoding" and "uncompressed" in err["message"]
        plain = await c.post(
            "/v1/rerank",
            content=orjson.dumps({"model": "stub-model", "query": "q", "documents": ["a"]}),
            headers={"content-type": "application/json", "content-encoding": "identity"},
        )
        assert plain.status_code == 200, plain.text
    assert [req.path for req in stub.requests] == ["/v1/rerank"]  # only the uncompressed one
    assert await gw.wait_idle() == {name: 0 for name in await gw.in_flight()}


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"stop": [f"s{i}" for i in range(10_000)]}, "stop"),
        ({"logit_bias": {str(i): 1 for i in range(50_000)}}, "logit_bias"),
    ],
)
async def test_a_request_cannot_make_every_engine_step_slower_for_everyone(
    stub_backend: tuple[StubBackend, str],
    gateway_factory: GatewayFactory,
    extra: dict[str, object],
    param: str,
) -> None:
    # 10,000 stop strings cost a handful of tokens of budget and 10,000 searches per generated token
    # in the engine's one streaming loop, which every other request waits behind.
    body = {"model": "stub-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 10} | extra
    error = await refused_before_the_backend(stub_backend, gateway_factory, "/v1/chat/completions", body)
    assert error["param"] == param
    assert "pricing.max_" in str(error["message"])


@pytest.mark.parametrize(
    ("path", "body"),
    [
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "word " * 9000}], "prompt_logprobs": 1},
        ),
        ("/v1/completions", {"prompt": "word " * 9000, "echo": True, "logprobs": 1}),
    ],
)
async def test_a_request_cannot_take_the_engine_down_with_prompt_logprobs(
    stub_backend: tuple[StubBackend, str], gateway_factory: GatewayFactory, path: str, body: dict[str, object]
) -> None:
    # The engine's logits of 9,000 prompt tokens over a 152k vocabulary, in float32, are ~8 GiB
    # beside the KV cache it reserved: an out-of-memory crash for every tenant of that engine.
    error = await refused_before_the_backend(
        stub_backend, gateway_factory, path, {"model": "stub-model", "max_tokens": 1} | body
    )
    assert error["code"] == "prompt_logprobs_too_long"
    assert "pricing.max_prompt_logprobs_tokens" in str(error["message"])


async def test_an_image_costs_what_it_costs_on_a_dynamic_resolution_model(
    stub_backend: tuple[StubBackend, str], gateway_factory: GatewayFactory
) -> None:
    # Qwen2.5-VL turns one image into up to 16,384 tokens; at a constant 765 each, two remote
    # images of any size fitted a 20k budget. Remote images cost the most, inline ones their size.
    import base64
    import io

    from PIL import Image

    stub, url = stub_backend
    qwen = {
        "context_length": 128_000,
        "images": {"patch_pixels": 28, "max_pixels": 12_845_056, "extra_tokens": 2},
    }
    gw = await gateway_factory({**config(url, 20_000), "models": {"stub-*": qwen}})
    png = io.BytesIO()
    Image.new("RGB", (64, 64)).save(png, format="PNG")
    small = "data:image/png;base64," + base64.b64encode(png.getvalue()).decode()

    def chat(*images: str) -> dict[str, object]:
        parts = [{"type": "text", "text": "what is this?"}]
        parts += [{"type": "image_url", "image_url": {"url": i}} for i in images]
        return {"model": "stub-model", "messages": [{"role": "user", "content": parts}], "max_tokens": 10}

    async with httpx.AsyncClient(base_url=gw.url, headers={"authorization": "Bearer k"}) as c:
        two = await c.post(
            "/v1/chat/completions", json=chat("https://img.example/a.png", "https://img.example/b.png")
        )
        assert two.status_code == 413 and two.json()["error"]["code"] == "cost_exceeds_capacity"
        one = await c.post("/v1/chat/completions", json=chat("https://img.example/a.png"))
        assert one.status_code == 200 and int(one.headers["x-tokengate-cost"]) >= 16_386
        thumb = await c.post("/v1/chat/completions", json=chat(small))
        assert thumb.status_code == 200 and int(thumb.headers["x-tokengate-cost"]) < 100
        # The request's own processor bounds are the engine's: a raised max_pixels is priced.
        raised = chat("https://img.example/a.png") | {"mm_processor_kwargs": {"max_pixels": 50_000_000}}
        big = await c.post("/v1/chat/completions", json=raised)
        assert big.status_code == 413
        cost = int(big.json()["error"]["message"].split("request costs ")[1].split(" ")[0])
        assert cost >= 50_000_000 // 784 + 2  # what the engine will make of it, not 16,386
    assert len(stub.requests) == 2
    assert await gw.wait_idle() == {name: 0 for name in await gw.in_flight()}

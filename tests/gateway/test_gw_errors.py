"""Every refusal in OpenAI's error shape with the right status; bad input never yields a 500."""

from __future__ import annotations

import gzip
import random
from typing import Any

import httpx
import orjson
import pytest

from tests.conftest import GatewayFactory, RunningGateway, StubBackend, stub_pools
from tests.gateway.gw_support import AUTH, RawRequest, chat


def assert_error(
    r: httpx.Response, status: int, code: str | None = None, param: str | None = None
) -> dict[str, Any]:
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/json")
    body = r.json()
    assert set(body) == {"error"}
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"]
    if code is not None:
        assert err["code"] == code
    if param is not None:
        assert err["param"] == param
    return err


@pytest.fixture
async def closed(stub_backend: tuple[StubBackend, str], gateway_factory: GatewayFactory) -> RunningGateway:
    _, url = stub_backend
    return await gateway_factory(
        {
            "pools": stub_pools(url, capacity=50_000, models=["stub-model"]),
            "tenants": {
                "t": {"keys": ["k"], "budget_tokens": 20_000, "max_max_tokens": 4096, "max_queue_len": 0},
            },
            "limits": {"max_body_bytes": 2000},
        }
    )


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"messages": [{"role": "user", "content": "x"}]}, "model"),
        ({"model": 5, "messages": []}, "model"),
        ({"model": "stub-model"}, "messages"),
        ({"model": "stub-model", "messages": "hi"}, "messages"),
        ({"model": "stub-model", "messages": [{"role": "user", "content": 5}]}, None),
        (chat(max_tokens=-1) | {"model": "stub-model"}, "max_tokens"),
        (chat(max_tokens=1.5) | {"model": "stub-model"}, "max_tokens"),
        (chat(max_tokens=True) | {"model": "stub-model"}, "max_tokens"),
        (chat(max_completion_tokens="9") | {"model": "stub-model"}, "max_completion_tokens"),
        (chat(max_tokens=5000) | {"model": "stub-model"}, "max_tokens"),
        (chat(stream="yes") | {"model": "stub-model"}, "stream"),
        (chat(stream_options={"include_usage": True}) | {"model": "stub-model"}, "stream_options"),
        (chat(n=0) | {"model": "stub-model"}, "n"),
    ],
)
async def test_400_for_bad_chat_bodies(
    closed: RunningGateway, body: dict[str, Any], param: str | None
) -> None:
    async with httpx.AsyncClient(base_url=closed.url, headers=AUTH) as c:
        r = await c.post("/v1/chat/completions", json=body)
    assert_error(r, 400, param=param)


async def test_400_for_bad_completions_and_json(closed: RunningGateway) -> None:
    async with httpx.AsyncClient(base_url=closed.url, headers=AUTH) as c:
        assert_error(await c.post("/v1/completions", json={"model": "stub-model"}), 400, param="prompt")
        assert_error(
            await c.post("/v1/completions", json={"model": "stub-model", "prompt": {"a": 1}}),
            400,
            param="prompt",
        )
        r = await c.post(
            "/v1/chat/completions",
            content=b'{"model": "stub-model", "messages": [',
            headers={"content-type": "application/json"},
        )
        assert_error(r, 400, code="invalid_json")
        assert_error(await c.post("/v1/chat/completions", json=[1, 2]), 400, code="invalid_json")
        r = await c.post("/v1/chat/completions", json=chat("word " * 40000) | {"model": "stub-model"})
        assert r.status_code == 413  # over max_body_bytes before any JSON parsing


async def test_415_for_a_compressed_body_after_the_key_is_checked(closed: RunningGateway) -> None:
    gz = {"content-type": "application/json", "content-encoding": "gzip"}
    body = gzip.compress(orjson.dumps(chat() | {"model": "stub-model"}))
    async with httpx.AsyncClient(base_url=closed.url) as c:
        assert_error(await c.post("/v1/chat/completions", content=body, headers=gz), 401)
        r = await c.post("/v1/chat/completions", content=body, headers=gz | AUTH)
        assert_error(r, 415, code="unsupported_content_encoding")


async def test_two_content_type_headers_are_a_clear_400_that_never_reaches_the_backend(
    gateway: RunningGateway, stub_backend: tuple[StubBackend, str]
) -> None:
    # Forwarded as they came, an engine's parser answered in its own words (aiohttp: a text/plain
    # "Duplicate 'Content-Type' header found.") or picked one of the two.
    stub, _ = stub_backend
    raw = await RawRequest.post(gateway.url, "/v1/chat/completions", chat(), {"Content-Type": "text/plain"})
    try:
        status, headers = await raw.read_head()
        body = await raw.reader.readexactly(int(headers["content-length"]))
    finally:
        await raw.close()
    assert status == 400
    error = orjson.loads(body)["error"]
    assert error["code"] == "invalid_header" and "one Content-Type" in error["message"]
    assert stub.requests == []
    assert await gateway.wait_idle() == {name: 0 for name in await gateway.in_flight()}


async def test_401s(closed: RunningGateway) -> None:
    async with httpx.AsyncClient(base_url=closed.url) as c:
        assert_error(await c.post("/v1/chat/completions", json=chat()), 401, code="missing_api_key")
        r = await c.post("/v1/chat/completions", json=chat(), headers={"authorization": "Bearer wrong"})
        assert_error(r, 401, code="invalid_api_key")
        assert "wrong" not in r.text
        r = await c.post("/v1/chat/completions", json=chat(max_tokens=1), headers={"x-api-key": "k"})
        assert r.status_code == 200
        r = await c.post("/v1/chat/completions", json=chat(max_tokens=1), headers={"api-key": "k"})
        assert r.status_code == 200


async def test_404s(closed: RunningGateway) -> None:
    async with httpx.AsyncClient(base_url=closed.url, headers=AUTH) as c:
        err = assert_error(
            await c.post("/v1/chat/completions", json=chat() | {"model": "gpt-9"}),
            404,
            code="model_not_found",
            param="model",
        )
        assert "stub-model" in err["message"]  # names the served models
        assert_error(await c.get("/nope"), 404, code="unknown_route")
        assert_error(await c.get("/v1/chat/completions"), 405)


async def test_413_body_too_large_stops_early(closed: RunningGateway) -> None:
    async with httpx.AsyncClient(base_url=closed.url, headers=AUTH) as c:
        # Declared length over the limit: refused before reading.
        r = await c.post(
            "/v1/chat/completions", content=b"x" * 5000, headers={"content-type": "application/json"}
        )
        assert_error(r, 413, code="request_too_large")

        # Chunked upload without a length: refused once the limit is crossed.
        async def body():  # type: ignore[no-untyped-def]
            for _ in range(100):
                yield b" " * 500

        r = await c.post("/v1/chat/completions", content=body(), headers={"content-type": "application/json"})
        assert_error(r, 413, code="request_too_large")


async def test_413_cost_can_never_fit(closed: RunningGateway) -> None:
    async with httpx.AsyncClient(base_url=closed.url, headers=AUTH) as c:
        r = await c.post("/v1/chat/completions", json=chat(max_tokens=4000, n=6))
    err = assert_error(r, 413, code="cost_exceeds_capacity")
    assert "20000" in err["message"] or "tenant" in err["message"]
    assert r.headers["x-tokengate-cost"] == str(int(r.headers["x-tokengate-cost"]))


async def test_429_queue_full_with_retry_after(closed: RunningGateway) -> None:
    holder = await RawRequest.post(
        closed.url,
        "/v1/chat/completions",
        chat(stream=True, max_tokens=4000, n=4),
        {**AUTH, "x-stub-chunks": "500", "x-stub-interval": "0.01"},
    )
    assert (await holder.read_head())[0] == 200
    async with httpx.AsyncClient(base_url=closed.url, headers=AUTH) as c:
        r = await c.post("/v1/chat/completions", json=chat(max_tokens=4000, n=2))
    assert_error(r, 429, code="queue_full")
    assert r.headers["retry-after"].isdigit() and int(r.headers["retry-after"]) >= 1
    await holder.close()
    assert await closed.wait_idle() == {"tenant:t": 0, "backend:default": 0}


def _junk(rng: random.Random, depth: int = 0) -> Any:
    choices: list[Any] = [
        None,
        True,
        False,
        -1,
        0,
        2**70,
        1.5,
        -0.0,
        "",
        "x" * rng.randint(0, 30),
        "\u0000\ud7ff",
    ]
    if depth < 2:
        choices += [[_junk(rng, depth + 1) for _ in range(rng.randint(0, 3))], {"k": _junk(rng, depth + 1)}]
    return rng.choice(choices)


async def test_bad_input_never_500(gateway: RunningGateway) -> None:
    rng = random.Random(1234)
    fields = [
        "model",
        "messages",
        "prompt",
        "max_tokens",
        "max_completion_tokens",
        "n",
        "stream",
        "stream_options",
        "tools",
        "best_of",
        "input",
        "suffix",
        "response_format",
    ]
    async with httpx.AsyncClient(base_url=gateway.url) as c:
        for i in range(250):
            path = rng.choice(["/v1/chat/completions", "/v1/completions", "/v1/embeddings"])
            body: dict[str, Any] = {
                "model": "stub-model",
                "messages": [{"role": "user", "content": "hi"}],
                "prompt": "hi",
                "input": "hi",
            }
            for _ in range(rng.randint(1, 3)):
                body[rng.choice(fields)] = _junk(rng)
            try:
                raw = orjson.dumps(body, option=orjson.OPT_PASSTHROUGH_SUBCLASS)
            except TypeError:
                raw = b'{"model": ' + str(2**70).encode() + b"}"
            if i % 10 == 0:
                raw = raw[: rng.randint(0, len(raw))]
            r = await c.post(path, content=raw, headers={"content-type": "application/json"})
            assert r.status_code != 500, (body, r.text)
            if r.status_code >= 400:
                assert set(r.json()["error"]) == {"message", "type", "param", "code"}
    assert await gateway.wait_idle() == {"tenant:default": 0, "backend:default": 0}
    text = (await httpx.AsyncClient(base_url=gateway.url).get("/metrics")).text
    assert 'outcome="internal_error"} 1' not in text

"""A request carrying token ids an engine cannot index never reaches the engine.

One request with an out-of-vocabulary ``stop_token_ids`` entry, or more ``allowed_token_ids`` than
the sampler's row holds, shut a shared vLLM down for every tenant on it (vLLM #54195, #55164). Over
real sockets: the 400 is OpenAI's error shape naming the field and the bound, the backend never
sees the request, and nothing stays held."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from tests.conftest import GatewayFactory, StubBackend, stub_pools

VOCAB = 32_000


def config(url: str) -> dict[str, object]:
    return {
        "pools": stub_pools(url, capacity=200_000),
        "tenants": {"t": {"keys": ["k"], "budget_tokens": 20_000}},
        "models": {"stub-*": {"vocab_size": VOCAB}},
    }


def chat(**extra: Any) -> dict[str, Any]:
    return {"model": "stub-model", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}], **extra}


@pytest.mark.parametrize(
    ("path", "body", "param", "words"),
    [
        ("/v1/chat/completions", chat(stop_token_ids=[151645]), "stop_token_ids", ("32000", "vocab_size")),
        ("/v1/chat/completions", chat(stop_token_ids=[-1], min_tokens=1), "stop_token_ids", ("negative",)),
        (
            "/v1/chat/completions",
            chat(allowed_token_ids=list(range(2000))),
            "allowed_token_ids",
            ("1024", "pricing.max_allowed_token_ids"),
        ),
        ("/v1/chat/completions", chat(logit_bias={"99999": 5}), "logit_bias", ("32000",)),
        (
            "/v1/completions",
            {"model": "stub-model", "max_tokens": 5, "prompt": [1, 2, VOCAB]},
            "prompt",
            ("32000",),
        ),
        ("/v1/embeddings", {"model": "stub-model", "input": [[5], [VOCAB + 1]]}, "input", ("32000",)),
    ],
)
async def test_ids_an_engine_cannot_index_are_a_400_the_backend_never_sees(
    stub_backend: tuple[StubBackend, str],
    gateway_factory: GatewayFactory,
    path: str,
    body: dict[str, Any],
    param: str,
    words: tuple[str, ...],
) -> None:
    stub, url = stub_backend
    gw = await gateway_factory(config(url))
    async with httpx.AsyncClient(headers={"authorization": "Bearer k"}) as c:
        r = await c.post(gw.url + path, json=body)
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["type"] == "invalid_request_error" and error["param"] == param
        assert all(w in error["message"] for w in words), error["message"]
        assert url.split("//")[1] not in r.text
        assert stub.requests == []
        # The same field with ids in range goes through.
        ok = await c.post(gw.url + "/v1/chat/completions", json=chat(stop_token_ids=[VOCAB - 1]))
        assert ok.status_code == 200, ok.text
    assert len(stub.requests) == 1
    assert await gw.wait_idle() == {name: 0 for name in await gw.in_flight()}

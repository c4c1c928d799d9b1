"""A background response cannot run outside the budget.

With ``background: true`` an engine's Responses API (vLLM with its response store on) answers at
once with a queued response and generates afterwards, for as long as ``max_output_tokens`` allows.
The gateway's lease ends with that first answer, so every such request would run on the GPU with
none of its tokens held: a tenant with a 20,000-token budget could keep any number of 5,000-token
generations running. Such requests are refused before anything is held or forwarded."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from classifiers import InvalidRequest, Pricer, TokenizerRegistry
from tests.conftest import GatewayFactory, StubBackend, stub_pools

LIMITS: dict[str, Any] = {"default_max_tokens": 16, "max_tokens_limit": None, "context_length": 8192}


def body(**extra: Any) -> dict[str, Any]:
    return {"model": "stub-model", "input": "write a long story", "max_output_tokens": 5000, **extra}


@pytest.mark.parametrize("value", [True, "yes", "true", 1, {}, [True]])
async def test_any_background_a_lax_parser_could_read_as_true_is_refused(value: object) -> None:
    with pytest.raises(InvalidRequest) as info:
        await Pricer(TokenizerRegistry()).aprice_responses(body(background=value), **LIMITS)
    assert info.value.param == "background" and info.value.code == "unsupported_parameter"


@pytest.mark.parametrize("value", [False, None])
async def test_a_foreground_response_is_priced_as_before(value: object) -> None:
    pricer = Pricer(TokenizerRegistry())
    assert await pricer.aprice_responses(body(background=value), **LIMITS) == await pricer.aprice_responses(
        body(), **LIMITS
    )


async def test_background_responses_never_reach_the_backend_and_hold_nothing(
    stub_backend: tuple[StubBackend, str], gateway_factory: GatewayFactory
) -> None:
    stub, url = stub_backend
    gw = await gateway_factory(
        {
            "pools": stub_pools(url, capacity=200_000),
            "tenants": {"t": {"keys": ["k"], "budget_tokens": 20_000}},
        }
    )
    async with httpx.AsyncClient(headers={"authorization": "Bearer k"}) as c:
        for _ in range(10):  # 10 x 5,000 output tokens against a 20,000-token budget
            r = await c.post(gw.url + "/v1/responses", json=body(background=True, store=True))
            assert r.status_code == 400, r.text
            error = r.json()["error"]
            assert error["code"] == "unsupported_parameter" and error["param"] == "background"
            assert "budget" in error["message"]
        assert stub.requests == []
        ok = await c.post(gw.url + "/v1/responses", json=body(background=False))
        assert ok.status_code == 200, ok.text
    assert await gw.wait_idle() == {name: 0 for name in await gw.in_flight()}

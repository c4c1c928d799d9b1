"""What the server adds to a Responses request counts against the budget, when asked to.

With its response store on, an engine prepends a stored conversation to a request that names it
(``previous_response_id``, ``conversation``, a stored ``prompt``, ``item_reference`` items), and with
a tool server it runs built-in tools whose turns grow the context; the gateway sees none of it. A
tenant on a 20,000-token budget could keep a 100,000-token history in flight, priced at its last
line. With ``pricing.server_state_at_context`` such a request holds the model's whole context."""

from __future__ import annotations

from typing import Any

import httpx

from tests.conftest import GatewayFactory, StubBackend, stub_pools

CONTEXT = 16_000


def config(url: str, at_context: bool, budget: int = 40_000) -> dict[str, object]:
    return {
        "pools": stub_pools(url, capacity=200_000),
        "tenants": {"t": {"keys": ["k"], "budget_tokens": budget}},
        "models": {"stub-*": {"context_length": CONTEXT}},
        "pricing": {"server_state_at_context": at_context},
    }


def follow_up(**extra: Any) -> dict[str, Any]:
    return {"model": "stub-model", "input": "and then?", "max_output_tokens": 200, **extra}


async def test_a_follow_up_on_stored_state_holds_the_whole_context(
    stub_backend: tuple[StubBackend, str], gateway_factory: GatewayFactory
) -> None:
    _, url = stub_backend
    gw = await gateway_factory(config(url, at_context=True))
    async with httpx.AsyncClient(headers={"authorization": "Bearer k"}) as c:
        for extra in ({"previous_response_id": "resp_9"}, {"tools": [{"type": "web_search_preview"}]}):
            r = await c.post(gw.url + "/v1/responses", json=follow_up(**extra))
            assert r.status_code == 200, r.text
            assert int(r.headers["x-tokengate-cost"]) == CONTEXT
        plain = await c.post(gw.url + "/v1/responses", json=follow_up())
        assert int(plain.headers["x-tokengate-cost"]) < 300
    assert await gw.wait_idle() == {name: 0 for name in await gw.in_flight()}


async def test_a_budget_below_the_context_refuses_them_saying_why(
    stub_backend: tuple[StubBackend, str], gateway_factory: GatewayFactory
) -> None:
    stub, url = stub_backend
    gw = await gateway_factory(config(url, at_context=True, budget=10_000))
    async with httpx.AsyncClient(headers={"authorization": "Bearer k"}) as c:
        r = await c.post(gw.url + "/v1/responses", json=follow_up(previous_response_id="resp_9"))
        assert r.status_code == 413, r.text
        assert "budget_tokens" in r.json()["error"]["message"]
    assert stub.requests == []


async def test_off_by_default_only_the_visible_body_is_priced(
    stub_backend: tuple[StubBackend, str], gateway_factory: GatewayFactory
) -> None:
    _, url = stub_backend
    gw = await gateway_factory(config(url, at_context=False))
    async with httpx.AsyncClient(headers={"authorization": "Bearer k"}) as c:
        r = await c.post(gw.url + "/v1/responses", json=follow_up(previous_response_id="resp_9"))
        assert r.status_code == 200 and int(r.headers["x-tokengate-cost"]) < 300

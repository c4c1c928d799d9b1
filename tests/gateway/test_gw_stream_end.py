"""A stream's end: a client that hangs up once it has read ``data: [DONE]`` (as the official SDKs
do) has a completed request, with its usage; an engine that never sends usage gets it estimated,
marked so, and named per backend. Over real sockets, against the stub backend."""

from __future__ import annotations

import logging
from typing import Any

import httpx
import pytest

from gateway.observe.diagnose import diagnose
from tests.conftest import GatewayFactory, StubBackend, stub_pools
from tests.gateway.gw_support import access_lines, chat
from tests.support import eventually


async def read_to_done_and_hang_up(url: str, body: dict[str, Any], headers: dict[str, str]) -> list[str]:
    """What the official SDK does: read events until ``data: [DONE]``, then close the connection."""
    events = []
    async with httpx.AsyncClient(base_url=url) as c:
        async with c.stream("POST", "/v1/chat/completions", json=body, headers=headers) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if line.startswith("data:"):
                    events.append(line)
                    if line == "data: [DONE]":
                        break
    return events


@pytest.mark.parametrize("include_usage", [True, False])
async def test_a_client_that_hangs_up_after_done_has_a_completed_request_with_its_usage(
    stub_backend: tuple[StubBackend, str],
    gateway_factory: GatewayFactory,
    caplog: pytest.LogCaptureFixture,
    include_usage: bool,
) -> None:
    _stub, url = stub_backend
    gw = await gateway_factory({"pools": stub_pools(url)})
    caplog.set_level(logging.INFO, logger="tokengate.access")
    body = chat(stream=True, max_tokens=20)
    if include_usage:
        body["stream_options"] = {"include_usage": True}
    # The engine keeps the connection open a while after [DONE]: the client is gone before its end.
    events = await read_to_done_and_hang_up(gw.url, body, {"x-stub-chunks": "4", "x-stub-linger": "2"})
    assert events[-1] == "data: [DONE]" and len(events) == 4 + 1 + include_usage + 1

    async def logged() -> bool:
        return len(access_lines(caplog)) == 1

    await eventually(logged, message="no access line")
    [line] = access_lines(caplog)
    assert (line["status"], line["outcome"], line["reason"]) == (200, "ok", None)
    assert (line["prompt_tokens"], line["completion_tokens"], line["usage_estimated"]) == (11, 4, None)
    assert not any((await gw.in_flight()).values())
    [backend] = list(gw.app.router.backends)
    assert (backend.usage_reported, backend.usage_missing) == (1, 0)


async def test_a_client_that_hangs_up_before_done_is_still_a_disconnect(
    stub_backend: tuple[StubBackend, str], gateway_factory: GatewayFactory, caplog: pytest.LogCaptureFixture
) -> None:
    stub, url = stub_backend
    gw = await gateway_factory({"pools": stub_pools(url)})
    caplog.set_level(logging.INFO, logger="tokengate.access")
    async with httpx.AsyncClient(base_url=gw.url) as c:
        headers = {"x-stub-chunks": "50", "x-stub-interval": "0.05"}
        async with c.stream("POST", "/v1/chat/completions", json=chat(stream=True), headers=headers) as r:
            async for line in r.aiter_lines():
                if line.startswith("data:"):
                    break  # one event, then gone

    async def logged() -> bool:
        return len(access_lines(caplog)) == 1

    await eventually(logged, message="no access line")
    [line] = access_lines(caplog)
    assert (line["status"], line["outcome"]) == (499, "client_disconnect")
    await eventually(lambda: stub.requests[-1].cancelled_at is not None, message="engine not told")


async def test_an_engine_that_never_sends_usage_gets_it_estimated_and_marked(
    stub_backend: tuple[StubBackend, str], gateway_factory: GatewayFactory, caplog: pytest.LogCaptureFixture
) -> None:
    _stub, url = stub_backend
    gw = await gateway_factory({"pools": stub_pools(url)})
    caplog.set_level(logging.INFO, logger="tokengate.access")
    headers = {"x-stub-no-usage": "1", "x-stub-chunks": "6"}
    async with httpx.AsyncClient(base_url=gw.url) as c:
        streamed = await c.post(
            "/v1/chat/completions", json=chat(stream=True, max_tokens=20), headers=headers
        )
        whole = await c.post("/v1/chat/completions", json=chat(max_tokens=20), headers=headers)
    assert streamed.status_code == whole.status_code == 200
    # The gateway asked for include_usage and the engine ignored it: nothing of that reaches the client.
    assert b'"usage"' not in streamed.content
    s, w = access_lines(caplog)
    prefill = s["prefill"]
    # Output: the relayed events (6 tokens and the finish event), not the [DONE] line.
    assert (s["prompt_tokens"], s["completion_tokens"], s["usage_estimated"]) == (prefill, 7, True)
    assert (w["prompt_tokens"], w["completion_tokens"], w["usage_estimated"]) == (w["prefill"], None, True)
    [backend] = list(gw.app.router.backends)
    assert (backend.usage_reported, backend.usage_missing) == (0, 2)
    stats = (await httpx.AsyncClient().get(f"{gw.ops_url}/stats")).json()
    [entry] = stats["backends"]
    assert (entry["usage_reported"], entry["usage_missing"]) == (0, 2)
    [finding] = [f for f in diagnose(stats) if f.topic == "usage"]
    assert finding.level == "warn" and f"backend {entry['backend']}" in finding.text
    assert "never reports usage (2 answers)" in finding.text
    assert not any((await gw.in_flight()).values())

"""The access log, metrics and request hooks never raise, whatever the client or backend put into a
request's record: lying usage reports and extreme values still give one log line, a healthy
/metrics and pools back at zero."""

from __future__ import annotations

import logging
import math
from time import perf_counter

import httpx
import pytest

from gateway.observe.accesslog import Record
from tests.adversarial.backends import LyingUsage
from tests.conftest import GatewayFactory, serve_asgi, stub_pools

LIES = [
    b'{"prompt_tokens":-5,"completion_tokens":-1}',
    b'{"prompt_tokens":1180591620717411303424,"completion_tokens":99999999999999999999999}',
    b'{"prompt_tokens":"12","completion_tokens":true}',
    b'{"prompt_tokens":1.5e308,"completion_tokens":NaN}',
    b"[1,2,3]",
    b'"lots"',
    b"null",
    b'{"completion_tokens":{"nested":{"deeper":[1]}}}',
]


@pytest.mark.parametrize("usage", LIES)
@pytest.mark.parametrize("stream", [False, True])
async def test_a_backend_lying_about_usage_cannot_break_bookkeeping(
    gateway_factory: GatewayFactory, usage: bytes, stream: bool, caplog: pytest.LogCaptureFixture
) -> None:
    served = await serve_asgi(LyingUsage())
    try:
        gw = await gateway_factory(
            {"pools": stub_pools(served.url), "tenants": {"t": {"keys": ["k"], "budget_tokens": 5000}}}
        )
        caplog.set_level(logging.INFO, logger="tokengate.access")
        body = {
            "model": "stub-model",
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 8,
            "stream": stream,
        }
        async with httpx.AsyncClient(base_url=gw.url, headers={"authorization": "Bearer k"}) as c:
            r = await c.post("/v1/chat/completions", json=body, headers={"x-usage": usage.decode()})
            assert r.status_code == 200
            metrics = await c.get(gw.ops_url + "/metrics")
            assert metrics.status_code == 200
        assert "tokengate_requests_total" in metrics.text
        assert await gw.wait_idle() == {name: 0 for name in await gw.in_flight()}
        lines = [rec for rec in caplog.records if rec.name == "tokengate.access"]
        assert len(lines) == 1 and '"status":200' in lines[0].getMessage()
        assert not [rec for rec in caplog.records if rec.levelno >= logging.ERROR]
    finally:
        await served.stop()


def test_the_access_line_is_written_for_extreme_values(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="tokengate.access")
    rec = Record(method="POST", path="/v1/" + "a" * 100_000, start=perf_counter())
    rec.prefill = 2**63 - 1
    rec.decode = 2**70  # the sum is beyond 64 bits: orjson refuses it
    rec.tenant = "t\ud800"  # a lone surrogate
    rec.queue_s = math.inf
    rec.ttft_s = math.nan
    rec.prompt_tokens = -(2**80)
    rec.error = "e" * 1_000_000
    rec.emit(perf_counter())
    [line] = [r.getMessage() for r in caplog.records if r.name == "tokengate.access"]
    assert str(2**63 - 1 + 2**70) in line
    assert len(line) < 5000  # the path and the error are clipped

"""The head-of-line probe measures short requests alone and beside a long one, over real sockets."""

from __future__ import annotations

from loadtest import hol_probe
from tests.loadtest.conftest import StubFactory


async def test_probe_reports_both_runs_and_the_long_requests_ttft(stub_factory: StubFactory) -> None:
    stub = await stub_factory(first_token_delay_s=0.01, inter_token_delay_s=0.001)
    args = hol_probe.parse_args(
        ["--url", stub.url, "--shorts", "4", "--rate", "50", "--long-tokens", "500"],
    )
    result = await hol_probe.amain(args)
    alone, beside = result["alone"], result["beside_long"]
    assert isinstance(alone, dict) and isinstance(beside, dict)
    assert alone["ok"] == alone["shorts"] == 4 and beside["ok"] == beside["shorts"] == 4
    assert alone["long_ttft_ms"] is None
    assert beside["long_ttft_ms"] is not None and beside["long_ttft_ms"] >= 10.0
    assert alone["ttft_p50_ms"] >= 10.0  # the stub's first-token delay is measured, not assumed
    assert stub.requests == 2 + 4 + 4 + 1  # two warm-ups, the shorts twice, one long

"""loadtest.bench.held_memory: the gateway's memory against the request bodies it holds."""

from __future__ import annotations

import asyncio

import pytest

from loadtest.bench import held_memory


def test_a_small_run_holds_its_bodies_and_reports_the_factor(capsys: pytest.CaptureFixture[str]) -> None:
    r = asyncio.run(held_memory.measure(tenants=2, per_tenant=2, body_bytes=300_000, hold_s=1.5))
    assert r["bodies"] == 4 and r["statuses"] == [200]
    assert r["held_mib"] > 0 and r["rss_peak_mib"] >= r["rss_before_mib"] > 0


def test_nonpositive_sizes_are_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        held_memory.main(["--tenants", "0"])
    assert exc.value.code == 2 and "must be positive" in capsys.readouterr().err

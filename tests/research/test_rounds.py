"""The rounds benchmark (``python -m research.rounds``), run for real at a small size."""

from __future__ import annotations

import json
from pathlib import Path

from loadtest.bench.scale import IN_FLIGHT
from research import rounds


def test_a_round_serves_every_tenant_once_and_reports_its_worst_pass_and_the_newcomer(tmp_path: Path) -> None:
    out = tmp_path / "rounds.json"
    assert rounds.main(["--tenants", "50", "--tickets-per-tenant", "2", "--json", str(out)]) == 0
    [row] = json.loads(out.read_text())["rounds"]
    assert (row["tenants"], row["tickets"]) == (50, 100)
    assert row["tenants_served"] == 50 and 50 <= row["cycles"] <= 50 + IN_FLIGHT
    assert 0 <= row["worst_pass_cycle"] < row["cycles"]  # one pass per cycle
    p = row["grant_pass"]
    assert 0 < p["p50_ms"] <= p["p99_ms"] <= p["max_ms"]
    assert row["newcomer_enqueue_ms"] > 0


def test_a_round_serves_every_tenant_as_it_claims() -> None:
    # The round the docstring describes: every tenant served, in at most IN_FLIGHT cycles more than
    # tenants (the tenants the full pool was granted to before the round were charged already).
    row = rounds.one_round(200, 3, 1e-2)  # a long step: heads age and are promoted mid-round
    assert row["tenants_served"] == 200 and row["cycles"] <= 200 + IN_FLIGHT

"""The isolation table (victim vs the victim alone, what the noisy tenant got) and value checks."""

from __future__ import annotations

import pytest

from loadtest.checks import evaluate, parse_checks
from loadtest.distributions import SpecError
from loadtest.isolation import isolation_markdown, isolation_rows
from loadtest.records import RequestRecord, RunResult
from loadtest.report import markdown, results_json
from loadtest.spec import WorkloadSpec, parse_workload


def spec(**extra: object) -> WorkloadSpec:
    raw: dict[str, object] = {
        "duration_s": 10,
        "tenants": {"chat": {}, "agent": {}},
        "classes": {
            "victim": {"tenant": "chat", "rate": 1, "prompt_tokens": 10, "output_tokens": 4},
            "noisy": {"tenant": "agent", "rate": 1, "prompt_tokens": 10, "output_tokens": 4},
        },
        "isolation": {
            "victim": "victim",
            "noisy": "noisy",
            "direct": "direct",
            "solo": {"direct": "solo", "gw": "solo"},
        },
    }
    raw.update(extra)
    return parse_workload(raw)


def rec(
    i: int, group: str, *, ttft: float, gap: float = 0.02, queue_ms: float | None = None, ok: bool = True
) -> RequestRecord:
    r = RequestRecord(i, group, group, group, "u", 10, 4, scheduled_s=float(i), sent_s=float(i))
    if not ok:
        r.error, r.e2e_s = "timeout", 1.0
        return r
    r.status, r.ttft_s, r.gateway_queue_ms = 200, ttft, queue_ms
    r.token_times = [i + ttft + k * gap for k in range(4)]
    r.completion_tokens, r.e2e_s = 4, ttft + 3 * gap
    return r


def run(name: str, victim_ttft: float, noisy: list[RequestRecord], elapsed: float = 10.0) -> RunResult:
    victims = [rec(i, "victim", ttft=victim_ttft) for i in range(5)]
    return RunResult(name, ("u",), victims + noisy, elapsed_s=elapsed, planned=len(victims) + len(noisy))


RUNS = [
    run("solo", 0.1, []),
    run("direct", 1.0, [rec(10, "noisy", ttft=2.0), rec(11, "noisy", ttft=3.0)]),
    run(
        "gw",
        0.15,
        [rec(10, "noisy", ttft=5.0, queue_ms=4000.0), rec(11, "noisy", ttft=0, ok=False)],
        elapsed=20.0,
    ),
]


def test_rows_compare_the_victim_with_its_solo_run_and_summarise_the_noisy_tenant() -> None:
    rows = {r.target: r for r in isolation_rows(spec(), RUNS)}
    assert rows["solo"].victim_ttft_p99_vs_solo is None and rows["solo"].noisy_requests == 0
    direct, gw = rows["direct"], rows["gw"]
    assert direct.victim_ttft_p99_vs_solo == pytest.approx(10.0)
    assert direct.victim_itl_p99_vs_solo == pytest.approx(1.0)
    assert direct.noisy_queue_p99_s is None  # no gateway, no queue header
    assert direct.tokens_per_s_vs_direct == pytest.approx(1.0)
    assert gw.victim_ttft_p99_vs_solo == pytest.approx(1.5)
    assert (gw.noisy_ok, gw.noisy_requests) == (1, 2)
    assert gw.noisy_ttft_p50_s == pytest.approx(5.0) and gw.noisy_queue_p99_s == pytest.approx(4.0)
    assert gw.tokens_per_s_vs_direct == pytest.approx((24 / 20) / (28 / 10))


def test_the_table_is_in_the_markdown_report_and_the_json() -> None:
    s = spec()
    table = isolation_markdown(s, RUNS)
    assert "| gw | solo | 150 / 150 | 1.50× |" in table
    assert "| 1/2 | 5.0 / 5.0 | 4.0 |" in table
    assert table in markdown(s, RUNS, [])
    assert [r["target"] for r in results_json(s, RUNS, [])["isolation"]] == ["solo", "direct", "gw"]
    assert isolation_markdown(parse_workload_without_isolation(), RUNS) == ""


def parse_workload_without_isolation() -> WorkloadSpec:
    return parse_workload(
        {
            "duration_s": 10,
            "tenants": {"chat": {}},
            "classes": {"victim": {"tenant": "chat", "rate": 1, "prompt_tokens": 10, "output_tokens": 4}},
        }
    )


def test_isolation_names_must_be_groups_and_phases() -> None:
    with pytest.raises(SpecError, match=r"isolation\.noisy"):
        spec(isolation={"victim": "victim", "noisy": "nope", "solo": {}})
    with pytest.raises(SpecError, match=r"isolation\.phase"):
        spec(isolation={"victim": "victim", "noisy": "noisy", "solo": {}, "phase": "never"})


def test_value_checks_bound_a_number_without_a_baseline() -> None:
    s = spec()
    checks = parse_checks(
        [
            {
                "name": "queue",
                "kind": "value",
                "metric": "queue_p99_ms",
                "group": "noisy",
                "target": "gw",
                "max": 10000,
            },
            {"name": "all done", "kind": "value", "metric": "failed", "target": "gw", "max": 0},
            {"name": "all done direct", "kind": "value", "metric": "failed", "target": "direct", "max": 0},
            {
                "name": "queue direct",
                "kind": "value",
                "metric": "queue_p99_ms",
                "group": "noisy",
                "target": "direct",
                "max": 1,
            },
        ],
        s,
    )
    queue, failed_gw, failed_direct, no_queue = (evaluate(c, RUNS, s) for c in checks)
    assert queue.met is True and "4,000 ms" in queue.summary
    assert failed_gw.met is False and "1.0" in failed_gw.summary
    assert failed_direct.met is True
    assert no_queue.met is None  # direct sends no queue header: nothing to judge
    with pytest.raises(SpecError, match="min and/or max"):
        parse_checks([{"kind": "value", "metric": "failed", "target": "gw"}], s)
    with pytest.raises(SpecError, match="metric"):
        parse_checks([{"kind": "value", "metric": "nope", "target": "gw", "max": 1}], s)

"""Value checks and the summary table: one row per target, the columns a scenario names."""

from typing import Any

import pytest

from loadtest.checks import evaluate, parse_checks
from loadtest.distributions import SpecError
from loadtest.records import RequestRecord, RunResult
from loadtest.scenario import parse_scenario
from loadtest.spec import parse_workload
from loadtest.summary import parse_summary, summary_markdown, summary_rows

WORKLOAD: dict[str, Any] = {
    "name": "arms",
    "duration_s": 10,
    "tenants": {"chat": {"key": "sk-chat"}},
    "classes": {"chat": {"tenant": "chat", "rate": 1, "prompt_tokens": 10, "output_tokens": 5}},
}


def _run(target: str, tokens: int, elapsed_s: float, preemptions: float | None) -> RunResult:
    records = []
    for i in range(4):
        rec = RequestRecord(i, "chat", "chat", "chat", "u", 10, None, scheduled_s=float(i), sent_s=float(i))
        rec.ttft_s, rec.e2e_s, rec.completion_tokens = 0.1 * (i + 1), 1.0 * (i + 1), tokens
        rec.token_times = [float(i) + 0.1]
        records.append(rec)
    return RunResult(target, ("u",), records, elapsed_s, 4, backend_preemptions=preemptions)


def test_the_summary_shows_each_target_with_ratios_to_another() -> None:
    spec = parse_workload(WORKLOAD)
    columns = parse_summary(
        [
            "tokens_per_s",
            {"metric": "tokens_per_s", "relative_to": "slow"},
            "preemptions_per_request",
            {"metric": "e2e_mean_s", "group": "chat"},
        ],
        spec,
    )
    warmup = _run("warmup", 10, 1.0, 0)
    warmup.records = warmup.records[:2]  # other requests: no ratio to the others
    runs = [_run("slow", 10, 4.0, 0), _run("fast", 10, 2.0, None), warmup]
    md = summary_markdown(spec, runs, columns)
    assert md.splitlines()[0] == (
        "| target | generated tokens/s | generated tokens/s ÷ slow | backend preemptions / request "
        "| chat E2E mean |"
    )
    assert md.splitlines()[2] == "| slow | 10.0 | 1.00× | 0.00% | 2500 ms |"
    assert md.splitlines()[3] == "| fast | 20.0 | 2.00× | – | 2500 ms |"  # preemptions not measured
    assert md.splitlines()[4] == "| warmup | 20.0 | – | 0.00% | 1500 ms |"
    rows = summary_rows(spec, runs, columns)
    assert rows[1]["values"]["generated tokens/s ÷ slow"] == pytest.approx(2.0)


@pytest.mark.parametrize(
    ("summary", "message"),
    [
        ("tokens_per_s", "summary: expected a list"),
        (["speed"], "summary[0].metric: expected one of"),
        ([{"metric": "ttft_p99_s", "group": "nope"}], "summary[0].group: 'nope' is not a request group"),
        ([{"metric": "tokens_per_s", "relative_to": "ghost"}], "relative to 'ghost', not in setup.targets"),
        ([{"metric": "tokens_per_s", "colour": "red"}], "summary[0].colour: unknown key"),
    ],
)
def test_a_bad_summary_names_the_problem(summary: Any, message: str) -> None:
    raw = {**WORKLOAD, "summary": summary, "setup": {"targets": [{"name": "slow", "direct": True}]}}
    with pytest.raises(SpecError) as err:
        parse_scenario(raw)
    assert message in str(err.value)


def test_a_value_check_bounds_one_number() -> None:
    spec = parse_workload(WORKLOAD)
    checks = parse_checks(
        [
            {"name": "few preemptions", "kind": "value", "metric": "preemptions_per_request", "target": "a",
             "max": 0.01},
            {"name": "fast enough", "kind": "value", "metric": "tokens_per_s", "target": "a", "min": 15},
        ],
        spec,
    )  # fmt: skip
    few, fast = checks
    assert evaluate(few, [_run("a", 10, 2.0, 0)], spec).met is True
    result = evaluate(few, [_run("a", 10, 2.0, 1)], spec)
    assert result.met is False and result.summary == "25.00% [a] (want <= 1.00%)"
    assert evaluate(few, [_run("a", 10, 2.0, None)], spec).met is None  # not measured
    assert evaluate(fast, [_run("a", 10, 2.0, 0)], spec).met is True
    assert evaluate(fast, [_run("a", 10, 4.0, 0)], spec).met is False
    with pytest.raises(SpecError, match="give min and/or max"):
        parse_checks([{"kind": "value", "metric": "tokens_per_s", "target": "a"}], spec)

import pytest

from loadtest.records import RequestRecord, RunResult
from loadtest.spec import parse_workload
from loadtest.stats import fair_shares, group_stats, p99_over_time, totals


def _rec(
    i: int, tenant: str, *, sent: float, ttft: float, tokens: int = 4, error: str | None = None
) -> RequestRecord:
    rec = RequestRecord(
        index=i,
        cls="c",
        group="g",
        tenant=tenant,
        url="u",
        planned_prompt_tokens=10,
        max_tokens=tokens,
        scheduled_s=sent,
        sent_s=sent,
        status=200 if error is None else 429,
        error=error,
    )
    if error is None:
        rec.ttft_s = ttft
        rec.prompt_tokens = 10
        rec.token_times = [sent + ttft + k * 0.1 for k in range(tokens)]
        rec.completion_tokens = tokens
        rec.e2e_s = ttft + (tokens - 1) * 0.1
    else:
        rec.e2e_s = 0.001
    return rec


def test_group_stats_and_totals() -> None:
    records = [_rec(i, "a", sent=i * 0.1, ttft=0.01 * (i + 1)) for i in range(10)]
    records.append(_rec(10, "a", sent=1.0, ttft=0.0, error="http_429"))
    run = RunResult("t", ("u",), records, elapsed_s=2.0, planned=11)
    stats = group_stats(run, ["g"])["g"]
    assert stats.requests == 11 and stats.ok == 10 and stats.errors == {"http_429": 1}
    assert stats.ttft_p50_s == pytest.approx(0.055)
    assert stats.itl_p50_s == pytest.approx(0.1)
    assert stats.tokens_per_s == pytest.approx(40 / 2.0)
    t = totals(run)
    assert t.completion_tokens == 40 and t.errors == {"http_429": 1}


def test_p99_over_time_follows_a_spike() -> None:
    records = [_rec(i, "a", sent=i * 0.25, ttft=1.0 if 20 <= i < 28 else 0.01) for i in range(60)]
    run = RunResult("t", ("u",), records, elapsed_s=16.0, planned=60)
    series = dict(p99_over_time(run, "g", window_s=2.0, step_s=1.0))
    assert max(series.values()) == pytest.approx(1.0)
    assert series[1.0] == pytest.approx(0.01)  # before the spike


def test_fair_shares_count_tokens_delivered_inside_the_phase() -> None:
    spec = parse_workload(
        {
            "duration_s": 10,
            "tenants": {"a": {"weight": 1}, "b": {"weight": 2}},
            "classes": {
                "ca": {"tenant": "a", "rate": 1, "prompt_tokens": 10, "output_tokens": 4},
                "cb": {"tenant": "b", "rate": 1, "prompt_tokens": 10, "output_tokens": 4},
            },
            "phases": {"busy": [[0, 5]]},
            "fairness": {"tenants": ["a", "b"], "phase": "busy"},
        }
    )
    # a: one request inside the phase; b: two inside, one entirely after it (not counted)
    records = [
        _rec(0, "a", sent=1.0, ttft=0.1),
        _rec(1, "b", sent=1.0, ttft=0.1),
        _rec(2, "b", sent=2.0, ttft=0.1),
        _rec(3, "b", sent=7.0, ttft=0.1),
    ]
    shares = {s.tenant: s for s in fair_shares(RunResult("t", ("u",), records, 9.0, 4), spec)}
    assert shares["a"].served_tokens == 14 and shares["b"].served_tokens == 28
    assert shares["a"].share == pytest.approx(1 / 3) and shares["b"].weight_share == pytest.approx(2 / 3)
    assert shares["a"].relative_error == pytest.approx(0.0)


def test_mean_latency_reserved_output_and_preemptions_per_request() -> None:
    records = [_rec(i, "a", sent=0.0, ttft=0.1, tokens=4) for i in range(4)]
    for rec, cost in zip(records, (10 + 40, 10 + 40, 10 + 4, None), strict=True):
        rec.gateway_cost = cost  # prompt (10) + the output reserved at admission
    run = RunResult("t", ("u",), records, elapsed_s=1.0, planned=4, backend_preemptions=2)
    stats = group_stats(run, ["g"])["g"]
    assert stats.e2e_mean_s == pytest.approx(0.1 + 3 * 0.1)
    t = totals(run)
    assert t.reserved_output_ratio == pytest.approx((40 + 40 + 4) / 12)  # the request without a cost left out
    assert t.preemptions == 2 and t.preemptions_per_request == pytest.approx(0.5)
    bare = totals(RunResult("t", ("u",), records[3:], elapsed_s=1.0, planned=1))
    assert bare.reserved_output_ratio is None and bare.preemptions_per_request is None

import itertools
import statistics
from typing import Any

import pytest

from loadtest.distributions import SpecError
from loadtest.schedule import build_schedule
from loadtest.spec import parse_workload


def _workload(**over: Any) -> dict[str, Any]:
    raw: dict[str, Any] = {
        "name": "t",
        "seed": 11,
        "duration_s": 200,
        "tenants": {"chat": {"key": "sk-chat"}, "noisy": {"key": "sk-noisy"}},
        "classes": {
            "short": {
                "tenant": "chat",
                "rate": 10,
                "prompt_tokens": {"dist": "lognormal", "median": 1020, "p99": 4142, "max": 14050},
                "output_tokens": {"dist": "lognormal", "median": 129, "p99": 601, "max": 1000},
            },
            "reasoning": {
                "tenant": "noisy",
                "schedule": [{"from_s": 20, "to_s": 50, "rate": 2}],
                "prompt_tokens": 28000,
                "output_tokens": {"dist": "uniform", "low": 300, "high": 600},
            },
        },
    }
    raw.update(over)
    return raw


def test_same_seed_same_schedule_other_seed_differs() -> None:
    a = build_schedule(parse_workload(_workload()))
    b = build_schedule(parse_workload(_workload()))
    c = build_schedule(parse_workload(_workload(seed=12)))
    assert a == b
    assert [(r.at_s, r.prompt_tokens) for r in a] != [(r.at_s, r.prompt_tokens) for r in c]


def test_schedule_is_time_ordered_and_indexed() -> None:
    plan = build_schedule(parse_workload(_workload()))
    assert [r.index for r in plan] == list(range(len(plan)))
    assert all(a.at_s <= b.at_s for a, b in itertools.pairwise(plan))
    assert {r.api_key for r in plan if r.tenant == "chat"} == {"sk-chat"}


def test_poisson_rate_and_exponential_gaps() -> None:
    plan = [r for r in build_schedule(parse_workload(_workload())) if r.cls == "short"]
    # 2000 expected; a Poisson count's standard deviation is sqrt(2000) ≈ 45, so ±5 % is > 2 sigma.
    assert len(plan) == pytest.approx(2000, rel=0.05)
    gaps = [b.at_s - a.at_s for a, b in itertools.pairwise(plan)]
    cv = statistics.pstdev(gaps) / statistics.mean(gaps)
    assert cv == pytest.approx(1.0, abs=0.1)  # exponential inter-arrival times


def test_rate_schedule_windows_are_respected() -> None:
    plan = [r for r in build_schedule(parse_workload(_workload())) if r.cls == "reasoning"]
    assert plan, "the burst produced requests"
    assert all(20 <= r.at_s < 50 for r in plan)
    assert len(plan) == pytest.approx(60, rel=0.35)
    assert {r.prompt_tokens for r in plan} == {28000}
    assert all(300 <= r.output_tokens <= 600 for r in plan)


def test_window_overrides_base_rate() -> None:
    raw = _workload()
    raw["classes"]["short"]["schedule"] = [{"from_s": 100, "to_s": 200, "rate": 0}]
    plan = [r for r in build_schedule(parse_workload(raw)) if r.cls == "short"]
    assert all(r.at_s < 100 for r in plan)
    assert len(plan) == pytest.approx(1000, rel=0.1)


def test_lognormal_medians_of_planned_sizes() -> None:
    plan = [r for r in build_schedule(parse_workload(_workload())) if r.cls == "short"]
    assert statistics.median(r.prompt_tokens for r in plan) == pytest.approx(1020, rel=0.08)
    assert statistics.median(r.output_tokens for r in plan) == pytest.approx(129, rel=0.08)
    assert max(r.prompt_tokens for r in plan) <= 14050


def test_adding_a_class_keeps_other_classes_arrivals() -> None:
    base = build_schedule(parse_workload(_workload()))
    raw = _workload()
    raw["classes"]["extra"] = {"tenant": "chat", "rate": 3, "prompt_tokens": 10, "output_tokens": 5}
    more = build_schedule(parse_workload(raw))
    assert [r.at_s for r in base if r.cls == "short"] == [r.at_s for r in more if r.cls == "short"]


def test_constant_process_and_max_requests() -> None:
    raw = _workload(max_requests=25)
    raw["classes"]["reasoning"]["process"] = "constant"
    plan = build_schedule(parse_workload(raw))
    assert len(plan) == 25
    full = [
        r
        for r in build_schedule(parse_workload(_workload() | {"classes": raw["classes"]}))
        if r.cls == "reasoning"
    ]
    assert [r.at_s for r in full] == pytest.approx([20 + i * 0.5 for i in range(60)])


def test_scaled_multiplies_rates_and_sets_duration() -> None:
    spec = parse_workload(_workload()).scaled(rate_scale=0.5, duration_s=100)
    plan = build_schedule(spec)
    short = [r for r in plan if r.cls == "short"]
    assert spec.duration_s == 100 and all(r.at_s < 100 for r in plan)
    assert len(short) == pytest.approx(500, rel=0.12)


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda r: r["classes"]["short"].update(tenant="nobody"), "classes.short.tenant"),
        (lambda r: r.pop("duration_s"), "duration_s"),
        (lambda r: r["classes"]["short"].pop("rate"), "give 'rate' and/or 'schedule'"),
        (
            lambda r: r["classes"]["reasoning"].update(schedule=[{"from_s": 5, "to_s": 2, "rate": 1}]),
            "must be after",
        ),
        (lambda r: r.update(fairness={"tenants": ["chat"]}), "fairness.tenants"),
        (lambda r: r.update(bogus=1), "workload.bogus: unknown key"),
        (lambda r: r.update(send_max_tokens=0), "send_max_tokens: expected planned, none or a positive"),
        (lambda r: r.update(send_max_tokens="all"), "send_max_tokens: expected planned, none or a positive"),
    ],
)
def test_workload_errors_name_the_field(mutate: Any, message: str) -> None:
    raw = _workload()
    mutate(raw)
    with pytest.raises(SpecError) as err:
        parse_workload(raw)
    assert message in str(err.value)


@pytest.mark.parametrize(
    ("raw", "parsed"), [(None, "none"), ("none", "none"), ("planned", "planned"), (4096, 4096), ("512", 512)]
)
def test_send_max_tokens_is_planned_unless_the_workload_says_a_limit_or_none(raw: Any, parsed: Any) -> None:
    assert parse_workload(_workload()).send_max_tokens == "planned"
    assert parse_workload(_workload(send_max_tokens=raw)).send_max_tokens == parsed

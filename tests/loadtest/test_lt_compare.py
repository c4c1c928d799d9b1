"""A short compare run against two stub targets: the outputs exist and agree with each other."""

import json
from dataclasses import replace
from pathlib import Path

import pytest

from backends.reference.server import BackendSettings, build_app
from loadtest.checks import parse_checks
from loadtest.compare import compare, run_options, write_outputs
from loadtest.runner import Target
from loadtest.spec import parse_workload
from loadtest.summary import parse_summary, summary_rows
from tests.conftest import serve_asgi
from tests.loadtest.conftest import StubFactory

WORKLOAD = {
    "name": "mini",
    "seed": 3,
    "duration_s": 2.0,
    "drain_timeout_s": 10,
    "tenants": {"chat": {"key": "sk-chat"}, "batch": {"key": "sk-batch", "weight": 2}},
    "classes": {
        "short": {
            "tenant": "chat",
            "rate": 10,
            "prompt_tokens": {"dist": "lognormal", "median": 60, "p99": 200, "max": 400},
            "output_tokens": {"dist": "uniform", "low": 3, "high": 8},
        },
        "long": {
            "tenant": "batch",
            "rate": 0,
            "schedule": [{"from_s": 0.5, "to_s": 1.5, "rate": 4}],
            "prompt_tokens": 2000,
            "output_tokens": 10,
        },
    },
    "phases": {"quiet": [[0, 0.5]], "burst": [[0.5, 1.5]]},
    "fairness": {"tenants": ["chat", "batch"]},
}


@pytest.mark.soak
@pytest.mark.slow  # a whole compare run with plots
async def test_compare_writes_consistent_json_markdown_and_plots(
    stub_factory: StubFactory, tmp_path: Path
) -> None:
    fast = await stub_factory(first_token_delay_s=0.01, inter_token_delay_s=0.002)
    slow_a = await stub_factory(first_token_delay_s=0.15, inter_token_delay_s=0.002)
    slow_b = await stub_factory(first_token_delay_s=0.15, inter_token_delay_s=0.002)
    spec = parse_workload(WORKLOAD)
    checks = parse_checks(
        [
            {
                "name": "fast beats slow",
                "metric": "ttft_p99_s",
                "group": "short",
                "target": "fast",
                "baseline": {"target": "slow"},
                "max_ratio": 0.5,
            },
            {
                "name": "impossible",
                "metric": "tokens_per_s",
                "target": "fast",
                "baseline": {"target": "slow"},
                "min_ratio": 100,
            },
            {"name": "shares", "kind": "fairness", "target": "fast", "tolerance": 5.0},
        ],
        spec,
    )
    targets = [Target("fast", (fast.url,)), Target("slow", (slow_a.url, slow_b.url))]
    runs = await compare(spec, targets, options=run_options(spec), pause_s=0.1)
    out = write_outputs(tmp_path, spec, runs, checks)

    assert [r.target for r in runs] == ["fast", "slow"]
    assert len(runs[0].records) == len(runs[1].records) > 10
    assert slow_a.requests + slow_b.requests == len(runs[1].records)
    assert abs(slow_a.requests - slow_b.requests) <= 1

    data = json.loads(out.json_path.read_text())
    assert data["scenario"] == "mini" and data["groups"] == ["short", "long"]
    for target, run in zip(data["targets"], runs, strict=True):
        assert target["name"] == run.target
        assert len(target["requests"]) == target["totals"]["requests"] == len(run.records)
        assert sum(g["requests"] for g in target["groups"].values()) == len(run.records)
        assert target["totals"]["errors"] == {}
        assert set(target["phases"]) == {"quiet", "burst"}
        assert {s["tenant"] for s in target["fairness"]} == {"chat", "batch"}
        assert len(target["p99_ttft_over_time"]["short"]) >= 3
    # Same seeded plan against both targets: same classes and sizes, request by request.
    plan_a = [(r["class"], r["max_tokens"]) for r in data["targets"][0]["requests"]]
    plan_b = [(r["class"], r["max_tokens"]) for r in data["targets"][1]["requests"]]
    assert plan_a == plan_b

    verdicts = {c.name: c.met for c in out.checks}
    assert verdicts == {"fast beats slow": True, "impossible": False, "shares": True}
    assert [c["met"] for c in data["checks"]] == [True, False, True]

    md = out.markdown_path.read_text()
    assert "| fast | short |" in md and "| slow | long |" in md
    assert "Phase `burst`" in md and "Fair shares" in md and "NOT met" in md

    names = sorted(p.name for p in out.plots)
    assert names == ["fingerprint_p99_ttft.png", "latency_cdf.png"]
    for p in out.plots:
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and p.stat().st_size > 10_000


async def test_each_run_records_the_preemptions_its_backends_counted(tmp_path: Path) -> None:
    # A real reference backend whose KV cache (12 blocks of 16 tokens) holds fewer tokens than four
    # concurrent 40 + 60-token requests need: it must preempt; a run alone on it preempts nothing.
    app = build_app(BackendSettings(max_model_len=192, num_blocks=12))
    served = await serve_asgi(app)
    try:
        spec = parse_workload(
            {
                "name": "tight-kv",
                "duration_s": 0.1,
                "tenants": {"t": {"key": "sk-t"}},
                "classes": {
                    "c": {
                        "tenant": "t",
                        "rate": 40,
                        "process": "constant",
                        "prompt_tokens": 40,
                        "output_tokens": 60,
                    }
                },
            }
        )
        together = Target("together", (served.url,))
        runs = await compare(
            spec, [together], options=run_options(spec), pause_s=0, backend_urls=[served.url]
        )
        alone = replace(spec, classes=(replace(spec.classes[0], rate=10),))
        runs += await compare(alone, [Target("alone", (served.url,))], pause_s=0, backend_urls=[served.url])
        unmeasured = await compare(alone, [Target("unmeasured", (served.url,))], pause_s=0)
    finally:
        await served.stop()
    assert all(r.ok for run in runs for r in run.records)
    preempted = runs[0].backend_preemptions
    assert preempted is not None and preempted >= 1
    assert runs[1].backend_preemptions == 0 and unmeasured[0].backend_preemptions is None
    summary = parse_summary(["preemptions_per_request"], spec)
    assert summary_rows(spec, runs[:1], summary)[0]["values"] == {
        "backend preemptions / request": preempted / len(runs[0].records)
    }

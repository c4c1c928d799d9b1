"""End to end over real processes: a simulated reference backend and tokengate started from their CLIs,
a generated gateway config, and the demo entry point on tiny scenarios."""

import argparse
import asyncio
import json
import os
from pathlib import Path
from typing import Any

import pytest
import yaml

from loadtest import demo
from loadtest.compare import compare, run_options
from loadtest.scenario import parse_scenario
from loadtest.stack import spawned_stack

pytestmark = pytest.mark.slow


def _tiny(name: str, **extra: Any) -> dict[str, Any]:
    raw: dict[str, Any] = {
        "name": name,
        "seed": 3,
        "duration_s": 2.0,
        "drain_timeout_s": 20,
        "tenants": {
            "chat": {"key": "sk-chat", "tier": "standard"},
            "agent": {"key": "sk-agent", "tier": "batch", "gateway": {"budget_tokens": 9000}},
        },
        "classes": {
            "short": {"tenant": "chat", "rate": 6, "prompt_tokens": {"dist": "uniform", "low": 50, "high": 300},
                      "output_tokens": 5},
            "long": {"tenant": "agent", "rate": 0, "process": "constant",
                     "schedule": [{"from_s": 0.5, "to_s": 2.0, "rate": 1}], "prompt_tokens": 8000, "output_tokens": 10},
        },
        "phases": {"quiet": [[0, 0.5]], "noisy": [[0.5, 2.0]]},
        "setup": {
            "backends": {"count": 1, "args": ["--no-chunked-prefill", "--max-num-batched-tokens", "16384", "--max-model-len", "16384"]},
            "gateway": {"classes": [{"name": "long", "when": {"min_prompt_tokens": 4000}, "pool": "p"},
                                    {"name": "short", "pool": "p"}]},
            "targets": [
                {"name": "direct", "direct": True},
                {"name": "gw", "gateway": {"pools": {"p": {"backends": [{"backend": 0, "capacity_tokens": 30000}]}}}},
                {"name": "gw-quiet", "same_as": "gw", "without": ["long"], "phase": "noisy"},
            ],
        },
        "checks": [
            {"name": "gw vs direct", "metric": "ttft_p99_s", "group": "short", "target": "gw",
             "baseline": {"target": "direct"}, "max_ratio": 1000},
        ],
    }  # fmt: skip
    raw.update(extra)
    return raw


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.mark.soak
def test_spawned_stack_runs_targets_and_cleans_up(tmp_path: Path) -> None:
    scenario = parse_scenario(_tiny("stack"))
    with spawned_stack(scenario, tmp_path) as stack:
        assert [t.name for t in stack.targets] == ["direct", "gw", "gw-quiet"]
        assert stack.targets[2].base_urls == stack.targets[1].base_urls  # same gateway process
        config = yaml.safe_load(stack.config_paths["gw"].read_text())
        assert config["tenants"]["agent"]["budget_tokens"] == 9000
        assert config["pools"]["p"]["backends"][0]["url"] == stack.backend_urls[0]
        spec = scenario.workload
        runs = asyncio.run(compare(spec, stack.targets, options=run_options(spec), pause_s=0.1))
        pids = list(stack.pids)
        assert len(pids) == 2 and all(_alive(p) for p in pids)
    direct, gw, quiet = runs
    assert len(direct.records) == len(gw.records) > 5
    assert all(r.ok for run in runs for r in run.records), [
        r.detail for run in runs for r in run.records if not r.ok
    ]
    assert {r.gateway_class for r in gw.records} == {"short", "long"}
    assert all(r.gateway_class is None for r in direct.records)
    assert {r.cls for r in quiet.records} == {"short"} and all(
        0.5 <= r.scheduled_s < 2.0 for r in quiet.records
    )
    assert all(r.completion_tokens == r.max_tokens for run in runs for r in run.records)
    assert pids and not any(_alive(p) for p in pids)


@pytest.mark.soak
def test_demo_entry_point_on_tiny_scenarios(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Run as a user would, from a folder outside the checkout with a relative --out (the children
    start in the repository), with stderr not a terminal (progress as plain lines)."""
    nn = tmp_path / "nn.yaml"
    nn.write_text(yaml.safe_dump(_tiny("tiny-nn")))
    fair = _tiny("tiny-fair", fairness={"tenants": ["chat", "agent"], "phase": "noisy"})
    fair["checks"] = [{"name": "shares", "kind": "fairness", "target": "gw", "tolerance": 10.0}]
    fair_path = tmp_path / "fair.yaml"
    fair_path.write_text(yaml.safe_dump(fair))
    parser = argparse.ArgumentParser()
    demo.add_arguments(parser)
    monkeypatch.chdir(tmp_path)
    args = parser.parse_args(["--out", "out", "--scenario", str(nn), "--fairness-scenario", str(fair_path)])
    assert demo.run(args) == 0
    captured = capsys.readouterr()
    printed = captured.out
    assert "gw: finished:" in captured.err and "\r" not in captured.err
    assert "## Checks" in printed and "[    met] gw vs direct" in printed and "[    met] shares" in printed
    nn_json = json.loads((tmp_path / "out" / "noisy-neighbour" / "results.json").read_text())
    assert [t["name"] for t in nn_json["targets"]] == ["direct", "gw", "gw-quiet"]
    fair_json = json.loads((tmp_path / "out" / "fairness" / "results.json").read_text())
    assert [t["name"] for t in fair_json["targets"]] == ["gw"]  # the demo runs only the checked target
    assert (tmp_path / "out" / "noisy-neighbour" / "fingerprint_p99_ttft.png").is_file()


def test_each_backend_variant_starts_with_its_own_engine_settings(tmp_path: Path) -> None:
    raw = _tiny("variants")
    raw["setup"]["backends"] = {
        "args": ["--max-model-len", "16384"],
        "variants": [[], ["--scheduling-policy", "priority", "--long-prefill-token-threshold", "512"]],
    }
    raw["setup"]["targets"] = [{"name": "plain", "direct": True, "backends": [0]}]
    raw.pop("checks")
    scenario = parse_scenario(raw)

    async def settings(url: str) -> dict[str, str]:
        import httpx

        from gateway.observe.scrape import parse_engine_metrics

        async with httpx.AsyncClient() as c:
            sample = parse_engine_metrics((await c.get(url + "/metrics")).text)
        assert sample.scheduler is not None
        return dict(sample.scheduler)

    with spawned_stack(scenario, tmp_path) as stack:
        plain, tuned = (asyncio.run(settings(u)) for u in stack.backend_urls)
    assert (plain["scheduling_policy"], plain["long_prefill_token_threshold"], plain["max_model_len"]) == (
        "fcfs",
        "0",
        "16384",
    )
    assert (tuned["scheduling_policy"], tuned["long_prefill_token_threshold"], tuned["max_model_len"]) == (
        "priority",
        "512",
        "16384",
    )

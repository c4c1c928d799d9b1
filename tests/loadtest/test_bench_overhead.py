"""The overhead benchmark's before/after mode (``--baseline-tree``), run for real and briefly: every
server in its own process, the other checkout's gateway measured beside this one."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from loadtest.bench.overhead import added_ratio
from loadtest.processes import child_env, repo_root

pytestmark = pytest.mark.slow


@pytest.mark.soak
def test_a_baseline_checkout_is_measured_in_the_same_rounds_as_the_gateway(tmp_path: Path) -> None:
    result = tmp_path / "overhead.json"
    # This checkout as its own baseline (an A/A run): what matters here is that the second gateway
    # starts from the given tree, serves the same load and is reported beside the first.
    done = subprocess.run(
        [sys.executable, "-m", "loadtest.bench.overhead", "--duration", "0.5", "--warmup", "0.1",
         "--rounds", "1", "--modes", "plain", "--concurrency", "1",
         "--baseline-tree", str(repo_root()), "--json", str(result)],
        cwd=repo_root(), env=child_env(), capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads(result.read_text())["summary"]
    for target in ("gateway", "baseline"):
        row = summary[f"{target}|c1|plain"]
        assert row["requests"] > 0
        assert row["errors"] == 0
        assert row["cpu_ms_per_req"] > 0
    assert "| plain | 1 | baseline |" in done.stdout
    assert "gateway ÷ baseline: CPU/req" in done.stdout
    assert f"--baseline-tree {repo_root()}" in done.stdout


@pytest.mark.soak
def test_the_long_prompt_mode_sends_never_seen_prompts_beside_the_short_requests(tmp_path: Path) -> None:
    result = tmp_path / "overhead.json"
    done = subprocess.run(
        [sys.executable, "-m", "loadtest.bench.overhead", "--duration", "0.5", "--warmup", "0.1",
         "--rounds", "1", "--modes", "plain", "--concurrency", "1",
         "--with-long-prompts", "4", "--long-tokens", "2000", "--estimate-above-chars", "5000",
         "--json", str(result)],
        cwd=repo_root(), env=child_env(), capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads(result.read_text())["summary"]
    for target in ("direct", "gateway", "gateway-estimate"):
        quiet, busy = summary[f"{target}|c1|plain"], summary[f"{target}|c1|plain|long"]
        assert quiet["requests"] > 0 and busy["requests"] > 0
        assert busy["long_prompts"]["sent"] > 0
        assert set(busy["long_prompts"]["statuses"]) == {"200"}
    assert "gateway-added p99" in done.stdout
    # The estimating gateway's own account (a run this short may not have learned a ratio yet).
    assert summary["estimates"]["above_chars"] == 5000 and "with estimate mode" in done.stdout
    # Every target of streaming and big prompts at bare-proxy cost, judged in the same run.
    assert (
        "- plain c=1 gateway: CPU/req" in done.stdout
        and "- plain c=1 gateway-estimate: CPU/req" in done.stdout
    )
    assert "prompt's time in gateway, p99 over direct" in done.stdout


def test_a_baseline_tree_that_is_not_a_checkout_is_refused_before_anything_starts(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "loadtest.bench.overhead", "--baseline-tree", str(tmp_path)],
        cwd=repo_root(), env=child_env(), capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 2
    assert f"--baseline-tree {tmp_path}: not a tokengate checkout (no gateway/cli.py)" in done.stderr


@pytest.mark.parametrize(
    ("loaded", "quiet", "says"),
    [
        (0.9, 0.6, "1.50x"),
        (0.4, -0.05, "no ratio: the quiet added p99 is -0.050 ms, at or below zero (noise)"),
        (0.4, 0.0, "no ratio: the quiet added p99 is 0.000 ms, at or below zero (noise)"),
    ],
)
def test_a_quiet_added_p99_at_or_below_zero_gives_no_ratio(loaded: float, quiet: float, says: str) -> None:
    # It printed "infx" before: a noisy run's direct p99 above the gateway's is not a cost to divide by.
    assert added_ratio(loaded, quiet) == says

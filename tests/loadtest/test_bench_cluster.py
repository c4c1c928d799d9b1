"""The Redis Cluster scale benchmark, run for real and briefly: both clusters come up, the domains
land one per shard, and every domain cycles."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from loadtest.processes import child_env, repo_root


@pytest.mark.soak
def test_the_cluster_benchmark_drives_each_domain_on_one_shard_and_on_three(tmp_path: Path) -> None:
    result = tmp_path / "cluster.json"
    done = subprocess.run(
        [sys.executable, "-m", "loadtest.bench.cluster", "--duration", "0.5", "--concurrency", "4",
         "--json", str(result)],
        cwd=repo_root(), env=child_env(), capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    data = json.loads(result.read_text())
    assert data["one"]["shards"] == 1 and data["many"]["shards"] == 3
    for run in (data["one"], data["many"]):
        assert len(run["per_domain"]) == 3 and all(rate > 0 for rate in run["per_domain"])
    assert "3 shards / 1 shard" in done.stdout
    # The cost model reads both CPUs of the one-shard run: each is a measurement, never zero.
    for run in (data["one"], data["many"]):
        assert run["redis_us_per_cycle"] > 0 and run["client_us_per_cycle"] > 0
    model = data["model"]
    assert model["cores_for_2_5x"] == 2.5 * (model["redis_us"] + model["client_us"]) / model["redis_us"]
    assert 0 < model["ratio_ceiling_here"] <= 3
    assert "2.5x needs >=" in done.stdout

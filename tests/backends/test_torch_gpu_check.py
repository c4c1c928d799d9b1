"""The GPU check script runs end to end on CPU with the tiny shape (how it is smoke-tested without a GPU)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("torch")

from backends.engine import gpu_check


def test_gpu_check_main_on_tiny_cpu(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "check.json"
    args = ["--device", "cpu", "--shape", "tiny", "--prefill-lens", "32,80", "--decode-batches", "1,3"]
    args += ["--decode-context", "20", "--decode-steps", "2", "--peak-gbps", "50", "--out", str(out)]
    assert gpu_check.main(args) == 0
    result = json.loads(out.read_text())
    assert result["correctness"]["ok"] and result["correctness"]["argmax_agreement"] == 1.0
    assert [p["tokens"] for p in result["prefill"]] == [32, 80]
    assert all(p["tokens_per_s"] > 0 for p in result["prefill"])
    assert [d["batch"] for d in result["decode"]] == [1, 3]
    for d in result["decode"]:
        assert d["step_ms_median"] > 0 and d["bytes_per_step"] > result["weight_bytes"] / 2
        assert d["fraction_of_peak"] == pytest.approx(d["achieved_gbps"] / 50)
    assert "correctness  OK" in capsys.readouterr().out


def test_peak_bandwidth_table_prefers_specific_names() -> None:
    assert gpu_check.peak_gbps_for("NVIDIA H200") == 4800.0
    assert gpu_check.peak_gbps_for("NVIDIA GH200 480GB") == 4900.0
    assert gpu_check.peak_gbps_for("NVIDIA H100 80GB HBM3") == 3350.0
    assert gpu_check.peak_gbps_for("NVIDIA H100 PCIe") == 2000.0
    assert gpu_check.peak_gbps_for("NVIDIA A100-SXM4-80GB") == 2039.0
    assert gpu_check.peak_gbps_for("Some Future Accelerator") is None

"""One executor factory for the reference server and for calibration."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from backends.engine.calibrate import main as calibrate
from backends.engine.factory import DEFAULT_SIM_KV_TOKENS, ExecutorSettings, build_executor, sim_num_blocks
from backends.engine.sim_executor import CostModel, SimExecutor
from backends.reference.server import BackendSettings
from tests.backends.support import TRUE


def test_every_executor_setting_of_the_server_reaches_the_factory() -> None:
    server = BackendSettings(
        executor="torch", block_size=32, num_blocks=100, max_model_len=2048, cost_model="c.json",
        sim_eos_after=3, shape="llama-3.2-1b", model_dir="/m", device="cpu", dtype="float32", seed=7,
    )  # fmt: skip
    got = server.executor_settings()
    assert got == ExecutorSettings(
        kind="torch", block_size=32, num_blocks=100, max_model_len=2048, cost_model="c.json", eos_after=3,
        shape="llama-3.2-1b", model_dir="/m", device="cpu", dtype="float32", seed=7,
    )  # fmt: skip
    defaults = ExecutorSettings()
    assert all(getattr(got, f.name) != getattr(defaults, f.name) for f in dataclasses.fields(got))


def test_a_sim_executor_gets_the_default_kv_size_unless_one_request_needs_more() -> None:
    assert sim_num_blocks(16, 32768) == DEFAULT_SIM_KV_TOKENS // 16
    assert sim_num_blocks(16, 1_000_000) == 62_500
    ex = build_executor(ExecutorSettings(block_size=32, max_model_len=4096))
    assert isinstance(ex, SimExecutor)
    assert (ex.block_size, ex.num_blocks, ex.tokenizer) == (32, DEFAULT_SIM_KV_TOKENS // 32, None)


def test_a_sim_executor_takes_its_cost_model_file_and_eos_index(tmp_path: Path) -> None:
    path = tmp_path / "cost.json"
    path.write_text(json.dumps(TRUE.to_dict()))
    ex = build_executor(ExecutorSettings(num_blocks=64, cost_model=str(path), eos_after=2))
    assert isinstance(ex, SimExecutor)
    assert (ex.cost_model, ex.num_blocks, ex.eos_after) == (TRUE, 64, 2)


def test_an_unknown_executor_kind_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown executor 'tpu'"):
        build_executor(ExecutorSettings(kind="tpu"))  # type: ignore[arg-type]


def test_calibrating_the_sim_executor_recovers_its_cost_model(tmp_path: Path) -> None:
    src, out = tmp_path / "true.json", tmp_path / "fit.json"
    src.write_text(json.dumps(TRUE.to_dict()))
    argv = ["--executor", "sim", "--cost-model", str(src), "--max-model-len", "8192", "--repeats", "1"]
    assert calibrate([*argv, "--out", str(out)]) == 0
    fit = CostModel.from_file(out)
    assert fit.knee_tokens == TRUE.knee_tokens
    for name in ("floor_s", "per_token_s", "decode_kv_s", "prefill_pair_s"):
        assert getattr(fit, name) == pytest.approx(getattr(TRUE, name), rel=1e-6), name

import random
from pathlib import Path

import pytest

from backends.engine.calibrate import Sample, calibration_plans, fit_cost_model, main, measure
from backends.engine.sim_executor import CostModel, SimExecutor
from tests.backends.support import TRUE


def test_fit_recovers_the_model_that_produced_the_times() -> None:
    ex = SimExecutor(TRUE, num_blocks=8192)
    samples = measure(
        ex, calibration_plans(block_size=16, num_blocks=8192, max_len=32768), repeats=1, warmup=0
    )
    fit = fit_cost_model(samples)
    assert fit.model.knee_tokens == 64
    for name in ("floor_s", "per_token_s", "decode_kv_s", "prefill_pair_s"):
        assert getattr(fit.model, name) == pytest.approx(getattr(TRUE, name), rel=1e-6), name
    assert fit.max_rel_error < 1e-6


def test_fit_tolerates_measurement_noise() -> None:
    rng = random.Random(7)
    ex = SimExecutor(TRUE, num_blocks=8192)
    clean = measure(ex, calibration_plans(block_size=16, num_blocks=8192, max_len=32768), repeats=1, warmup=0)
    noisy = [Sample(s.features, s.seconds * rng.uniform(0.95, 1.05)) for s in clean]
    fit = fit_cost_model(noisy)
    assert fit.model.floor_s == pytest.approx(TRUE.floor_s, rel=0.1)
    assert fit.model.per_token_s == pytest.approx(TRUE.per_token_s, rel=0.1)
    assert fit.model.prefill_pair_s == pytest.approx(TRUE.prefill_pair_s, rel=0.2)
    assert fit.median_rel_error < 0.05


def test_features_never_exercised_keep_the_base_coefficient() -> None:
    ex = SimExecutor(TRUE, num_blocks=8192)
    plans = [
        p
        for p in calibration_plans(block_size=16, num_blocks=8192, max_len=32768)
        if all(s.is_prefill for s in p.seqs)
    ]
    fit = fit_cost_model(measure(ex, plans, repeats=1, warmup=0), base=CostModel(decode_kv_s=1.23e-9))
    assert fit.model.decode_kv_s == 1.23e-9
    assert fit.model.prefill_pair_s == pytest.approx(TRUE.prefill_pair_s, rel=1e-6)


def test_fit_needs_enough_samples() -> None:
    with pytest.raises(ValueError, match="at least 4"):
        fit_cost_model([])


def test_plans_fit_the_cache_and_context() -> None:
    plans = calibration_plans(block_size=16, num_blocks=256, max_len=2048)
    assert plans
    for plan in plans:
        owned: set[int] = set()
        for seq in plan.seqs:
            assert seq.start_pos + len(seq.token_ids) <= 2048
            assert len(seq.block_table) * 16 >= seq.start_pos + len(seq.token_ids)
            assert owned.isdisjoint(seq.block_table)
            owned |= set(seq.block_table)
        assert len(owned) <= 256


@pytest.mark.slow
@pytest.mark.torch
def test_cli_calibrates_the_torch_executor_into_a_loadable_file(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    out = tmp_path / "cost.json"
    argv = ["--executor", "torch", "--shape", "tiny", "--device", "cpu", "--max-model-len", "1024"]
    assert main([*argv, "--num-blocks", "512", "--repeats", "1", "--out", str(out)]) == 0
    model = CostModel.from_file(out)
    assert model.floor_s > 0

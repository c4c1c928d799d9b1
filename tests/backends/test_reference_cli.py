import argparse
import subprocess
import sys
from pathlib import Path

import pytest

from backends.reference.cli import add_arguments, settings_from_args

REPO = Path(__file__).resolve().parents[2]


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(list(argv))


def test_defaults_match_backend_settings() -> None:
    s = settings_from_args(parse())
    assert (s.executor, s.model, s.port, s.enable_chunked_prefill, s.scheduling_policy) == (
        "sim",
        "tokengate-sim",
        8001,
        True,
        "fcfs",
    )
    cfg = s.scheduler_config()
    assert (cfg.max_num_batched_tokens, cfg.max_num_seqs, cfg.max_model_len) == (8192, 256, 32768)


def test_all_options_reach_the_settings() -> None:
    s = settings_from_args(
        parse(
            "--host", "0.0.0.0", "--port", "9001", "--executor", "torch", "--model", "m",
            "--max-model-len", "2048", "--max-num-batched-tokens", "512", "--max-num-seqs", "8",
            "--no-chunked-prefill", "--long-prefill-token-threshold", "64", "--scheduling-policy", "priority",
            "--block-size", "32", "--num-blocks", "100", "--cost-model", "c.yaml", "--time-scale", "0.5",
            "--shape", "llama-3.2-1b", "--model-dir", "/m", "--device", "cpu", "--seed", "7",
        )
    )  # fmt: skip
    assert s.host == "0.0.0.0" and s.port == 9001 and s.executor == "torch" and s.model == "m"
    assert (s.max_model_len, s.max_num_batched_tokens, s.max_num_seqs) == (2048, 512, 8)
    assert not s.enable_chunked_prefill and s.long_prefill_token_threshold == 64
    assert (s.scheduling_policy, s.block_size, s.num_blocks) == ("priority", 32, 100)
    assert (s.cost_model, s.time_scale, s.shape, s.model_dir, s.device, s.seed) == (
        "c.yaml", 0.5, "llama-3.2-1b", "/m", "cpu", 7,
    )  # fmt: skip


def test_vllms_partial_prefill_flags_and_the_priority_controls_reach_the_scheduler() -> None:
    cfg = settings_from_args(
        parse(
            "--max-num-partial-prefills", "4", "--max-long-partial-prefills", "1",
            "--scheduling-policy", "priority", "--priority-scope", "queue", "--priority-aging-s", "2.5",
        )
    ).scheduler_config()  # fmt: skip
    assert (cfg.max_num_partial_prefills, cfg.max_long_partial_prefills) == (4, 1)
    assert cfg.long_prefill_token_threshold == int(32768 * 0.04)  # vLLM's default once N > 1
    assert (cfg.policy, cfg.priority_scope, cfg.priority_aging_s) == ("priority", "queue", 2.5)
    defaults = settings_from_args(parse()).scheduler_config()
    assert (defaults.max_num_partial_prefills, defaults.priority_scope) == (1, "step")
    with pytest.raises(ValueError, match="max_long_partial_prefills"):
        settings_from_args(parse("--max-long-partial-prefills", "2")).scheduler_config()


def test_unchunked_default_budget_covers_the_context() -> None:
    cfg = settings_from_args(parse("--no-chunked-prefill")).scheduler_config()
    assert cfg.max_num_batched_tokens == 32768
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        settings_from_args(
            parse("--no-chunked-prefill", "--max-num-batched-tokens", "4096")
        ).scheduler_config()


def test_module_entry_point_reports_bad_settings_without_traceback() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "backends.reference", "--max-model-len", "100000", "--num-blocks", "10"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2
    assert "KV cache holds 160 tokens" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_sim_backend_needs_no_torch() -> None:
    code = (
        "import sys; sys.modules['torch'] = None\n"  # any 'import torch' now raises ImportError
        "from backends.reference.server import BackendSettings, build_app\n"
        "import backends.engine.calibrate\n"
        "app = build_app(BackendSettings())\n"
        "print(type(app.state.backend.engine.executor).__name__)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "SimExecutor"

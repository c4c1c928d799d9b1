"""Builds an executor from settings: the one place that knows which executors exist.

The reference server (``BackendSettings.executor_settings()``) and calibration
(``python -m backends.engine.calibrate``) both call :func:`build_executor`, so a simulated
executor gets the same default KV size and a torch executor the same arguments either way.
torch is imported only when a torch executor is asked for: the simulated path runs without it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from backends.engine.sim_executor import CostModel, SimExecutor
from backends.engine.types import Executor

# Sim KV cache: ~an 8B model on an 80 GB GPU at 90 % memory (~57 GB of KV at 128 KiB/token).
DEFAULT_SIM_KV_TOKENS = 450_000


@dataclass(frozen=True, slots=True)
class ExecutorSettings:
    kind: Literal["sim", "torch"] = "sim"
    block_size: int = 16
    num_blocks: int | None = None  # None: sim ~DEFAULT_SIM_KV_TOKENS of KV; torch sizes it from memory
    max_model_len: int = 32768
    # sim
    cost_model: str | None = None  # JSON/YAML file of CostModel fields
    eos_after: int | None = None  # emit EOS at this output index (None: never)
    # torch
    shape: str = "tiny"
    model_dir: str | None = None
    device: str | None = None
    dtype: str | None = None
    seed: int = 0


def sim_num_blocks(block_size: int, max_model_len: int) -> int:
    """The simulated executor's default KV size in blocks: DEFAULT_SIM_KV_TOKENS, or one longest
    request if that is more (a request the cache can never hold would be refused)."""
    return max(DEFAULT_SIM_KV_TOKENS // block_size, -(-max_model_len // block_size))


def build_executor(settings: ExecutorSettings) -> Executor:
    s = settings
    if s.kind == "sim":
        cost = CostModel.from_file(s.cost_model) if s.cost_model else CostModel()
        return SimExecutor(
            cost,
            block_size=s.block_size,
            num_blocks=s.num_blocks or sim_num_blocks(s.block_size, s.max_model_len),
            eos_after=s.eos_after,
        )
    if s.kind == "torch":
        from backends.engine.torch_executor import build_torch_executor

        return build_torch_executor(
            shape=s.shape,
            model_dir=s.model_dir,
            device=s.device,
            dtype=s.dtype,
            block_size=s.block_size,
            num_blocks=s.num_blocks,
            seed=s.seed,
            max_model_len=s.max_model_len,
        )
    raise ValueError(f"unknown executor {s.kind!r}; expected 'sim' or 'torch'")

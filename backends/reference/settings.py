"""The reference backend's settings: the engine, its scheduler and the server's address.

Apart from the server so that reading them (the gateway's ``embedded_backend`` config section) does
not import the server and its engine.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from backends.engine.factory import ExecutorSettings
from backends.engine.scheduler import SchedulerConfig


@dataclass
class BackendSettings:
    host: str = "127.0.0.1"
    port: int = 8001
    executor: Literal["sim", "torch"] = "sim"
    model: str = "tokengate-sim"  # the served model name
    max_model_len: int = 32768
    # None: 8192 with chunked prefill; without it max(8192, max_model_len), as a prompt must fit a step.
    max_num_batched_tokens: int | None = None
    max_num_seqs: int = 256
    enable_chunked_prefill: bool = True
    long_prefill_token_threshold: int = 0  # per-request prefill chunk cap, 0 = none (vLLM's default)
    max_num_partial_prefills: int = 1  # vLLM's: prefills per step (1 = no limit)
    max_long_partial_prefills: int = 1  # vLLM's: of those, long ones (> long_prefill_token_threshold)
    scheduling_policy: Literal["fcfs", "priority"] = "fcfs"
    priority_scope: Literal["step", "queue"] = "step"  # "queue": exactly vLLM v1's priority policy
    priority_aging_s: float = 10.0  # step scope: a waiting/starved request gains a level per this
    block_size: int = 16
    num_blocks: int | None = None  # None: sim ~450k tokens of KV; torch sizes it from memory
    cost_model: str | None = None  # JSON/YAML file of CostModel fields (sim)
    time_scale: float = 1.0  # sim: sleep step_time * time_scale (0 = as fast as possible)
    sim_eos_after: int | None = None  # sim: emit EOS at this output index (None: never)
    # torch executor
    shape: str = "tiny"
    model_dir: str | None = None
    device: str | None = None
    dtype: str | None = None
    seed: int = 0

    def executor_settings(self) -> ExecutorSettings:
        return ExecutorSettings(
            kind=self.executor,
            block_size=self.block_size,
            num_blocks=self.num_blocks,
            max_model_len=self.max_model_len,
            cost_model=self.cost_model,
            eos_after=self.sim_eos_after,
            shape=self.shape,
            model_dir=self.model_dir,
            device=self.device,
            dtype=self.dtype,
            seed=self.seed,
        )

    def scheduler_config(self) -> SchedulerConfig:
        budget = self.max_num_batched_tokens
        if budget is None:
            budget = 8192 if self.enable_chunked_prefill else max(8192, self.max_model_len)
        return SchedulerConfig(
            max_num_batched_tokens=budget,
            max_num_seqs=self.max_num_seqs,
            max_model_len=self.max_model_len,
            enable_chunked_prefill=self.enable_chunked_prefill,
            long_prefill_token_threshold=self.long_prefill_token_threshold,
            max_num_partial_prefills=self.max_num_partial_prefills,
            max_long_partial_prefills=self.max_long_partial_prefills,
            policy=self.scheduling_policy,
            priority_scope=self.priority_scope,
            priority_aging_s=self.priority_aging_s,
        )

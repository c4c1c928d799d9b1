"""The torch executor under the real scheduler: chunked prefill, mixed steps and preemption by
recompute (a KV cache too small for everyone) give every request the tokens it gets alone."""

from __future__ import annotations

import random

import pytest

pytest.importorskip("torch")

from backends.engine.clock import VirtualClock
from backends.engine.engine import Engine
from backends.engine.kv_cache import BlockManager
from backends.engine.request import EngineRequest
from backends.engine.scheduler import Scheduler, SchedulerConfig
from backends.engine.torch_executor import build_torch_executor
from backends.engine.types import SamplingParams

BLOCK = 8
MAX_LEN = 96


def requests() -> list[EngineRequest]:
    rng = random.Random(5)
    specs = [
        (30, SamplingParams()),
        (45, SamplingParams(temperature=0.8, top_p=0.9, seed=3)),
        (12, SamplingParams()),
    ]
    specs += [(60, SamplingParams()), (25, SamplingParams(temperature=1.0))]
    return [
        EngineRequest(f"r{i}", [rng.randrange(100_000) for _ in range(n)], 8, sampling=sp, ignore_eos=True)
        for i, (n, sp) in enumerate(specs)
    ]


def run(
    reqs: list[EngineRequest], *, num_blocks: int, batched_tokens: int
) -> tuple[dict[str, list[int]], int]:
    ex = build_torch_executor(
        shape="tiny", device="cpu", block_size=BLOCK, num_blocks=num_blocks, seed=11, max_model_len=MAX_LEN
    )
    sched = Scheduler(
        SchedulerConfig(max_num_batched_tokens=batched_tokens, max_num_seqs=8, max_model_len=MAX_LEN),
        BlockManager(num_blocks, BLOCK),
        ex.eos_token_id,
    )
    engine = Engine(sched, ex, VirtualClock())
    for r in reqs:
        engine.add_request(r)
    out: dict[str, list[int]] = {r.request_id: [] for r in reqs}
    while engine.has_unfinished():
        for o in engine.step():
            out[o.request_id] += o.new_token_ids
    return out, sched.num_preemptions_total


def test_engine_with_preemption_and_chunking_matches_isolated_runs() -> None:
    alone: dict[str, list[int]] = {}
    for r in requests():
        got, _ = run([r], num_blocks=64, batched_tokens=128)
        alone |= got
    together, preemptions = run(requests(), num_blocks=MAX_LEN // BLOCK + 3, batched_tokens=24)
    assert preemptions > 0  # the small cache really forced recomputes
    assert together == alone
    assert all(len(toks) == 8 for toks in together.values())

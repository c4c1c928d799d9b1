"""Sampling: greedy, seeded temperature/top-p reproducibility, emit limits and stop-id mapping."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")

import torch

from backends.engine.torch_executor import EmitPolicy, sample_tokens
from backends.engine.types import SamplingParams, SeqStep

OPEN = EmitPolicy(limit=None, eos_token_id=None, stop_ids=())


def step(rid: str = "r", out_idx: int = 0, **sampling: float | int | None) -> SeqStep:
    return SeqStep(rid, [1], 5, [0], True, out_idx, SamplingParams(**sampling))  # type: ignore[arg-type]


def flat_logits(rows: int = 1, vocab: int = 1000) -> torch.Tensor:
    return torch.zeros(rows, vocab)


def test_greedy_takes_argmax_per_row() -> None:
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    want = logits.argmax(-1).tolist()
    assert sample_tokens(logits.clone(), [step(), step(), step()], emit=OPEN, executor_seed=0) == want


def test_seeded_sampling_is_reproducible_and_independent_of_batch_position() -> None:
    s = step("a", out_idx=3, temperature=1.0, seed=42)
    alone = sample_tokens(flat_logits(), [s], emit=OPEN, executor_seed=0)[0]
    batched = sample_tokens(
        flat_logits(3), [step("x", temperature=1.0), step("y"), s], emit=OPEN, executor_seed=9
    )[2]
    assert alone == batched
    # Different output indices draw different tokens from the same flat distribution.
    draws = {
        sample_tokens(
            flat_logits(), [step("a", out_idx=i, temperature=1.0, seed=42)], emit=OPEN, executor_seed=0
        )[0]
        for i in range(20)
    }
    assert len(draws) > 10


def test_unseeded_sampling_replays_per_request_id() -> None:
    def draw(rid: str, executor_seed: int) -> list[int]:
        return [
            sample_tokens(
                flat_logits(), [step(rid, out_idx=i, temperature=1.0)], emit=OPEN, executor_seed=executor_seed
            )[0]
            for i in range(8)
        ]

    assert draw("req-1", 0) == draw("req-1", 0)
    assert draw("req-1", 0) != draw("req-2", 0)
    assert draw("req-1", 0) != draw("req-1", 1)


def test_top_p_keeps_only_the_nucleus() -> None:
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    seen = set()
    for i in range(200):
        logits = probs.log()[None, :].clone()
        seen.add(
            sample_tokens(
                logits, [step(out_idx=i, temperature=1.0, top_p=0.7, seed=1)], emit=OPEN, executor_seed=0
            )[0]
        )
    assert seen == {0, 1}
    tiny_p = sample_tokens(
        probs.log()[None, :].clone(), [step(temperature=5.0, top_p=1e-6, seed=1)], emit=OPEN, executor_seed=0
    )
    assert tiny_p == [0]


def test_emit_limit_and_stop_ids() -> None:
    emit = EmitPolicy(limit=100, eos_token_id=128001, stop_ids=(128001, 128008, 128009))
    logits = flat_logits(vocab=128256)
    logits[0, 500] = 50.0  # beyond the limit: never emitted
    logits[0, 7] = 10.0
    assert sample_tokens(logits.clone(), [step()], emit=emit, executor_seed=0) == [7]
    logits[0, 128009] = 20.0  # a stop id beyond the limit stays allowed, reported as the EOS id
    assert sample_tokens(logits.clone(), [step()], emit=emit, executor_seed=0) == [128001]
    hot = [step(out_idx=i, temperature=100.0, seed=i) for i in range(32)]
    drawn = sample_tokens(flat_logits(32, vocab=128256), hot, emit=emit, executor_seed=0)
    assert all(t < 100 or t == 128001 for t in drawn)

"""The torch executor's math against an independent full-recompute forward (tiny shape, CPU, fp32).

The naive forward here shares no code with backends.engine.llama: its own RoPE (complex rotation
from a scalar llama3 formula), explicit softmax attention with a causal mask, per-matrix weights.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence

import pytest

pytest.importorskip("torch")

import torch

from backends.engine.llama import (
    LlamaConfig,
    LlamaWeights,
    named_shape,
    reference_forward,
    rope_inv_freq,
)
from backends.engine.torch_executor import TorchExecutor, build_torch_executor
from backends.engine.types import SamplingParams, SeqStep, StepPlan

pytestmark = pytest.mark.slow

BLOCK = 8
GREEDY = SamplingParams()


def direct_llama3_inv_freq(cfg: LlamaConfig) -> list[float]:
    """Llama 3.1's published scaling rule, one frequency at a time."""
    freqs = [1.0 / cfg.rope_theta ** (i / cfg.head_dim) for i in range(0, cfg.head_dim, 2)]
    s = cfg.rope_scaling
    if s is None:
        return freqs
    low_wavelen = s.original_max_position_embeddings / s.low_freq_factor
    high_wavelen = s.original_max_position_embeddings / s.high_freq_factor
    out = []
    for f in freqs:
        wavelen = 2 * math.pi / f
        if wavelen < high_wavelen:
            out.append(f)
        elif wavelen > low_wavelen:
            out.append(f / s.factor)
        else:
            smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
                s.high_freq_factor - s.low_freq_factor
            )
            out.append((1 - smooth) * f / s.factor + smooth * f)
    return out


def naive_logits(w: LlamaWeights, cfg: LlamaConfig, tokens: Sequence[int]) -> torch.Tensor:
    """Whole-sequence forward, float64, no cache: logits [T, vocab]."""
    d = torch.float64
    n, hd, nh, nkv = len(tokens), cfg.head_dim, cfg.num_heads, cfg.num_kv_heads
    inv = torch.tensor(direct_llama3_inv_freq(cfg), dtype=d)
    rot = torch.polar(torch.ones(n, hd // 2, dtype=d), torch.outer(torch.arange(n, dtype=d), inv))

    def rope(x: torch.Tensor) -> torch.Tensor:  # x [T, H, D]; pairs are (i, i + D/2)
        c = torch.complex(x[..., : hd // 2], x[..., hd // 2 :]) * rot[:, None, :]
        return torch.cat([c.real, c.imag], dim=-1)

    def norm(x: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        return x / torch.sqrt((x * x).mean(-1, keepdim=True) + cfg.rms_norm_eps) * g.to(d)

    causal = torch.ones(n, n, dtype=torch.bool).tril()
    h = w.embed.to(d)[torch.tensor(tokens)]
    for layer in w.layers:
        wq, wk, wv = layer.wqkv.to(d).split([nh * hd, nkv * hd, nkv * hd])
        x = norm(h, layer.attn_norm)
        q = rope((x @ wq.T).view(n, nh, hd))
        k = rope((x @ wk.T).view(n, nkv, hd))
        v = (x @ wv.T).view(n, nkv, hd)
        heads = []
        for head in range(nh):
            kv = head // (nh // nkv)
            scores = q[:, head] @ k[:, kv].T / math.sqrt(hd)
            scores = scores.masked_fill(~causal, -math.inf)
            heads.append(torch.softmax(scores, -1) @ v[:, kv])
        h = h + torch.cat(heads, dim=-1) @ layer.wo.to(d).T
        x = norm(h, layer.mlp_norm)
        gate, up = (x @ layer.w_gate_up.to(d).T).chunk(2, dim=-1)
        h = h + (torch.nn.functional.silu(gate) * up) @ layer.w_down.to(d).T
    return norm(h, w.final_norm) @ w.lm_head.to(d).T


def naive_greedy(w: LlamaWeights, cfg: LlamaConfig, prompt: Sequence[int], n: int) -> list[int]:
    seq = list(prompt)
    for _ in range(n):
        seq.append(int(naive_logits(w, cfg, seq)[-1].argmax()))
    return seq[len(prompt) :]


class Seq:
    """Drives one sequence through an executor the way a scheduler would."""

    def __init__(self, rid: str, prompt: list[int], blocks: list[int], sampling: SamplingParams = GREEDY):
        self.rid, self.prompt, self.blocks, self.sampling = rid, prompt, blocks, sampling
        self.out: list[int] = []
        self.computed = 0  # tokens whose KV is in the cache

    @property
    def all_tokens(self) -> list[int]:
        return self.prompt + self.out

    def next_step(self, max_chunk: int = 10**9) -> SeqStep:
        pending = self.all_tokens[self.computed :]
        chunk = pending[:max_chunk]
        done = self.computed + len(chunk) == len(self.all_tokens)
        return SeqStep(self.rid, chunk, self.computed, self.blocks, done, len(self.out), self.sampling)

    def advance(self, step: SeqStep, tokens: dict[str, int]) -> None:
        self.computed += len(step.token_ids)
        if step.sample:
            self.out.append(tokens[self.rid])

    def preempt(self, new_blocks: list[int]) -> None:
        self.blocks, self.computed = new_blocks, 0


def run(ex: TorchExecutor, seqs: Sequence[Seq], max_chunk: int = 10**9) -> None:
    steps = [s.next_step(max_chunk) for s in seqs]
    result = ex.execute(StepPlan(steps))
    assert result.step_time_s > 0
    for s, st in zip(seqs, steps, strict=True):
        s.advance(st, result.tokens)


def prompt_of(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100_000) for _ in range(n)]


def shuffled_blocks(num_blocks: int, seed: int) -> list[list[int]]:
    ids = list(range(num_blocks))
    random.Random(seed).shuffle(ids)
    return [ids[i : i + 8] for i in range(0, num_blocks, 8)]  # 8 blocks = 64 tokens per sequence


@pytest.fixture(scope="module")
def ex() -> TorchExecutor:
    return build_torch_executor(
        shape="tiny", device="cpu", block_size=BLOCK, num_blocks=64, seed=7, max_model_len=256
    )


def test_llama3_rope_scaling_matches_direct_formula() -> None:
    for name in ("tiny", "llama-3.2-1b", "llama-3.1-8b"):
        cfg = named_shape(name)
        got = rope_inv_freq(cfg)
        want = torch.tensor(direct_llama3_inv_freq(cfg), dtype=torch.float64)
        torch.testing.assert_close(got, want, rtol=1e-12, atol=0)
        unscaled = torch.tensor(
            direct_llama3_inv_freq(named_shape(name, rope_scaling=None)), dtype=torch.float64
        )
        # The scaling really changes the low frequencies and keeps the highest one.
        assert got[0] == unscaled[0] and bool((got < unscaled).any())


def test_reference_forward_matches_independent_naive(ex: TorchExecutor) -> None:
    tokens = prompt_of(40, seed=1)
    got = reference_forward(ex.weights, ex.config, torch.tensor(tokens))
    torch.testing.assert_close(
        got.double(), naive_logits(ex.weights, ex.config, tokens), rtol=1e-4, atol=1e-4
    )


def test_batched_paged_greedy_matches_naive_recompute(ex: TorchExecutor) -> None:
    tables = shuffled_blocks(64, seed=2)
    seqs = [Seq(f"r{i}", prompt_of(n, seed=10 + i), tables[i]) for i, n in enumerate([5, 17, 33, 1])]
    for _ in range(6):  # step 1: four prefills in one batch; then batched decodes
        run(ex, seqs)
    for s in seqs:
        assert s.out == naive_greedy(ex.weights, ex.config, s.prompt, 6), s.rid


def test_paged_logits_match_naive_at_every_step(ex: TorchExecutor) -> None:
    s = Seq("a", prompt_of(21, seed=3), shuffled_blocks(64, seed=4)[0])
    for _ in range(4):
        step = s.next_step()
        logits = ex.logits([step])[0].double()
        want = naive_logits(ex.weights, ex.config, s.all_tokens)[-1]
        torch.testing.assert_close(logits, want, rtol=1e-4, atol=1e-4)
        s.advance(step, {"a": int(logits.argmax())})


def test_chunked_prefill_equals_unchunked(ex: TorchExecutor) -> None:
    tables = shuffled_blocks(64, seed=5)
    prompt = prompt_of(45, seed=6)
    whole = Seq("w", prompt, tables[0])
    chunked = Seq("c", prompt, tables[1])
    for _ in range(5):
        run(ex, [whole])
    # Chunks of 13 cross block boundaries at odd offsets: 13, 13, 13, 6.
    while not chunked.out:
        run(ex, [chunked], max_chunk=13)
    assert chunked.computed == 45
    for _ in range(4):
        run(ex, [chunked])
    assert chunked.out == whole.out


def test_chunk_logits_at_each_boundary_match_naive(ex: TorchExecutor) -> None:
    prompt = prompt_of(30, seed=8)
    naive = naive_logits(ex.weights, ex.config, prompt)
    blocks = shuffled_blocks(64, seed=9)[0]
    start = 0
    for size in (7, 12, 11):  # prefix lengths 0, 7, 19
        chunk = prompt[start : start + size]
        got = ex.logits([SeqStep("x", chunk, start, blocks, True, 0)])[0]
        torch.testing.assert_close(got.double(), naive[start + size - 1], rtol=1e-4, atol=1e-4)
        start += size


def test_mixed_prefill_chunk_and_decode_batch_equals_separate(ex: TorchExecutor) -> None:
    tables = shuffled_blocks(64, seed=11)

    def fresh(offset: int) -> list[Seq]:
        return [
            Seq("dec", prompt_of(19, seed=12), tables[offset]),
            Seq("chunk2", prompt_of(40, seed=13), tables[offset + 1]),
            Seq("first", prompt_of(25, seed=14), tables[offset + 2]),
            Seq("dec2", prompt_of(3, seed=15), tables[offset + 3]),
        ]

    def prepare(seqs: list[Seq]) -> None:
        dec, chunk2, _first, dec2 = seqs
        run(ex, [dec])
        run(ex, [dec])  # now decoding
        run(ex, [dec2])
        run(ex, [chunk2], max_chunk=16)  # 16 of 40 prompt tokens cached

    def sampling_all(st: SeqStep) -> SeqStep:
        # Every row samples, so each sequence's logits can be compared.
        return SeqStep(st.request_id, st.token_ids, st.start_pos, st.block_table, True, st.output_index)

    alone = fresh(0)
    prepare(alone)
    separate_logits = [ex.logits([sampling_all(s.next_step(max_chunk=12))])[0] for s in alone]

    mixed = fresh(4)
    prepare(mixed)
    steps = [s.next_step(max_chunk=12) for s in mixed]
    assert [st.is_prefill for st in steps] == [False, True, True, False]
    assert [st.sample for st in steps] == [True, False, False, True]
    mixed_logits = ex.logits([sampling_all(st) for st in steps])
    for i, want in enumerate(separate_logits):
        torch.testing.assert_close(mixed_logits[i], want, rtol=1e-4, atol=1e-4)


def test_mixed_batch_tokens_equal_separate_runs(ex: TorchExecutor) -> None:
    tables = shuffled_blocks(64, seed=16)
    a_alone = Seq("a", prompt_of(12, seed=17), tables[0])
    b_alone = Seq("b", prompt_of(50, seed=18), tables[1])
    for _ in range(6):
        run(ex, [a_alone])
    while len(b_alone.out) < 3:
        run(ex, [b_alone], max_chunk=16)

    a = Seq("a", prompt_of(12, seed=17), tables[2])
    b = Seq("b", prompt_of(50, seed=18), tables[3])
    run(ex, [a])  # a decodes while b prefills in chunks beside it
    while len(a.out) < 6 or len(b.out) < 3:
        active = [s for s, n in ((a, 6), (b, 3)) if len(s.out) < n]
        run(ex, active, max_chunk=16)
    assert a.out == a_alone.out and b.out == b_alone.out


@pytest.mark.parametrize("sampling", [GREEDY, SamplingParams(temperature=0.9, top_p=0.95, seed=123)])
def test_preempted_sequence_recomputes_same_tokens(ex: TorchExecutor, sampling: SamplingParams) -> None:
    tables = shuffled_blocks(64, seed=19)
    ref = Seq("p", prompt_of(20, seed=20), tables[0], sampling)
    for _ in range(8):
        run(ex, [ref])

    s = Seq("p", prompt_of(20, seed=20), tables[1], sampling)
    for _ in range(4):
        run(ex, [s])
    # Preempted: its blocks go to another sequence that overwrites them, then it is recomputed
    # from scratch (prompt + 4 generated tokens, in chunks) into different blocks.
    other = Seq("other", prompt_of(60, seed=21), tables[1])
    run(ex, [other])
    s.preempt(tables[2])
    while len(s.out) < 8:
        run(ex, [s], max_chunk=9)
    assert s.out == ref.out
    if sampling.temperature > 0:
        assert s.out != naive_greedy(ex.weights, ex.config, s.prompt, 8)

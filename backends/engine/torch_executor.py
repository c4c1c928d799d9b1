"""The torch executor: runs step plans through a real Llama-architecture model with a paged KV cache.

One step = one forward pass over every token of the plan (decodes and prefill chunks together in
the dense layers), attention over the block-table cache (``paged_attention``), logits only for the
rows that sample, then greedy or seeded temperature/top-p sampling.

Sampling is reproducible per request: the generator for a sampled token is seeded from
(request seed, output_index) — or (executor seed, request id) when the request gives no seed — so
a sequence that is preempted and recomputed draws the same tokens again.

Weights: seeded random weights for a named shape (``tiny``, ``llama-3.2-1b``, ``llama-3.1-8b``),
served with the default cl100k tokenizer (sampling is restricted to ids cl100k can decode, plus its
``<|endoftext|>`` as EOS); or a local Hugging Face directory, whose ``tokenizer.json`` (if any)
becomes ``.tokenizer``. bf16 on CUDA, fp32 on CPU unless ``dtype`` says otherwise.
"""

from __future__ import annotations

import hashlib
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from backends.engine.llama import (
    CL100K_EOS,
    LlamaConfig,
    LlamaWeights,
    compute_logits,
    forward_hidden,
    named_shape,
    rope_tables,
)
from backends.engine.paged_attention import PagedKVCache, SeqInput, StepLayout, build_layout, paged_attention
from backends.engine.types import SeqStep, StepPlan, StepResult
from backends.engine.weights import (
    HFTokenizer,
    load_hf_config,
    load_hf_weights,
    load_tokenizer,
    random_weights,
)

# cl100k's ordinary tokens are ids 0..100255; above that only a few special tokens exist.
CL100K_ORDINARY = 100_256

_DTYPES = {
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
}

_MASK63 = (1 << 63) - 1


def resolve_device(device: str | None) -> torch.device:
    if device in (None, "", "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    return dev


def resolve_dtype(dtype: str | None, device: torch.device) -> torch.dtype:
    if dtype in (None, "", "auto"):
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    try:
        return _DTYPES[dtype]
    except KeyError:
        raise ValueError(f"unknown dtype {dtype!r}; use one of {', '.join(_DTYPES)}") from None


def mix_seed(a: int, b: int) -> int:
    """A well-spread 63-bit seed from two integers (splitmix64 finaliser)."""
    x = (a * 0x9E3779B97F4A7C15 + b + 0x632BE59BD9B4E019) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return (x ^ (x >> 31)) & _MASK63


def sample_seed(step: SeqStep, executor_seed: int) -> int:
    if step.sampling.seed is not None:
        base = step.sampling.seed
    else:
        # Stable across processes (unlike hash()), so unseeded requests still replay after preemption.
        digest = hashlib.blake2b(step.request_id.encode(), digest_size=8).digest()
        base = mix_seed(executor_seed, int.from_bytes(digest, "little"))
    return mix_seed(base, step.output_index)


def sample_row(logits: torch.Tensor, temperature: float, top_p: float, gen: torch.Generator) -> torch.Tensor:
    """Temperature + nucleus sampling of one row of float32 logits; returns a 1-element index tensor."""
    probs = torch.softmax(logits / temperature, dim=-1)
    if top_p < 1.0:
        sorted_p, order = probs.sort(descending=True)
        # Keep the smallest prefix whose mass reaches top_p (the top token always survives).
        keep = (sorted_p.cumsum(-1) - sorted_p) < top_p
        choice = torch.multinomial(sorted_p * keep, 1, generator=gen)
        return order[choice]
    return torch.multinomial(probs, 1, generator=gen)


@dataclass(frozen=True, slots=True)
class EmitPolicy:
    """Which token ids the sampler may emit, and how stop tokens are reported.

    ``limit``: ids >= limit are never sampled (except stop ids) — random-weight models have more
    ids than the tokenizer can decode. Every id in ``stop_ids`` is reported as ``eos_token_id``,
    because the engine knows one EOS id while Llama 3 checkpoints list several.
    """

    limit: int | None
    eos_token_id: int | None
    stop_ids: tuple[int, ...]


def sample_tokens(
    logits: torch.Tensor, seqs: Sequence[SeqStep], *, emit: EmitPolicy, executor_seed: int
) -> list[int]:
    """One token per row of float32 ``logits`` (rows match ``seqs``; modified in place).

    Greedy rows share one argmax; each sampled row gets its own seeded generator. A single
    device sync at the end (the ``tolist``).
    """
    if emit.limit is not None and emit.limit < logits.shape[-1]:
        stop = torch.tensor(emit.stop_ids, dtype=torch.long, device=logits.device)
        keep = logits[:, stop]
        logits[:, emit.limit :] = -math.inf
        logits[:, stop] = keep
    picks = logits.argmax(dim=-1)
    for row, s in enumerate(seqs):
        temp, top_p = s.sampling.temperature, s.sampling.top_p
        if temp > 0.0 and top_p > 0.0:
            gen = torch.Generator(device=logits.device)
            gen.manual_seed(sample_seed(s, executor_seed))
            picks[row : row + 1] = sample_row(logits[row], temp, top_p, gen)
    tokens = [int(t) for t in picks.tolist()]
    if emit.eos_token_id is not None and emit.stop_ids:
        stops = set(emit.stop_ids)
        tokens = [emit.eos_token_id if t in stops else t for t in tokens]
    return tokens


class TorchExecutor:
    """Satisfies ``backends.engine.types.Executor``; ``execute`` blocks (run it in a worker thread)."""

    def __init__(
        self,
        *,
        config: LlamaConfig,
        weights: LlamaWeights,
        block_size: int,
        num_blocks: int,
        max_model_len: int,
        seed: int,
        emit: EmitPolicy,
        tokenizer: HFTokenizer | None,
    ) -> None:
        self.config = config
        self.weights = weights
        self.device = weights.device
        self.dtype = weights.dtype
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.max_model_len = max_model_len
        self.vocab_size = config.vocab_size
        self.eos_token_id = emit.eos_token_id
        self.tokenizer = tokenizer
        self.seed = seed
        self._emit = emit
        self.cache = PagedKVCache(
            num_layers=config.num_layers,
            num_blocks=num_blocks,
            block_size=block_size,
            num_kv_heads=config.num_kv_heads,
            head_dim=config.head_dim,
            dtype=self.dtype,
            device=self.device,
        )
        self._cos, self._sin = rope_tables(config, max_model_len, self.device)

    def _layout(self, seqs: Sequence[SeqStep]) -> StepLayout:
        for s in seqs:
            if s.start_pos + len(s.token_ids) > self.max_model_len:
                raise ValueError(
                    f"request {s.request_id}: position {s.start_pos + len(s.token_ids)} exceeds "
                    f"max_model_len {self.max_model_len}"
                )
        inputs = [SeqInput(s.token_ids, s.start_pos, s.block_table, s.sample) for s in seqs]
        return build_layout(inputs, block_size=self.block_size, device=self.device)

    def logits(self, seqs: Sequence[SeqStep]) -> torch.Tensor:
        """Runs the forward pass (writing KV) and returns float32 logits [S, vocab] for the sampling seqs."""
        layout = self._layout(seqs)
        cache = self.cache
        hidden = forward_hidden(
            self.weights,
            self.config,
            layout.token_ids,
            self._cos[layout.positions],
            self._sin[layout.positions],
            lambda i, q, k, v: paged_attention(cache, i, layout, q, k, v),
        )
        return compute_logits(self.weights, self.config, hidden.index_select(0, layout.sample_rows))

    def sample(self, logits: torch.Tensor, seqs: Sequence[SeqStep]) -> list[int]:
        return sample_tokens(logits, seqs, emit=self._emit, executor_seed=self.seed)

    def execute(self, plan: StepPlan) -> StepResult:
        if not plan.seqs:
            return StepResult(tokens={}, step_time_s=0.0)
        t0 = time.perf_counter()
        # inference_mode here, not around the caller: execute usually runs in a worker thread.
        with torch.inference_mode():
            sampled = [s for s in plan.seqs if s.sample]
            logits = self.logits(plan.seqs)
            tokens = self.sample(logits, sampled) if sampled else []
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
        elapsed = time.perf_counter() - t0
        return StepResult(
            tokens={s.request_id: t for s, t in zip(sampled, tokens, strict=True)}, step_time_s=elapsed
        )


def activation_reserve_bytes(cfg: LlamaConfig, max_tokens: int, dtype: torch.dtype) -> int:
    """Rough peak of a step's activations for ``max_tokens`` tokens, plus allocator/workspace slack."""
    elt = torch.empty((), dtype=dtype).element_size()
    per_token = (
        6 * cfg.hidden_size  # residual, normed input, attention output, projections
        + cfg.q_size
        + 2 * cfg.kv_size  # fused qkv
        + 2 * cfg.q_size  # rotated q/k copies
        + 2 * cfg.num_heads * cfg.head_dim  # K/V expanded to all query heads for a long chunk
        + 3 * cfg.intermediate_size  # gate|up and the SwiGLU product
    )
    logits = 256 * cfg.vocab_size * 4 * 3  # a batch of sampled rows, with sort buffers
    return 2 * per_token * max_tokens * elt + logits + (1 << 30)


def auto_num_blocks(
    cfg: LlamaConfig,
    *,
    device: torch.device,
    dtype: torch.dtype,
    block_size: int,
    max_model_len: int,
    gpu_memory_utilization: float,
) -> int:
    per_block = PagedKVCache.bytes_per_block(
        num_layers=cfg.num_layers,
        block_size=block_size,
        num_kv_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim,
        dtype=dtype,
    )
    blocks_per_seq = -(-max_model_len // block_size)
    if device.type != "cuda":
        return 4 * blocks_per_seq
    free, total = torch.cuda.mem_get_info(device)
    # Like vLLM: the process may fill `utilization` of the whole device; what is already used
    # (weights, other processes) and a step's activations come out of that.
    budget = int(total * gpu_memory_utilization) - (total - free)
    budget -= activation_reserve_bytes(cfg, max_model_len, dtype)
    num_blocks = budget // per_block
    if num_blocks < blocks_per_seq:
        raise MemoryError(
            f"KV cache would get {max(num_blocks, 0)} blocks of {block_size} tokens, fewer than one "
            f"max_model_len={max_model_len} sequence needs ({blocks_per_seq}); lower max_model_len or "
            "free GPU memory"
        )
    return int(num_blocks)


def build_torch_executor(
    *,
    shape: str = "tiny",
    model_dir: str | None = None,
    device: str | None = None,
    dtype: str | None = None,
    block_size: int = 16,
    num_blocks: int | None = None,
    seed: int = 0,
    max_model_len: int = 4096,
    gpu_memory_utilization: float = 0.9,
) -> TorchExecutor:
    dev = resolve_device(device)
    dt = resolve_dtype(dtype, dev)
    tokenizer: HFTokenizer | None = None
    if model_dir is not None:
        cfg = load_hf_config(model_dir)
        if max_model_len > cfg.max_position_embeddings:
            raise ValueError(
                f"max_model_len {max_model_len} exceeds the model's max_position_embeddings "
                f"{cfg.max_position_embeddings}"
            )
        weights = load_hf_weights(model_dir, cfg, device=dev, dtype=dt)
        tokenizer = load_tokenizer(model_dir)
        stop_ids = cfg.eos_token_ids
        if tokenizer is not None:
            emit = EmitPolicy(
                min(tokenizer.vocab_size, cfg.vocab_size), stop_ids[0] if stop_ids else None, stop_ids
            )
        else:
            # No tokenizer.json: the server falls back to cl100k, so only emit what it can decode.
            emit = EmitPolicy(
                CL100K_ORDINARY, stop_ids[0] if stop_ids else CL100K_EOS, stop_ids or (CL100K_EOS,)
            )
    else:
        cfg = named_shape(shape)
        weights = random_weights(cfg, device=dev, dtype=dt, seed=seed)
        emit = EmitPolicy(CL100K_ORDINARY, CL100K_EOS, (CL100K_EOS,))
    if num_blocks is None:
        num_blocks = auto_num_blocks(
            cfg,
            device=dev,
            dtype=dt,
            block_size=block_size,
            max_model_len=max_model_len,
            gpu_memory_utilization=gpu_memory_utilization,
        )
    return TorchExecutor(
        config=cfg,
        weights=weights,
        block_size=block_size,
        num_blocks=num_blocks,
        max_model_len=max_model_len,
        seed=seed,
        emit=emit,
        tokenizer=tokenizer,
    )

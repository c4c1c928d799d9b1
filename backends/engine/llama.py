"""A Llama-architecture decoder in plain torch: config, named shapes, RoPE, and the layer math.

The layer stack is written once (``forward_hidden``) and takes the attention as a callable, so the
paged executor (attention over the block-table KV cache) and the full-recompute reference
(``reference_forward``: plain causal attention over the whole sequence, no cache) share every other
op. Weights are kept fused (QKV in one matrix, gate+up in one matrix) so each layer is a handful of
large GEMMs over all tokens of a step.

Head layout follows Hugging Face checkpoints: rotate-half RoPE, and query head ``h`` uses KV head
``h // (num_heads // num_kv_heads)``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.nn.functional as F


@dataclass(frozen=True, slots=True)
class Llama3RopeScaling:
    """Llama 3.1's frequency-dependent RoPE stretch (``rope_type: llama3`` in HF configs)."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclass(frozen=True, slots=True)
class LlamaConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 500_000.0
    rope_scaling: Llama3RopeScaling | None = None
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 131_072
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def num_params(self) -> int:
        per_layer = (
            self.hidden_size * (self.q_size + 2 * self.kv_size)
            + self.q_size * self.hidden_size
            + 3 * self.hidden_size * self.intermediate_size
            + 2 * self.hidden_size
        )
        head = 0 if self.tie_word_embeddings else self.vocab_size * self.hidden_size
        return self.vocab_size * self.hidden_size + head + self.hidden_size + self.num_layers * per_layer

    @classmethod
    def from_hf(cls, cfg: Mapping[str, Any]) -> LlamaConfig:
        """Reads a Hugging Face ``config.json`` dict of a Llama-architecture model."""
        model_type = cfg.get("model_type", "llama")
        if model_type != "llama":
            raise ValueError(f"unsupported model_type {model_type!r}: only 'llama' is implemented")
        if cfg.get("attention_bias") or cfg.get("mlp_bias"):
            raise ValueError("attention/MLP biases are not supported")
        if cfg.get("hidden_act", "silu") != "silu":
            raise ValueError(f"unsupported hidden_act {cfg.get('hidden_act')!r}")
        num_heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        eos = cfg.get("eos_token_id")
        eos_ids = (
            tuple(int(e) for e in eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        )
        bos = cfg.get("bos_token_id")
        return cls(
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or num_heads),
            head_dim=int(cfg.get("head_dim") or hidden // num_heads),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=float(cfg.get("rope_theta", 10_000.0)),
            rope_scaling=_rope_scaling_from_hf(cfg.get("rope_scaling")),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            bos_token_id=None if bos is None else int(bos),
            eos_token_ids=eos_ids,
        )

    def to_hf(self) -> dict[str, Any]:
        """The ``config.json`` dict Hugging Face would write for this shape (used to save checkpoints)."""
        out: dict[str, Any] = {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": None,
            "tie_word_embeddings": self.tie_word_embeddings,
            "max_position_embeddings": self.max_position_embeddings,
            "hidden_act": "silu",
            "bos_token_id": self.bos_token_id,
            "eos_token_id": list(self.eos_token_ids)
            if len(self.eos_token_ids) != 1
            else self.eos_token_ids[0],
        }
        if self.rope_scaling is not None:
            s = self.rope_scaling
            out["rope_scaling"] = {
                "rope_type": "llama3",
                "factor": s.factor,
                "low_freq_factor": s.low_freq_factor,
                "high_freq_factor": s.high_freq_factor,
                "original_max_position_embeddings": s.original_max_position_embeddings,
            }
        return out


def _rope_scaling_from_hf(raw: Mapping[str, Any] | None) -> Llama3RopeScaling | None:
    if not raw:
        return None
    kind = raw.get("rope_type", raw.get("type"))
    if kind == "default":
        return None
    if kind != "llama3":
        raise ValueError(f"unsupported rope_scaling type {kind!r}: only 'llama3' is implemented")
    return Llama3RopeScaling(
        factor=float(raw["factor"]),
        low_freq_factor=float(raw["low_freq_factor"]),
        high_freq_factor=float(raw["high_freq_factor"]),
        original_max_position_embeddings=int(raw["original_max_position_embeddings"]),
    )


# cl100k's <|endoftext|>: random-weight models are served with the default cl100k tokenizer.
CL100K_EOS = 100257

_LLAMA3_EOS = (128001, 128008, 128009)

SHAPES: Mapping[str, LlamaConfig] = {
    # Small enough for CPU tests; vocab covers every cl100k id. Uses llama3 scaling (with a short
    # original context) so the scaled RoPE path is exercised everywhere.
    "tiny": LlamaConfig(
        vocab_size=100_352,
        hidden_size=64,
        intermediate_size=128,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        rope_scaling=Llama3RopeScaling(8.0, 1.0, 4.0, 256),
        eos_token_ids=(CL100K_EOS,),
    ),
    "llama-3.2-1b": LlamaConfig(
        vocab_size=128_256,
        hidden_size=2048,
        intermediate_size=8192,
        num_layers=16,
        num_heads=32,
        num_kv_heads=8,
        head_dim=64,
        rope_scaling=Llama3RopeScaling(32.0, 1.0, 4.0, 8192),
        tie_word_embeddings=True,
        bos_token_id=128000,
        eos_token_ids=_LLAMA3_EOS,
    ),
    "llama-3.1-8b": LlamaConfig(
        vocab_size=128_256,
        hidden_size=4096,
        intermediate_size=14_336,
        num_layers=32,
        num_heads=32,
        num_kv_heads=8,
        head_dim=128,
        rope_scaling=Llama3RopeScaling(8.0, 1.0, 4.0, 8192),
        bos_token_id=128000,
        eos_token_ids=_LLAMA3_EOS,
    ),
}


def named_shape(name: str, **overrides: Any) -> LlamaConfig:
    try:
        cfg = SHAPES[name]
    except KeyError:
        raise ValueError(f"unknown shape {name!r}; known: {', '.join(SHAPES)}") from None
    return replace(cfg, **overrides) if overrides else cfg


@dataclass(slots=True)
class LayerWeights:
    attn_norm: torch.Tensor  # [hidden]
    wqkv: torch.Tensor  # [q_size + 2 * kv_size, hidden]: q rows, then k, then v
    wo: torch.Tensor  # [hidden, q_size]
    mlp_norm: torch.Tensor  # [hidden]
    w_gate_up: torch.Tensor  # [2 * intermediate, hidden]: gate rows, then up
    w_down: torch.Tensor  # [hidden, intermediate]


@dataclass(slots=True)
class LlamaWeights:
    embed: torch.Tensor  # [vocab, hidden]
    layers: list[LayerWeights]
    final_norm: torch.Tensor  # [hidden]
    lm_head: torch.Tensor  # [vocab, hidden]; the same tensor as ``embed`` when tied

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.dtype

    @property
    def device(self) -> torch.device:
        return self.embed.device

    def nbytes(self) -> int:
        tensors = [self.embed, self.final_norm]
        if self.lm_head.data_ptr() != self.embed.data_ptr():
            tensors.append(self.lm_head)
        for layer in self.layers:
            tensors += [layer.attn_norm, layer.wqkv, layer.wo, layer.mlp_norm, layer.w_gate_up, layer.w_down]
        return sum(t.numel() * t.element_size() for t in tensors)


def rope_inv_freq(cfg: LlamaConfig) -> torch.Tensor:
    """Per-pair inverse frequencies [head_dim/2] in float64, with llama3 scaling applied if configured."""
    inv_freq = 1.0 / (
        cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2, dtype=torch.float64) / cfg.head_dim)
    )
    s = cfg.rope_scaling
    if s is None:
        return inv_freq
    # Long wavelengths (low frequencies) are stretched by `factor`, short ones kept, and the band in
    # between interpolated, so local attention patterns survive while the context grows.
    wavelen = 2 * math.pi / inv_freq
    low_freq_wavelen = s.original_max_position_embeddings / s.low_freq_factor
    high_freq_wavelen = s.original_max_position_embeddings / s.high_freq_factor
    smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
        s.high_freq_factor - s.low_freq_factor
    )
    blended = (1 - smooth) * inv_freq / s.factor + smooth * inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / s.factor, blended)
    return torch.where(wavelen < high_freq_wavelen, inv_freq, scaled)


def rope_tables(cfg: LlamaConfig, max_len: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables [max_len, head_dim] in float32 (each frequency repeated for both halves)."""
    pos = torch.arange(max_len, dtype=torch.float64)
    angles = torch.outer(pos, rope_inv_freq(cfg))
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos().float().to(device), angles.sin().float().to(device)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # torch's own op: one fused kernel on CUDA (fewer launches per decode step), float32
    # statistics for bf16 inputs.
    return F.rms_norm(x, (x.shape[-1],), weight, eps)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, D]; cos/sin [T, D] already in x's dtype."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


# attend(layer_index, q [T, Hq, D], k [T, Hkv, D], v [T, Hkv, D]) -> [T, Hq, D]
AttendFn = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def forward_hidden(
    w: LlamaWeights,
    cfg: LlamaConfig,
    token_ids: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    attend: AttendFn,
    compute_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Runs all layers over a flat batch of tokens [T]; returns the residual stream [T, hidden].

    ``cos``/``sin`` are the rows for each token's position. ``compute_dtype`` upcasts each weight
    as it is used (the reference check runs bf16 weights in float32 without a full fp32 copy).
    """
    dt = compute_dtype or w.dtype

    def p(t: torch.Tensor) -> torch.Tensor:
        return t if t.dtype == dt else t.to(dt)

    n = token_ids.shape[0]
    h = F.embedding(token_ids, w.embed).to(dt)
    cos, sin = cos.to(dt), sin.to(dt)
    splits = [cfg.q_size + cfg.kv_size, cfg.kv_size]
    for i, layer in enumerate(w.layers):
        x = rms_norm(h, p(layer.attn_norm), cfg.rms_norm_eps)
        qk, v = F.linear(x, p(layer.wqkv)).split(splits, dim=-1)
        # Queries and keys rotated together: one set of RoPE kernels per layer instead of two.
        qk = apply_rope(qk.view(n, cfg.num_heads + cfg.num_kv_heads, cfg.head_dim), cos, sin)
        q, k = qk.split([cfg.num_heads, cfg.num_kv_heads], dim=1)
        o = attend(i, q, k, v.view(n, cfg.num_kv_heads, cfg.head_dim))
        h = h + F.linear(o.reshape(n, cfg.q_size), p(layer.wo))
        x = rms_norm(h, p(layer.mlp_norm), cfg.rms_norm_eps)
        gate, up = F.linear(x, p(layer.w_gate_up)).chunk(2, dim=-1)
        h = h + F.linear(F.silu(gate) * up, p(layer.w_down))
    return h


def compute_logits(w: LlamaWeights, cfg: LlamaConfig, hidden: torch.Tensor) -> torch.Tensor:
    """Final norm + LM head for the given rows [N, hidden] -> float32 logits [N, vocab]."""
    dt = hidden.dtype
    x = rms_norm(hidden, w.final_norm.to(dt), cfg.rms_norm_eps)
    return F.linear(x, w.lm_head.to(dt)).float()


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Plain causal self-attention of one whole sequence: q [T, Hq, D], k/v [T, Hkv, D]."""
    group = q.shape[1] // k.shape[1]
    # 4-D inputs with KV heads expanded explicitly, so a fused SDPA kernel can take them.
    kx = k.repeat_interleave(group, dim=1).transpose(0, 1).unsqueeze(0)
    vx = v.repeat_interleave(group, dim=1).transpose(0, 1).unsqueeze(0)
    out = F.scaled_dot_product_attention(q.transpose(0, 1).unsqueeze(0), kx, vx, is_causal=True)
    return out[0].transpose(0, 1)


def reference_forward(
    w: LlamaWeights,
    cfg: LlamaConfig,
    token_ids: torch.Tensor,
    compute_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Full recompute of one sequence without any cache: float32 logits for every position [T, vocab]."""
    n = token_ids.shape[0]
    cos, sin = rope_tables(cfg, n, token_ids.device)
    h = forward_hidden(
        w, cfg, token_ids, cos, sin, lambda _i, q, k, v: causal_attention(q, k, v), compute_dtype
    )
    return compute_logits(w, cfg, h)

"""Model weights: seeded random weights for a named shape, or a local Hugging Face Llama directory.

A model directory holds ``config.json``, one or more ``*.safetensors`` files (sharded checkpoints
come with ``model.safetensors.index.json``) and optionally ``tokenizer.json``. Tensors are read one
at a time with ``safetensors.safe_open`` and moved to the target device and dtype at once, so peak
host memory is about one layer, not the whole checkpoint.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from backends.engine.llama import LayerWeights, LlamaConfig, LlamaWeights

INDEX_FILE = "model.safetensors.index.json"


def random_weights(cfg: LlamaConfig, *, device: torch.device, dtype: torch.dtype, seed: int) -> LlamaWeights:
    """Seeded random weights, generated on the target device (an 8B model would take minutes on a CPU).

    The same seed gives the same weights on the same kind of device; CPU and CUDA streams differ.
    Output projections are scaled down with depth (GPT-2 style) so the residual stream stays
    well-conditioned and greedy tokens are not decided by rounding noise.
    """
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    std = 0.02
    out_std = std / (2 * cfg.num_layers) ** 0.5

    def normal(*shape: int, s: float = std) -> torch.Tensor:
        return torch.empty(shape, device=device, dtype=dtype).normal_(0.0, s, generator=gen)

    def ones() -> torch.Tensor:
        return torch.ones(cfg.hidden_size, device=device, dtype=dtype)

    embed = normal(cfg.vocab_size, cfg.hidden_size)
    layers = [
        LayerWeights(
            attn_norm=ones(),
            wqkv=normal(cfg.q_size + 2 * cfg.kv_size, cfg.hidden_size),
            wo=normal(cfg.hidden_size, cfg.q_size, s=out_std),
            mlp_norm=ones(),
            w_gate_up=normal(2 * cfg.intermediate_size, cfg.hidden_size),
            w_down=normal(cfg.hidden_size, cfg.intermediate_size, s=out_std),
        )
        for _ in range(cfg.num_layers)
    ]
    lm_head = embed if cfg.tie_word_embeddings else normal(cfg.vocab_size, cfg.hidden_size)
    return LlamaWeights(embed=embed, layers=layers, final_norm=ones(), lm_head=lm_head)


def load_hf_config(model_dir: str | Path) -> LlamaConfig:
    path = Path(model_dir) / "config.json"
    with path.open(encoding="utf-8") as f:
        return LlamaConfig.from_hf(json.load(f))


def _weight_files(model_dir: Path) -> dict[str, Path]:
    """Maps every tensor name to the file holding it."""
    index = model_dir / INDEX_FILE
    if index.exists():
        with index.open(encoding="utf-8") as f:
            weight_map: dict[str, str] = json.load(f)["weight_map"]
        return {name: model_dir / fname for name, fname in weight_map.items()}
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {model_dir}")
    names: dict[str, Path] = {}
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                names[name] = file
    return names


def load_hf_weights(
    model_dir: str | Path, cfg: LlamaConfig, *, device: torch.device, dtype: torch.dtype
) -> LlamaWeights:
    root = Path(model_dir)
    where = _weight_files(root)
    with ExitStack() as stack:
        handles: dict[Path, Any] = {}

        def get(name: str) -> torch.Tensor:
            if name not in where:
                raise KeyError(f"tensor {name!r} missing from the checkpoint in {root}")
            file = where[name]
            if file not in handles:
                handles[file] = stack.enter_context(safe_open(str(file), framework="pt"))
            return handles[file].get_tensor(name).to(device=device, dtype=dtype)

        def cat(names: Sequence[str]) -> torch.Tensor:
            return torch.cat([get(n) for n in names], dim=0)

        embed = get("model.embed_tokens.weight")
        layers = []
        for i in range(cfg.num_layers):
            pre = f"model.layers.{i}."
            layers.append(
                LayerWeights(
                    attn_norm=get(pre + "input_layernorm.weight"),
                    wqkv=cat([pre + f"self_attn.{p}_proj.weight" for p in "qkv"]),
                    wo=get(pre + "self_attn.o_proj.weight"),
                    mlp_norm=get(pre + "post_attention_layernorm.weight"),
                    w_gate_up=cat([pre + "mlp.gate_proj.weight", pre + "mlp.up_proj.weight"]),
                    w_down=get(pre + "mlp.down_proj.weight"),
                )
            )
        final_norm = get("model.norm.weight")
        # Tied checkpoints simply omit lm_head.weight.
        lm_head = embed if cfg.tie_word_embeddings or "lm_head.weight" not in where else get("lm_head.weight")
    weights = LlamaWeights(embed=embed, layers=layers, final_norm=final_norm, lm_head=lm_head)
    _check_shapes(weights, cfg)
    return weights


def _check_shapes(w: LlamaWeights, cfg: LlamaConfig) -> None:
    # A config/checkpoint mismatch would otherwise surface as a confusing matmul error mid-request.
    expected = {
        "embed": (w.embed, (cfg.vocab_size, cfg.hidden_size)),
        "lm_head": (w.lm_head, (cfg.vocab_size, cfg.hidden_size)),
    }
    for i, layer in enumerate(w.layers):
        expected[f"layer {i} qkv"] = (layer.wqkv, (cfg.q_size + 2 * cfg.kv_size, cfg.hidden_size))
        expected[f"layer {i} o"] = (layer.wo, (cfg.hidden_size, cfg.q_size))
        expected[f"layer {i} gate_up"] = (layer.w_gate_up, (2 * cfg.intermediate_size, cfg.hidden_size))
        expected[f"layer {i} down"] = (layer.w_down, (cfg.hidden_size, cfg.intermediate_size))
    for what, (tensor, shape) in expected.items():
        if tuple(tensor.shape) != shape:
            raise ValueError(f"{what} weight has shape {tuple(tensor.shape)}, config.json implies {shape}")


class HFTokenizer:
    """A ``tokenizers.Tokenizer`` behind the small encode/decode surface the server uses.

    ``encode`` adds no special tokens unless asked (like tiktoken's ``encode``), so prompt
    counts agree with the gateway's pricing; pass ``add_special_tokens=True`` to get the BOS a
    Llama checkpoint was trained with.
    """

    def __init__(self, path: str | Path) -> None:
        from tokenizers import Tokenizer

        self._tok = Tokenizer.from_file(str(path))

    @property
    def vocab_size(self) -> int:
        return int(self._tok.get_vocab_size(with_added_tokens=True))

    def encode(self, text: str, *, add_special_tokens: bool = False) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        return str(self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens))

    def token_to_id(self, token: str) -> int | None:
        tid = self._tok.token_to_id(token)
        return None if tid is None else int(tid)


def load_tokenizer(model_dir: str | Path) -> HFTokenizer | None:
    path = Path(model_dir) / "tokenizer.json"
    return HFTokenizer(path) if path.exists() else None

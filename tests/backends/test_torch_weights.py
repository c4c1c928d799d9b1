"""Hugging Face directory loading: config parsing, sharded and tied safetensors checkpoints, tokenizer."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("safetensors")

import torch
from safetensors.torch import save_file

from backends.engine.llama import LlamaConfig, LlamaWeights, named_shape, reference_forward
from backends.engine.torch_executor import build_torch_executor
from backends.engine.types import SeqStep
from backends.engine.weights import random_weights


def hf_tensors(w: LlamaWeights, cfg: LlamaConfig, *, tied: bool) -> dict[str, torch.Tensor]:
    """The weights under Hugging Face's LlamaForCausalLM names, unfused."""
    out = {"model.embed_tokens.weight": w.embed, "model.norm.weight": w.final_norm}
    if not tied:
        out["lm_head.weight"] = w.lm_head
    for i, layer in enumerate(w.layers):
        q, k, v = layer.wqkv.split([cfg.q_size, cfg.kv_size, cfg.kv_size])
        gate, up = layer.w_gate_up.chunk(2)
        pre = f"model.layers.{i}."
        out |= {
            pre + "input_layernorm.weight": layer.attn_norm,
            pre + "post_attention_layernorm.weight": layer.mlp_norm,
            pre + "self_attn.q_proj.weight": q,
            pre + "self_attn.k_proj.weight": k,
            pre + "self_attn.v_proj.weight": v,
            pre + "self_attn.o_proj.weight": layer.wo,
            pre + "mlp.gate_proj.weight": gate,
            pre + "mlp.up_proj.weight": up,
            pre + "mlp.down_proj.weight": layer.w_down,
        }
    return {name: t.contiguous().clone() for name, t in out.items()}


def save_checkpoint(root: Path, w: LlamaWeights, cfg: LlamaConfig, *, shards: int) -> None:
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps(cfg.to_hf()))
    tensors = hf_tensors(w, cfg, tied=cfg.tie_word_embeddings)
    if shards == 1:
        save_file(tensors, str(root / "model.safetensors"))
        return
    names = sorted(tensors)
    weight_map: dict[str, str] = {}
    for s in range(shards):
        fname = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        part = names[s::shards]
        save_file({n: tensors[n] for n in part}, str(root / fname))
        weight_map |= dict.fromkeys(part, fname)
    index = {"metadata": {"total_size": 0}, "weight_map": weight_map}
    (root / "model.safetensors.index.json").write_text(json.dumps(index))


def make_tokenizer_json(path: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"[UNK]": 0, "hello": 1, "world": 2, "paged": 3, "attention": 4}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(path))


PROMPT = [17, 4242, 99, 100_000, 5, 31337, 2048, 7]


@pytest.mark.parametrize("tied,shards", [(False, 3), (True, 1)])
def test_hf_directory_round_trip_gives_identical_logits(tmp_path: Path, tied: bool, shards: int) -> None:
    cfg = named_shape("tiny", tie_word_embeddings=tied, eos_token_ids=(100257, 100258))
    weights = random_weights(cfg, device=torch.device("cpu"), dtype=torch.float32, seed=3)
    save_checkpoint(tmp_path, weights, cfg, shards=shards)
    if tied:
        assert "lm_head.weight" not in hf_tensors(weights, cfg, tied=True)

    ex = build_torch_executor(model_dir=str(tmp_path), device="cpu", num_blocks=8, block_size=16)
    assert ex.config == cfg
    assert ex.tokenizer is None and ex.eos_token_id == 100257
    assert (ex.weights.lm_head.data_ptr() == ex.weights.embed.data_ptr()) == tied
    tokens = torch.tensor(PROMPT)
    assert torch.equal(reference_forward(ex.weights, cfg, tokens), reference_forward(weights, cfg, tokens))
    paged = ex.logits([SeqStep("r", PROMPT, 0, [0], True, 0)])[0]
    torch.testing.assert_close(paged, reference_forward(weights, cfg, tokens)[-1], rtol=1e-5, atol=1e-5)


def test_tokenizer_json_is_loaded_and_limits_sampling(tmp_path: Path) -> None:
    cfg = named_shape("tiny")
    save_checkpoint(
        tmp_path, random_weights(cfg, device=torch.device("cpu"), dtype=torch.float32, seed=1), cfg, shards=1
    )
    make_tokenizer_json(tmp_path / "tokenizer.json")
    ex = build_torch_executor(model_dir=str(tmp_path), device="cpu", num_blocks=8, block_size=16)
    assert ex.tokenizer is not None
    ids = ex.tokenizer.encode("hello paged attention")
    assert ids == [1, 3, 4]
    assert ex.tokenizer.decode(ids) == "hello paged attention"
    logits = ex.logits([SeqStep("r", ids, 0, [0], True, 0)])
    # Only ids the tokenizer can decode (or EOS) may come out.
    token = ex.sample(logits, [SeqStep("r", ids, 0, [0], True, 0)])[0]
    assert token < 5 or token == ex.eos_token_id


def test_hf_config_parsing() -> None:
    raw = {
        "model_type": "llama",
        "vocab_size": 128256,
        "hidden_size": 2048,
        "intermediate_size": 8192,
        "num_hidden_layers": 16,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "rope_scaling": {
            "factor": 32.0,
            "high_freq_factor": 4.0,
            "low_freq_factor": 1.0,
            "original_max_position_embeddings": 8192,
            "rope_type": "llama3",
        },
        "tie_word_embeddings": True,
        "max_position_embeddings": 131072,
        "bos_token_id": 128000,
        "eos_token_id": [128001, 128008, 128009],
    }
    cfg = LlamaConfig.from_hf(raw)
    assert cfg == named_shape("llama-3.2-1b")
    assert cfg.head_dim == 64
    assert LlamaConfig.from_hf(cfg.to_hf()) == cfg
    assert LlamaConfig.from_hf({**raw, "rope_scaling": None}).rope_scaling is None
    with pytest.raises(ValueError, match="model_type"):
        LlamaConfig.from_hf({**raw, "model_type": "qwen2"})
    with pytest.raises(ValueError, match="rope_scaling"):
        LlamaConfig.from_hf({**raw, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}})


def test_mismatched_checkpoint_is_rejected(tmp_path: Path) -> None:
    cfg = named_shape("tiny")
    save_checkpoint(
        tmp_path, random_weights(cfg, device=torch.device("cpu"), dtype=torch.float32, seed=1), cfg, shards=1
    )
    wrong = replace(cfg, intermediate_size=96)
    (tmp_path / "config.json").write_text(json.dumps(wrong.to_hf()))
    with pytest.raises(ValueError, match="gate_up"):
        build_torch_executor(model_dir=str(tmp_path), device="cpu", num_blocks=8)

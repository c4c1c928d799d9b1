"""A tiny random-weight Llama for vLLM to serve without a model hub (tests/engines).

``write_tiny_llama(dir)`` writes a Hugging Face model directory that vLLM serves with
``--load-format dummy`` (random weights, so no weight files): ``config.json`` (LlamaForCausalLM,
hidden 128, 2 layers, 4 heads of 32 — the smallest head size vLLM's CPU attention takes — 2 KV
heads, 2048 positions, float32), ``generation_config.json``, and a tokenizer built here from
nothing installed: ``tokenizer.json`` is a byte-level BPE (GPT-2 style: 256 byte tokens, 250
merges learned by the small trainer below from the text in ``_CORPUS``, 6 special tokens: 512 in
all, the model's ``vocab_size``) and ``tokenizer_config.json`` carries bos/eos and a chat template:

    <|bos|><|system|>\\n{content}<|eos|>\\n<|user|>\\n{content}<|eos|>\\n<|assistant|>\\n

Every byte has a token, so any text encodes, and the gateway counts prompts with the same file
(``hf:<dir>/tokenizer.json``): a chat prompt is its messages' contents plus 3 + 4 per message
tokens (<|bos|>; per message its role token, "\\n", <|eos|>, "\\n"; then <|assistant|>, "\\n"),
for the roles system, user, assistant and tool (another role's name is spelt out in bytes); a
completions prompt is its text plus <|bos|>. Pure Python and deterministic: the same bytes each
run, no network, no third-party import; run it as ``python tests/engines/tiny_llama.py DIR``.
"""

from __future__ import annotations

import json
import re
import sys
from collections import Counter
from itertools import pairwise
from pathlib import Path

VOCAB_SIZE = 512
BOS = "<|bos|>"
EOS = "<|eos|>"
SPECIALS = (BOS, EOS, "<|system|>", "<|user|>", "<|assistant|>", "<|tool|>")
NUM_MERGES = VOCAB_SIZE - 256 - len(SPECIALS)

CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\\n' }}{{ message['content'] or '' }}{{ eos_token }}{{ '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)

# What the merges are learned from: plain English about what the tests send, a few KB.
_CORPUS = (
    """
The gateway admits a request when the budget of its tenant holds enough tokens for the prompt and
for the completion it may produce. A request that does not fit waits in a queue, and the queue is
served in the order of priority and then of arrival. When the engine reports that it is running
many sequences, or that its cache is nearly full, the gateway holds new requests back until the
load goes down again. Every response carries the usage the engine counted: the prompt tokens, the
completion tokens, and the total. A streamed response sends its usage in the last chunk before the
end of the stream, when the client asked for it with the stream options.
Name three colours. Red, green and blue are colours; so are yellow, orange, purple, black and white.
Count from one to ten: one, two, three, four, five, six, seven, eight, nine, ten.
Say hello to the world. Hello, world! Hello there, how are you today? I am fine, thank you.
Write a short story about a cat who lives in a library and reads the books at night while the
people sleep. The cat likes the books about the sea best, and the books about birds least of all.
What is the capital of France? The capital of France is Paris. What is the capital of Germany?
The capital of Germany is Berlin. What is two plus two? Two plus two is four.
You are a helpful assistant. Answer the question of the user in one sentence, and be brief.
The system prompt tells the model how to behave; the user message asks the question; the
assistant message is the answer the model gave. A tool message carries what a tool returned.
Tokens are pieces of words: a short common word is often one token, a long or rare word is split
into several, and numbers, spaces and punctuation have tokens of their own. The model reads the
tokens of the prompt, then writes the tokens of its answer one at a time until it writes the end
of sequence token or reaches the largest number of tokens it was allowed to write.
Time flies like an arrow; fruit flies like a banana. The quick brown fox jumps over the lazy dog.
She sells sea shells by the sea shore, and the shells she sells are surely sea shells.
"""
    * 2
)


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map of the 256 bytes to printable characters (what ByteLevel uses)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = list(keep)
    n = 0
    for b in range(256):
        if b not in keep:
            keep.append(b)
            chars.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(keep, chars, strict=True)}


# The ByteLevel pre-tokenizer's split (GPT-2's pattern; ASCII classes are enough for _CORPUS).
_SPLIT = re.compile(r"'(?:[sdmt]|ll|ve|re)| ?[A-Za-z]+| ?[0-9]+| ?[^\sA-Za-z0-9]+|\s+(?!\S)|\s+")


def _train_merges(text: str, byte_char: dict[int, str], count: int) -> list[tuple[str, str]]:
    """Plain BPE: merge the most frequent adjacent pair (ties: the smallest pair), ``count`` times."""
    words = Counter(tuple(byte_char[b] for b in piece.encode("utf-8")) for piece in _SPLIT.findall(text))
    merges: list[tuple[str, str]] = []
    while len(merges) < count:
        pairs: Counter[tuple[str, str]] = Counter()
        for word, n in words.items():
            for pair in pairwise(word):
                pairs[pair] += n
        if not pairs:
            raise ValueError("the corpus is too small for the merges asked for")
        best = min(pairs, key=lambda p: (-pairs[p], p))
        merges.append(best)
        joined = best[0] + best[1]
        merged: Counter[tuple[str, ...]] = Counter()
        for word, n in words.items():
            out: list[str] = []
            i = 0
            while i < len(word):
                if i + 1 < len(word) and (word[i], word[i + 1]) == best:
                    out.append(joined)
                    i += 2
                else:
                    out.append(word[i])
                    i += 1
            merged[tuple(out)] += n
        words = merged
    return merges


def _special_ids() -> dict[str, int]:
    """The special tokens come last: ids 506-511."""
    return {tok: 256 + NUM_MERGES + i for i, tok in enumerate(SPECIALS)}


def tokenizer_json() -> dict[str, object]:
    """The ``tokenizer.json`` document (Hugging Face tokenizers' format)."""
    byte_char = _bytes_to_unicode()
    vocab = {byte_char[b]: b for b in range(256)}
    merges = _train_merges(_CORPUS, byte_char, NUM_MERGES)
    for a, b in merges:
        vocab[a + b] = len(vocab)
    if len(vocab) != 256 + NUM_MERGES:
        raise AssertionError("a merge produced a token already in the vocabulary")
    special_ids = _special_ids()
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}
    bos_id = special_ids[BOS]
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [
            {
                "id": i,
                "content": tok,
                "single_word": False,
                "lstrip": False,
                "rstrip": False,
                "normalized": False,
                "special": True,
            }
            for tok, i in special_ids.items()
        ],
        "normalizer": None,
        "pre_tokenizer": byte_level,
        # Like Llama: encoding with special tokens puts <|bos|> first (the chat template writes its own).
        "post_processor": {
            "type": "TemplateProcessing",
            "single": [
                {"SpecialToken": {"id": BOS, "type_id": 0}},
                {"Sequence": {"id": "A", "type_id": 0}},
            ],
            "pair": [
                {"SpecialToken": {"id": BOS, "type_id": 0}},
                {"Sequence": {"id": "A", "type_id": 0}},
                {"SpecialToken": {"id": BOS, "type_id": 1}},
                {"Sequence": {"id": "B", "type_id": 1}},
            ],
            "special_tokens": {BOS: {"id": BOS, "ids": [bos_id], "tokens": [BOS]}},
        },
        "decoder": byte_level,
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": False,
            "byte_fallback": False,
            "ignore_merges": False,
            "vocab": vocab,
            "merges": [f"{a} {b}" for a, b in merges],
        },
    }


def write_tiny_llama(dir: Path) -> Path:
    """Write the model directory at ``dir`` (created if missing) and return it."""
    dir = Path(dir)
    dir.mkdir(parents=True, exist_ok=True)
    ids = _special_ids()
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": VOCAB_SIZE,
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "hidden_act": "silu",
        "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "bos_token_id": ids[BOS],
        "eos_token_id": ids[EOS],
        "torch_dtype": "float32",
    }
    generation = {"bos_token_id": ids[BOS], "eos_token_id": ids[EOS]}
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": EOS,
        "add_bos_token": True,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 2048,
        "chat_template": CHAT_TEMPLATE,
    }
    special_tokens_map = {"bos_token": BOS, "eos_token": EOS, "pad_token": EOS}
    for name, doc in (
        ("config.json", config),
        ("generation_config.json", generation),
        ("tokenizer.json", tokenizer_json()),
        ("tokenizer_config.json", tokenizer_config),
        ("special_tokens_map.json", special_tokens_map),
    ):
        (dir / name).write_text(json.dumps(doc, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    return dir


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python tests/engines/tiny_llama.py DIR")
    print(write_tiny_llama(Path(sys.argv[1])))

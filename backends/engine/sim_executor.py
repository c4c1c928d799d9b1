"""Simulated executor: no math, a step time from a cost model, deterministic readable tokens.

Cost model (per step, seconds)::

    linear    = floor_s + max(0, tokens - knee_tokens) * per_token_s
    attention = decode_kv_s * (sum of the decodes' KV lengths)
              + prefill_pair_s * sum over prefill chunks of chunk * (prefix + chunk / 2)
    step      = linear + attention

The flat floor up to a knee is the weight-read-bound regime (a small batch costs one pass over
the weights); past the knee the step is compute-bound and linear in tokens. Defaults are an
8B Llama-class model on an H100-class GPU, from public per-operator profiles (Vidur, MLSys
2024): ~5.6 ms flat up to ~128 tokens, then ~20 µs/token; decode attention reads ~128 KiB of KV
per cached token (32 layers x 8 KV heads x 128 dims x K,V x bf16) at ~3 TB/s (~40 ns/token);
prefill attention ~0.5 MFLOP per (query, key) pair at ~500 TFLOP/s effective (~1 ns/pair). A
28k-token unchunked prefill then takes 0.56 s linear + 0.39 s attention ~ 0.95 s.

Re-calibrate from measurements (e.g. the torch executor's) with a JSON or YAML file holding any
of the field names, loaded by ``CostModel.from_file``.

Tokens: a fixed list of common English words that are single cl100k tokens, indexed by a hash of
(request key, output_index), where the request key hashes the sampling seed (if any) and the
first 64 tokens of the sequence so far (prompt, then outputs). The same prompt and seed always yield the same text, and a preempted
request recomputed from scratch yields exactly the tokens it would have produced. EOS is never
produced unless ``eos_after`` asks for it.
"""

from __future__ import annotations

import hashlib
import json
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

from backends.engine.types import SeqStep, StepPlan, StepResult, TextTokenizer

# Single-token cl100k ids of " the", " of", " and", ... " forest" (all decode to readable words).
WORD_TOKEN_IDS: tuple[int, ...] = (
    279, 315, 323, 311, 304, 374, 430, 369, 433, 439, 449, 574, 389, 387, 555, 520, 420, 505, 477, 459,
    527, 539, 617, 719, 814, 902, 832, 499, 682, 1051, 584, 1070, 649, 810, 994, 1027, 706, 1053, 872,
    1063, 422, 690, 704, 779, 892, 922, 889, 1124, 1023, 1139, 1148, 1109, 1243, 1202, 1193, 927, 1101,
    1690, 1455, 502, 1253, 1093, 1521, 1176, 1667, 1436, 1306, 1403, 1274, 1778, 1903, 1790, 1664, 1524,
    1550, 904, 1648, 1511, 1917, 1405, 1884, 1555, 1990, 1855, 1396, 1288, 1606, 990, 1890, 1317, 961,
    1005, 1418, 1695, 2103, 1633, 1440, 1120, 1304, 1518, 9581, 3177, 15140, 3363, 3090, 1938, 3814,
    3838, 5754, 5021, 9998, 9624, 2115, 13863, 6693, 4731, 5684, 3321, 3446, 16385, 3157, 16700, 13952,
)  # fmt: skip
CL100K_VOCAB_SIZE = 100277
CL100K_EOS = 100257  # <|endoftext|>

_KEY_PREFIX_TOKENS = 64  # how much of the prompt identifies a request for token choice
_MAX_KEYS = 65536  # bound on remembered requests (the executor has no "request finished" hook)


@dataclass(frozen=True, slots=True)
class StepFeatures:
    """What a step's cost depends on: tokens in the step, the decodes' total KV length, and the
    prefill chunks' attention work (sum of chunk x (prefix + chunk / 2))."""

    tokens: int
    decode_kv: int
    prefill_pairs: float

    @classmethod
    def of(cls, plan: StepPlan) -> StepFeatures:
        tokens = 0
        decode_kv = 0
        prefill_pairs = 0.0
        for seq in plan.seqs:
            n = len(seq.token_ids)
            tokens += n
            if seq.is_prefill:
                prefill_pairs += n * (seq.start_pos + n / 2)
            else:
                decode_kv += seq.start_pos + 1
        return cls(tokens, decode_kv, prefill_pairs)


@dataclass(frozen=True, slots=True)
class CostModel:
    floor_s: float = 5.6e-3
    knee_tokens: int = 128
    per_token_s: float = 20e-6
    decode_kv_s: float = 40e-9
    prefill_pair_s: float = 1.0e-9

    def step_time(self, plan: StepPlan) -> float:
        return self.time_for(StepFeatures.of(plan))

    def time_for(self, f: StepFeatures) -> float:
        if f.tokens == 0:
            return 0.0
        linear = self.floor_s + max(0, f.tokens - self.knee_tokens) * self.per_token_s
        return linear + self.decode_kv_s * f.decode_kv + self.prefill_pair_s * f.prefill_pairs

    @classmethod
    def from_dict(cls, data: dict[str, Any], where: str = "cost model") -> CostModel:
        known = {f.name: f.type for f in fields(cls)}
        unknown = sorted(set(data) - set(known))
        if unknown:
            raise ValueError(f"{where}: unknown field(s) {unknown}; known: {sorted(known)}")
        values: dict[str, Any] = {}
        for name, raw in data.items():
            if isinstance(raw, bool) or not isinstance(raw, int | float) or raw < 0:
                raise ValueError(f"{where}.{name}: expected a non-negative number, got {raw!r}")
            values[name] = int(raw) if name == "knee_tokens" else float(raw)
        return cls(**values)

    @classmethod
    def from_file(cls, path: str | Path) -> CostModel:
        p = Path(path)
        text = p.read_text()
        if p.suffix.lower() in (".yaml", ".yml"):
            import yaml

            data = yaml.safe_load(text)
        else:
            data = json.loads(text)
        if not isinstance(data, dict):
            raise ValueError(f"{p}: expected a mapping of cost model fields")
        return cls.from_dict(data, where=str(p))

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


_MASK64 = (1 << 64) - 1


def _mix64(x: int) -> int:
    """splitmix64's finalizer: a cheap, well-spread 64-bit hash of an integer."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def _request_key(seed: int | None, token_ids: Sequence[int]) -> int:
    head = token_ids[:_KEY_PREFIX_TOKENS]
    words = array("Q", [(seed if seed is not None else -1) & _MASK64, len(head)])
    words.extend(t & _MASK64 for t in head)
    return int.from_bytes(hashlib.blake2b(words.tobytes(), digest_size=8).digest(), "little")


@dataclass(slots=True)
class _Prefix:
    tokens: list[int]
    key: int | None = None  # cached hash of (seed, tokens); reset when tokens grow


class SimExecutor:
    """Satisfies ``backends.engine.types.Executor``; ``execute`` returns instantly with a modelled time."""

    def __init__(
        self,
        cost_model: CostModel | None = None,
        *,
        block_size: int = 16,
        num_blocks: int = 28125,
        eos_after: int | None = None,
    ) -> None:
        self.cost_model = cost_model or CostModel()
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.vocab_size = CL100K_VOCAB_SIZE
        self.eos_token_id: int | None = CL100K_EOS
        self.eos_after = eos_after  # emit EOS at this output index (None: never)
        self.tokenizer: TextTokenizer | None = None  # served with the default cl100k, whose ids it emits
        self._prefixes: OrderedDict[str, _Prefix] = OrderedDict()

    def execute(self, plan: StepPlan) -> StepResult:
        tokens: dict[str, int] = {}
        for seq in plan.seqs:
            prefix = self._track(seq)
            if seq.sample:
                if prefix.key is None:
                    prefix.key = _request_key(seq.sampling.seed, prefix.tokens)
                tokens[seq.request_id] = self.token_for(prefix.key, seq.output_index)
        return StepResult(tokens=tokens, step_time_s=self.cost_model.step_time(plan))

    def token_for(self, key: int, output_index: int) -> int:
        if self.eos_after is not None and output_index == self.eos_after:
            return CL100K_EOS
        return WORD_TOKEN_IDS[_mix64(key ^ _mix64(output_index)) % len(WORD_TOKEN_IDS)]

    def expected_tokens(self, prompt_token_ids: Sequence[int], seed: int | None, n: int) -> list[int]:
        """The ``n`` tokens a request with this prompt and seed produces (with ignore_eos)."""
        seq = list(prompt_token_ids)
        for i in range(n):
            seq.append(self.token_for(_request_key(seed, seq[:_KEY_PREFIX_TOKENS]), i))
        return seq[len(prompt_token_ids) :]

    def _track(self, seq: SeqStep) -> _Prefix:
        """The request's first ``_KEY_PREFIX_TOKENS`` tokens (prompt, then outputs) seen so far.

        Whatever the chunking, and across a recompute after preemption, this equals the first
        tokens of prompt + outputs at sampling time, so token choice never depends on batching.
        """
        rid = seq.request_id
        prefix = self._prefixes.get(rid)
        if seq.start_pos == 0 or prefix is None:
            # Unknown request mid-sequence (forgotten after _MAX_KEYS others): key on what we see.
            prefix = _Prefix(list(seq.token_ids[:_KEY_PREFIX_TOKENS]))
            self._prefixes[rid] = prefix
            if len(self._prefixes) > _MAX_KEYS:
                self._prefixes.popitem(last=False)
        elif len(prefix.tokens) < _KEY_PREFIX_TOKENS and seq.start_pos == len(prefix.tokens):
            prefix.tokens.extend(seq.token_ids[: _KEY_PREFIX_TOKENS - len(prefix.tokens)])
            prefix.key = None
        self._prefixes.move_to_end(rid)
        return prefix

"""The seam between the engine's scheduler and its executors.

The scheduler decides *what* runs in one iteration (a step plan: prefill chunks and decodes,
each with its KV block table); an executor runs the plan and returns one new token for each
sequence that finished its prompt or is decoding, plus how long the step took. The scheduler
knows nothing of torch or HTTP; executors know nothing of queues or priorities.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True, slots=True)
class SamplingParams:
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    seed: int | None = None


@dataclass(frozen=True, slots=True)
class SeqStep:
    """One sequence's share of a step.

    ``token_ids`` are the tokens whose KV is computed this step: a prefill chunk, or the single
    most recent token for a decode. ``start_pos`` is how many tokens of this sequence already
    sit in the KV cache (the prefix), so positions are ``start_pos .. start_pos+len-1``.
    ``block_table`` covers at least ``start_pos + len(token_ids)`` tokens.
    ``sample`` is true when this step must produce the next token (decode, or the last chunk of
    the prompt); ``output_index`` is how many tokens this sequence has generated so far (lets a
    deterministic executor derive token ids and a seeded sampler stay reproducible across
    preemption).
    """

    request_id: str
    token_ids: Sequence[int]
    start_pos: int
    block_table: Sequence[int]
    sample: bool
    output_index: int
    sampling: SamplingParams = SamplingParams()

    @property
    def is_prefill(self) -> bool:
        # A decode processes exactly the last generated token; everything else is prompt work
        # (including recompute after preemption).
        return not (len(self.token_ids) == 1 and self.output_index > 0)


@dataclass(frozen=True, slots=True)
class StepPlan:
    seqs: Sequence[SeqStep]

    @property
    def num_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.seqs)


@dataclass(frozen=True, slots=True)
class StepResult:
    tokens: dict[str, int]  # request_id -> sampled token, for seqs with sample=True
    step_time_s: float  # wall time the step took (real executors) or would take (simulated)


class TextTokenizer(Protocol):
    """Text <-> token ids: the server encodes prompts with it, the engine decodes outputs."""

    def encode(self, text: str) -> list[int]: ...
    def decode(self, ids: Sequence[int]) -> str: ...


class Executor(Protocol):
    """Runs step plans on the KV cache it owns.

    Every member a caller reads is declared here, read-only, so mypy holds each executor and each
    caller to it (nothing is probed with ``getattr``).
    """

    @property
    def block_size(self) -> int: ...  # tokens per KV block

    @property
    def num_blocks(self) -> int: ...  # KV blocks this executor owns

    @property
    def vocab_size(self) -> int: ...  # prompt token ids must be below it

    @property
    def eos_token_id(self) -> int | None: ...

    @property
    def tokenizer(self) -> TextTokenizer | None: ...  # None: serve with the default (cl100k) tokenizer

    def execute(self, plan: StepPlan) -> StepResult: ...

"""One generation request as the engine sees it: token ids in, token ids out, plus its lifecycle.

The scheduler mutates ``num_computed_tokens`` and ``status``; the engine appends output tokens.
Nothing here knows about HTTP, text or torch.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from backends.engine.types import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"  # back in the waiting queue; its KV was dropped and will be recomputed
    FINISHED_STOPPED = "finished_stopped"  # EOS or a stop string
    FINISHED_LENGTH = "finished_length"  # max_tokens or the context length
    FINISHED_ABORTED = "finished_aborted"

    @property
    def is_finished(self) -> bool:
        return self in _FINISHED

    @property
    def finish_reason(self) -> str | None:
        """The OpenAI ``finish_reason`` for a finished status."""
        return _FINISH_REASONS.get(self)


_FINISHED = frozenset(
    {RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH, RequestStatus.FINISHED_ABORTED}
)
_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
}


@dataclass(eq=False, slots=True)
class EngineRequest:
    request_id: str
    prompt_token_ids: list[int]
    max_tokens: int
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    # Benchmarks only: end the answer after this many output tokens as if the model had emitted EOS
    # (finish "stop"), whatever max_tokens says: a replayed trace's real output length.
    stop_after: int | None = None
    priority: int = 0  # lower runs earlier (vLLM's convention); only used by the priority policy
    arrival_time: float = 0.0

    # Lifecycle state, owned by the scheduler / engine.
    output_token_ids: list[int] = field(default_factory=list)
    all_token_ids: list[int] = field(default_factory=list)  # prompt + output, what a recompute replays
    num_computed_tokens: int = 0  # tokens whose KV is in the cache (or scheduled into it this step)
    status: RequestStatus = RequestStatus.WAITING
    arrival_seq: int = -1  # tie-breaker assigned by the scheduler: FCFS order among equal keys
    num_preemptions: int = 0
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finish_time: float | None = None

    def __post_init__(self) -> None:
        if not self.all_token_ids:
            self.all_token_ids = list(self.prompt_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    def append_output(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

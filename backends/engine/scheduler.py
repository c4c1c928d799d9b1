"""Iteration-level (continuous-batching) scheduler in the style of vLLM's v1 core.

Every step gets a token budget (``max_num_batched_tokens``) and a cap on live sequences
(``max_num_seqs``). Running requests are served first, in admission order: each gets the tokens
it still needs (1 for a decode, the rest of its prompt for a partial prefill), so decodes and
prefill chunks share a step. Whatever budget is left admits waiting requests in policy order
(FCFS, or ``priority``: lower value first, then arrival).

Chunked prefill on: a prefill takes ``min(remaining, budget, long_prefill_token_threshold)``
tokens and continues next step. Off: a prompt is prefilled in one step or not at all, so a long
prompt makes that one step long and every co-batched decode waits for it — the head-of-line
stall users see. (As in vLLM, running requests come first, so a long partial prefill that was
admitted earlier can still eat a step's whole budget; the per-request threshold bounds that.)

KV blocks: a request's table grows as tokens are scheduled. When a running request cannot
grow, the scheduler preempts by recompute: the victim (priority policy: the lowest priority,
then the newest; FCFS: the newest) loses its blocks and progress and goes back to the front of
the waiting queue; its generated tokens are kept and replayed as prompt when it resumes. No
waiting request is admitted in a step that preempted (it would only thrash).
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Literal, Protocol

from backends.engine.kv_cache import BlockManager
from backends.engine.request import EngineRequest, RequestStatus
from backends.engine.types import SeqStep, StepPlan, StepResult

Policy = Literal["fcfs", "priority"]


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    max_num_batched_tokens: int = 8192
    max_num_seqs: int = 256
    max_model_len: int = 32768
    enable_chunked_prefill: bool = True
    long_prefill_token_threshold: int = 0  # 0 = no per-request chunk cap (vLLM's default)
    policy: Policy = "fcfs"

    def __post_init__(self) -> None:
        for name in ("max_num_batched_tokens", "max_num_seqs", "max_model_len"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.long_prefill_token_threshold < 0:
            raise ValueError("long_prefill_token_threshold must be >= 0")
        if self.policy not in ("fcfs", "priority"):
            raise ValueError(f"scheduling policy must be 'fcfs' or 'priority', got {self.policy!r}")
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            # Without chunking a prompt must fit one step, or a long one could never run.
            raise ValueError(
                f"with chunked prefill off, max_num_batched_tokens ({self.max_num_batched_tokens}) "
                f"must be >= max_model_len ({self.max_model_len})"
            )


class _WaitingQueue(Protocol):
    def __len__(self) -> int: ...
    def __iter__(self) -> Iterator[EngineRequest]: ...
    def push(self, req: EngineRequest) -> None: ...
    def push_front(self, req: EngineRequest) -> None: ...
    def peek(self) -> EngineRequest: ...
    def pop(self) -> EngineRequest: ...
    def remove(self, req: EngineRequest) -> None: ...


class _FcfsQueue:
    def __init__(self) -> None:
        self._q: deque[EngineRequest] = deque()

    def __len__(self) -> int:
        return len(self._q)

    def __iter__(self) -> Iterator[EngineRequest]:
        return iter(self._q)

    def push(self, req: EngineRequest) -> None:
        self._q.append(req)

    def push_front(self, req: EngineRequest) -> None:
        self._q.appendleft(req)

    def peek(self) -> EngineRequest:
        return self._q[0]

    def pop(self) -> EngineRequest:
        return self._q.popleft()

    def remove(self, req: EngineRequest) -> None:
        self._q.remove(req)


def _priority_key(req: EngineRequest) -> tuple[int, float, int]:
    return (req.priority, req.arrival_time, req.arrival_seq)


class _PriorityQueue:
    """Min-heap on (priority, arrival time, arrival order); a preempted request keeps its key."""

    def __init__(self) -> None:
        self._heap: list[tuple[tuple[int, float, int], EngineRequest]] = []

    def __len__(self) -> int:
        return len(self._heap)

    def __iter__(self) -> Iterator[EngineRequest]:
        return (req for _, req in sorted(self._heap, key=lambda e: e[0]))

    def push(self, req: EngineRequest) -> None:
        heapq.heappush(self._heap, (_priority_key(req), req))

    push_front = push  # the key already puts an older request ahead

    def peek(self) -> EngineRequest:
        return self._heap[0][1]

    def pop(self) -> EngineRequest:
        return heapq.heappop(self._heap)[1]

    def remove(self, req: EngineRequest) -> None:
        self._heap = [e for e in self._heap if e[1] is not req]
        heapq.heapify(self._heap)


@dataclass(slots=True)
class SchedulerOutput:
    plan: StepPlan
    newly_scheduled: list[EngineRequest] = field(default_factory=list)  # scheduled for the first time
    preempted: list[EngineRequest] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not self.plan.seqs


@dataclass(slots=True)
class TokenEvent:
    """One sampled token appended to a request; ``finished`` if it ended the request."""

    request: EngineRequest
    token_id: int
    finished: bool


class Scheduler:
    def __init__(self, config: SchedulerConfig, blocks: BlockManager, eos_token_id: int | None) -> None:
        if blocks.capacity_tokens < config.max_model_len:
            # A lone request must always fit, or it would preempt itself forever.
            raise ValueError(
                f"KV cache holds {blocks.capacity_tokens} tokens ({blocks.num_blocks} blocks of "
                f"{blocks.block_size}), less than max_model_len ({config.max_model_len}); "
                "add blocks or lower max_model_len"
            )
        self.config = config
        self.blocks = blocks
        self.eos_token_id = eos_token_id
        self.waiting: _WaitingQueue = _PriorityQueue() if config.policy == "priority" else _FcfsQueue()
        self.running: list[EngineRequest] = []
        self._requests: dict[str, EngineRequest] = {}
        self._arrivals = 0
        self.num_preemptions_total = 0

    # ---- queries -------------------------------------------------------------------------

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_unfinished(self) -> int:
        return len(self._requests)

    def has_unfinished(self) -> bool:
        return bool(self._requests)

    def get(self, request_id: str) -> EngineRequest | None:
        return self._requests.get(request_id)

    # ---- request lifecycle -----------------------------------------------------------------

    def add(self, req: EngineRequest) -> None:
        if req.request_id in self._requests:
            raise ValueError(f"duplicate request id {req.request_id!r}")
        if not req.prompt_token_ids:
            raise ValueError("empty prompt")
        if req.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {req.max_tokens}")
        if req.num_prompt_tokens + req.max_tokens > self.config.max_model_len:
            raise ValueError(
                f"prompt ({req.num_prompt_tokens}) + max_tokens ({req.max_tokens}) exceeds "
                f"max_model_len ({self.config.max_model_len})"
            )
        if self.config.policy == "fcfs" and req.priority != 0:
            raise ValueError("priority is only supported with the priority scheduling policy")
        req.arrival_seq = self._arrivals
        self._arrivals += 1
        req.status = RequestStatus.WAITING
        self._requests[req.request_id] = req
        self.waiting.push(req)

    def abort(self, request_id: str) -> EngineRequest | None:
        """Drop a request wherever it is and free its blocks at once. Idempotent."""
        return self.finish(request_id, RequestStatus.FINISHED_ABORTED)

    def finish(self, request_id: str, status: RequestStatus) -> EngineRequest | None:
        req = self._requests.pop(request_id, None)
        if req is None:
            return None
        if req.status == RequestStatus.RUNNING:
            self.running.remove(req)
        else:
            self.waiting.remove(req)
        self.blocks.free(request_id)
        req.status = status
        return req

    # ---- one step ----------------------------------------------------------------------------

    def schedule(self, now: float) -> SchedulerOutput:
        cfg = self.config
        budget = cfg.max_num_batched_tokens
        scheduled: dict[str, tuple[EngineRequest, int]] = {}
        out = SchedulerOutput(plan=StepPlan(seqs=()))

        # 1. Running requests first, in admission order.
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = self._num_new_tokens(req, budget)
            if n <= 0:
                i += 1
                continue
            while not self.blocks.allocate(req.request_id, req.num_computed_tokens + n):
                victim = self._pick_victim()
                victim_index = self.running.index(victim)
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is req:
                    break
                if victim.request_id in scheduled:
                    budget += scheduled.pop(victim.request_id)[1]
                if victim_index < i:
                    i -= 1
            else:
                scheduled[req.request_id] = (req, n)
                budget -= n
                i += 1

        # 2. Waiting requests, if this step did not have to preempt anyone.
        if not out.preempted:
            while len(self.waiting) and budget > 0 and len(self.running) < cfg.max_num_seqs:
                req = self.waiting.peek()
                remaining = req.num_tokens - req.num_computed_tokens
                if not cfg.enable_chunked_prefill and remaining > budget:
                    break  # the head waits for a step with room for its whole prompt
                n = self._num_new_tokens(req, budget)
                if not self.blocks.allocate(req.request_id, req.num_computed_tokens + n):
                    break
                self.waiting.pop()
                req.status = RequestStatus.RUNNING
                self.running.append(req)
                if req.first_scheduled_time is None:
                    req.first_scheduled_time = now
                    out.newly_scheduled.append(req)
                scheduled[req.request_id] = (req, n)
                budget -= n

        out.plan = StepPlan(seqs=[self._seq_step(req, n) for req, n in scheduled.values()])
        return out

    def update(self, result: StepResult) -> list[TokenEvent]:
        """Apply sampled tokens; finish requests on EOS / max_tokens / context length."""
        events: list[TokenEvent] = []
        eos = self.eos_token_id
        max_len = self.config.max_model_len
        for request_id, token in result.tokens.items():
            req = self._requests.get(request_id)
            if req is None or req.status != RequestStatus.RUNNING:
                continue  # aborted while its step ran
            req.append_output(token)
            status: RequestStatus | None = None
            if eos is not None and token == eos and not req.ignore_eos:
                status = RequestStatus.FINISHED_STOPPED
            elif req.stop_after is not None and req.num_output_tokens >= req.stop_after:
                status = RequestStatus.FINISHED_STOPPED  # the benchmark's stand-in for an EOS
            elif req.num_output_tokens >= req.max_tokens or req.num_tokens >= max_len:
                status = RequestStatus.FINISHED_LENGTH
            if status is not None:
                self.finish(request_id, status)
            events.append(TokenEvent(req, token, status is not None))
        return events

    # ---- internals ---------------------------------------------------------------------------

    def _num_new_tokens(self, req: EngineRequest, budget: int) -> int:
        n = req.num_tokens - req.num_computed_tokens
        if self.config.enable_chunked_prefill:
            threshold = self.config.long_prefill_token_threshold
            if 0 < threshold < n:
                n = threshold
            return min(n, budget)
        return n if n <= budget else 0

    def _pick_victim(self) -> EngineRequest:
        if self.config.policy == "priority":
            return max(self.running, key=_priority_key)
        return self.running[-1]

    def _preempt(self, req: EngineRequest) -> None:
        self.running.remove(req)
        self.blocks.free(req.request_id)
        req.num_computed_tokens = 0
        req.status = RequestStatus.PREEMPTED
        req.num_preemptions += 1
        self.num_preemptions_total += 1
        self.waiting.push_front(req)

    def _seq_step(self, req: EngineRequest, n: int) -> SeqStep:
        start = req.num_computed_tokens
        end = start + n
        req.num_computed_tokens = end  # optimistic, as in vLLM v1: the step will compute them
        return SeqStep(
            request_id=req.request_id,
            token_ids=req.all_token_ids[start:end],
            start_pos=start,
            block_table=self.blocks.block_table(req.request_id),
            sample=end == req.num_tokens,
            output_index=req.num_output_tokens,
            sampling=req.sampling,
        )

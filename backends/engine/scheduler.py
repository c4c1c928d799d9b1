"""Iteration-level (continuous-batching) scheduler in the style of vLLM's v1 core.

Every step gets a token budget (``max_num_batched_tokens``) and a cap on live sequences
(``max_num_seqs``). Each scheduled request gets the tokens it still needs (1 for a decode, the
rest of its prompt for a partial prefill, capped as below), so decodes and prefill chunks share
a step.

Order within a step:

- ``fcfs`` (vLLM's default), and ``priority`` with ``priority_scope="queue"`` (exactly vLLM v1's
  priority policy): running requests first, in admission order; whatever budget is left admits
  waiting requests in policy order (arrival, or lower ``priority`` value first, then arrival).
  Priority here only orders the waiting queue and picks preemption victims: a low-priority long
  prefill already running still takes a step's budget before a high-priority short prompt.
- ``priority`` with ``priority_scope="step"`` (the default; vLLM has no such mode): running and
  waiting requests are served in one priority order, so higher-priority decodes and short
  prefills take the step first and a lower-priority long prefill gets only what is left over: it
  sits out every step in which a higher-priority request prefills (long = more than
  ``long_prefill_token_threshold`` tokens left, or 4 % of ``max_model_len`` without a threshold),
  so those prefill steps stay as short as if it were not there; it runs in the steps between.
  Starvation is bounded by aging: a request's effective priority improves by one level for every
  ``priority_aging_s`` seconds since it arrived (0 = no aging). A waiting request may preempt
  running requests of strictly lower (static) priority to get the KV blocks it needs, so a
  low-priority request holding the cache cannot block a high-priority one (priority inversion).

Prefill chunks (chunked prefill on): a prefill takes ``min(remaining, budget,
long_prefill_token_threshold)`` tokens and continues next step. Off: a prompt is prefilled in one
step or not at all, so a long prompt makes that one step long and every co-batched decode waits
for it — the head-of-line stall users see.

Concurrent partial prefills (vLLM's ``max_num_partial_prefills`` / ``max_long_partial_prefills``,
the semantics of its scheduler config): with ``max_num_partial_prefills`` N > 1, at most N
requests get a prefill chunk in one step, at most ``max_long_partial_prefills`` of them *long*
(more than ``long_prefill_token_threshold`` prompt tokens left; the threshold defaults to 4 % of
``max_model_len`` when N > 1), and each prefill's chunk is at most the step budget divided by
the number of prefills that can be scheduled. A waiting long prompt whose long slots are taken
is skipped, so shorter prompts behind it are admitted first. With N = 1 (the default) none of
this applies, as in vLLM. (vLLM v1 refuses N > 1 at start-up — "Concurrent Partial Prefill is not
supported"; only its v0 engine implemented it. This engine implements it in either order.)

KV blocks: a request's table grows as tokens are scheduled. When a running request cannot
grow, the scheduler preempts by recompute: the victim (priority policy: the lowest priority,
then the newest; FCFS: the newest) loses its blocks and progress and goes back to the waiting
queue; its generated tokens are kept and replayed as prompt when it resumes. No waiting request
is admitted in a step where a running request had to preempt (it would only thrash) — except, in
the priority step scope, one that itself preempts strictly lower-priority requests for its blocks.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Literal, Protocol

from backends.engine.kv_cache import BlockManager
from backends.engine.request import EngineRequest, RequestStatus
from backends.engine.types import SeqStep, StepPlan, StepResult

Policy = Literal["fcfs", "priority"]
PriorityScope = Literal["step", "queue"]

# vLLM: with concurrent partial prefills on and no threshold given, a prompt is long above 4 %
# of max_model_len.
_DEFAULT_LONG_PREFILL_SHARE = 0.04


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    max_num_batched_tokens: int = 8192
    max_num_seqs: int = 256
    max_model_len: int = 32768
    enable_chunked_prefill: bool = True
    long_prefill_token_threshold: int = 0  # 0 = no per-request chunk cap (vLLM's default)
    max_num_partial_prefills: int = 1  # prefills per step when > 1 (vLLM's default 1: no limit)
    max_long_partial_prefills: int = 1  # of those, long ones (> long_prefill_token_threshold)
    policy: Policy = "fcfs"
    priority_scope: PriorityScope = "step"  # "queue": vLLM v1's priority (waiting queue only)
    priority_aging_s: float = 10.0  # step scope: one priority level gained per this many seconds

    def __post_init__(self) -> None:
        for name in ("max_num_batched_tokens", "max_num_seqs", "max_model_len"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.long_prefill_token_threshold < 0:
            raise ValueError("long_prefill_token_threshold must be >= 0")
        if self.long_prefill_token_threshold > self.max_model_len:
            raise ValueError(
                f"long_prefill_token_threshold ({self.long_prefill_token_threshold}) must be <= "
                f"max_model_len ({self.max_model_len})"
            )
        if self.max_num_partial_prefills < 1 or self.max_long_partial_prefills < 1:
            raise ValueError("max_num_partial_prefills and max_long_partial_prefills must be >= 1")
        if self.max_long_partial_prefills > self.max_num_partial_prefills:
            raise ValueError(
                f"max_long_partial_prefills ({self.max_long_partial_prefills}) must be <= "
                f"max_num_partial_prefills ({self.max_num_partial_prefills})"
            )
        if self.max_num_partial_prefills > 1:
            if not self.enable_chunked_prefill:
                raise ValueError("max_num_partial_prefills > 1 needs chunked prefill")
            if self.long_prefill_token_threshold == 0:
                # As vLLM: a long prompt is one above 4 % of the context (frozen: set once here).
                threshold = max(1, int(self.max_model_len * _DEFAULT_LONG_PREFILL_SHARE))
                object.__setattr__(self, "long_prefill_token_threshold", threshold)
        if self.policy not in ("fcfs", "priority"):
            raise ValueError(f"scheduling policy must be 'fcfs' or 'priority', got {self.policy!r}")
        if self.priority_scope not in ("step", "queue"):
            raise ValueError(f"priority scope must be 'step' or 'queue', got {self.priority_scope!r}")
        if not self.priority_aging_s >= 0:
            raise ValueError(f"priority_aging_s must be >= 0, got {self.priority_aging_s}")
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            # Without chunking a prompt must fit one step, or a long one could never run.
            raise ValueError(
                f"with chunked prefill off, max_num_batched_tokens ({self.max_num_batched_tokens}) "
                f"must be >= max_model_len ({self.max_model_len})"
            )

    @property
    def orders_steps_by_priority(self) -> bool:
        return self.policy == "priority" and self.priority_scope == "step"


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


PriorityKey = tuple[float, float, int]


def _priority_key(req: EngineRequest) -> PriorityKey:
    return (req.priority, req.arrival_time, req.arrival_seq)


class _PriorityQueue:
    """Min-heap on (priority, arrival time, arrival order); a preempted request keeps its key."""

    def __init__(self) -> None:
        self._heap: list[tuple[PriorityKey, EngineRequest]] = []

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
class _PrefillSlots:
    """One step's concurrent-partial-prefill allowance (only when max_num_partial_prefills > 1)."""

    left: int  # prefills that may still get a chunk this step
    long_left: int  # of which long ones
    chunk: int  # per-prefill token cap: the step budget shared by the prefills that can run
    threshold: int  # a prefill is long above this many tokens left

    def allows(self, remaining: int) -> bool:
        return self.left > 0 and (remaining <= self.threshold or self.long_left > 0)

    def take(self, remaining: int) -> None:
        self.left -= 1
        if remaining > self.threshold:
            self.long_left -= 1


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


def _remaining(req: EngineRequest) -> int:
    return req.num_tokens - req.num_computed_tokens


def _is_prefill(req: EngineRequest) -> bool:
    # A decode computes exactly the last sampled token; anything else is prompt work (a first
    # prefill, a continuing chunk, or a recompute after preemption).
    return req.num_computed_tokens == 0 or _remaining(req) > 1


class _Step:
    """The mutable state of one ``schedule`` call."""

    __slots__ = ("admit", "budget", "out", "scheduled", "slots")

    def __init__(self, budget: int, slots: _PrefillSlots | None) -> None:
        self.budget = budget
        self.slots = slots
        self.scheduled: dict[str, tuple[EngineRequest, int]] = {}
        self.out = SchedulerOutput(plan=StepPlan(seqs=()))
        self.admit = True  # waiting requests may still be admitted this step


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
        # Step scope: a prefill with more than this many tokens left is long, and yields steps to
        # higher-priority prefills (the chunk cap, else vLLM's 4 % of the context).
        self._yield_threshold = config.long_prefill_token_threshold or max(
            1, int(config.max_model_len * _DEFAULT_LONG_PREFILL_SHARE)
        )

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
        st = _Step(cfg.max_num_batched_tokens, self._prefill_slots())
        if cfg.orders_steps_by_priority:
            self._schedule_by_priority(st, now)
        else:
            self._schedule_running_first(st, now)
        st.out.plan = StepPlan(seqs=[self._seq_step(req, n) for req, n in st.scheduled.values()])
        return st.out

    def _schedule_running_first(self, st: _Step, now: float) -> None:
        """vLLM v1's order: running requests in admission order, then the waiting queue's head."""
        # 1. Running requests first, in admission order (a snapshot: preemption only removes).
        for req in list(self.running):
            if st.budget <= 0:
                break
            if req.status is RequestStatus.RUNNING:
                n = self._num_new_tokens(req, st)
                if n > 0:
                    self._grow(req, n, st)

        # 2. Waiting requests, if this step did not have to preempt anyone.
        if st.out.preempted:
            return
        skipped: list[EngineRequest] = []
        while len(self.waiting) and st.budget > 0 and len(self.running) < self.config.max_num_seqs:
            req = self.waiting.peek()
            if st.slots is not None and not st.slots.allows(_remaining(req)):
                if st.slots.left == 0:
                    break
                skipped.append(self.waiting.pop())  # a long prompt without a long slot: shorts pass
                continue
            if not self._admit(req, st, now, head=True):
                break
        for req in reversed(skipped):
            self.waiting.push_front(req)

    def _schedule_by_priority(self, st: _Step, now: float) -> None:
        """Running and waiting requests in one (aged) priority order; a long prefill yields the step
        to any prefill of higher priority (it runs in the steps they leave)."""
        key = self._aged_key(now)
        running = sorted(((key(r), r) for r in self.running), key=lambda e: e[0])
        waiting = sorted(((key(r), r) for r in self.waiting), key=lambda e: e[0])
        long_above = self._yield_threshold
        top_prefill: float | None = None  # the (aged) priority of this step's first prefill
        i = j = 0
        while st.budget > 0 and (i < len(running) or (st.admit and j < len(waiting))):
            from_running = i < len(running) and not (
                st.admit and j < len(waiting) and waiting[j][0] < running[i][0]
            )
            if from_running:
                prio, req = running[i]
                i += 1
            else:
                prio, req = waiting[j]
                j += 1
            remaining = _remaining(req)
            prefill = remaining > 1 or req.num_computed_tokens == 0
            if prefill and top_prefill is not None and remaining > long_above and prio[0] > top_prefill:
                continue  # a long prefill of lower priority: not in a step a higher one prefills in
            if from_running:
                if req.status is not RequestStatus.RUNNING:
                    continue  # preempted earlier in this step
                n = self._num_new_tokens(req, st)
                if n > 0:
                    preempted = len(st.out.preempted)
                    self._grow(req, n, st)
                    if len(st.out.preempted) > preempted:
                        st.admit = False  # a running request had to preempt: admitting would thrash
                    elif prefill and top_prefill is None:
                        top_prefill = prio[0]
                continue
            if len(self.running) >= self.config.max_num_seqs:
                st.admit = False
            elif st.slots is not None and not st.slots.allows(remaining):
                continue  # no prefill slot of its kind left: others may still pass
            elif not self._admit(req, st, now, head=False):
                st.admit = False  # it waits for KV blocks; smaller ones must not overtake it
            elif top_prefill is None:
                top_prefill = prio[0]

    # ---- internals ---------------------------------------------------------------------------

    def _prefill_slots(self) -> _PrefillSlots | None:
        cfg = self.config
        limit = cfg.max_num_partial_prefills
        if limit <= 1:
            return None
        threshold = cfg.long_prefill_token_threshold
        long_limit = cfg.max_long_partial_prefills
        # How many prefills this step can serve (vLLM's count): the running ones, then waiting
        # ones in queue order while slots last, long ones only while long slots last.
        prefills = longs = 0
        for req in self.running:
            if _is_prefill(req):
                prefills += 1
                longs += _remaining(req) > threshold
        waiting_longs = 0
        for req in self.waiting:
            if prefills >= limit:
                break
            if _remaining(req) > threshold:
                if longs + waiting_longs >= long_limit:
                    continue
                waiting_longs += 1
            prefills += 1
        schedulable = max(1, min(prefills, limit))
        return _PrefillSlots(limit, long_limit, cfg.max_num_batched_tokens // schedulable, threshold)

    def _aged_key(self, now: float) -> Callable[[EngineRequest], PriorityKey]:
        aging = self.config.priority_aging_s
        if aging <= 0:
            return _priority_key

        def key(req: EngineRequest) -> PriorityKey:
            return (req.priority - (now - req.arrival_time) // aging, req.arrival_time, req.arrival_seq)

        return key

    def _num_new_tokens(self, req: EngineRequest, st: _Step) -> int:
        n = _remaining(req)
        budget = st.budget
        cfg = self.config
        if not cfg.enable_chunked_prefill:
            return n if n <= budget else 0
        if n > 1 or req.num_computed_tokens == 0:
            threshold = cfg.long_prefill_token_threshold
            slots = st.slots
            if slots is not None:
                if not slots.allows(n):
                    return 0
                if slots.chunk < n:
                    n = slots.chunk
            if 0 < threshold < n:
                n = threshold
        return min(n, budget)

    def _grow(self, req: EngineRequest, n: int, st: _Step) -> None:
        """Schedule ``n`` tokens of running ``req``, preempting others (or itself) for KV blocks."""
        remaining = _remaining(req)
        while not self.blocks.allocate(req.request_id, req.num_computed_tokens + n):
            victim = self._pick_victim()
            self._preempt(victim, st)
            if victim is req:
                return
        self._schedule(req, n, remaining, st)

    def _admit(self, req: EngineRequest, st: _Step, now: float, *, head: bool) -> bool:
        """Move waiting ``req`` into the running set with its first chunk; False if it cannot run now.

        ``head``: ``req`` is the waiting queue's head (vLLM's order). Otherwise (priority scope
        "step") it may preempt running requests of strictly lower priority for KV blocks.
        """
        remaining = _remaining(req)
        if not self.config.enable_chunked_prefill and remaining > st.budget:
            return False  # it waits for a step with room for its whole prompt
        n = self._num_new_tokens(req, st)
        if n <= 0:
            return False
        need = req.num_computed_tokens + n
        if not self.blocks.allocate(req.request_id, need) and (
            head or not self._preempt_lower_for(req, need, st)
        ):
            return False
        if head:
            self.waiting.pop()
        else:
            self.waiting.remove(req)
        req.status = RequestStatus.RUNNING
        self.running.append(req)
        if req.first_scheduled_time is None:
            req.first_scheduled_time = now
            st.out.newly_scheduled.append(req)
        self._schedule(req, n, remaining, st)
        return True

    def _preempt_lower_for(self, req: EngineRequest, tokens: int, st: _Step) -> bool:
        """Free KV blocks for waiting ``req`` by preempting running requests of strictly lower
        priority (lowest first, newest first) — only if that frees enough; True when it did."""
        blocks = self.blocks
        need = blocks.blocks_for(tokens) - blocks.num_blocks_of(req.request_id) - blocks.num_free_blocks
        lower = sorted(
            (r for r in self.running if r.priority > req.priority), key=_priority_key, reverse=True
        )
        if sum(blocks.num_blocks_of(r.request_id) for r in lower) < need:
            return False
        for victim in lower:
            self._preempt(victim, st)
            if blocks.allocate(req.request_id, tokens):
                return True
        raise AssertionError("preempted enough blocks but the allocation failed")  # pragma: no cover

    def _schedule(self, req: EngineRequest, n: int, remaining: int, st: _Step) -> None:
        st.scheduled[req.request_id] = (req, n)
        st.budget -= n
        if st.slots is not None and (remaining > 1 or req.num_computed_tokens == 0):
            st.slots.take(remaining)

    def _pick_victim(self) -> EngineRequest:
        if self.config.policy == "priority":
            return max(self.running, key=_priority_key)
        return self.running[-1]

    def _preempt(self, req: EngineRequest, st: _Step) -> None:
        self.running.remove(req)
        self.blocks.free(req.request_id)
        req.num_computed_tokens = 0
        req.status = RequestStatus.PREEMPTED
        req.num_preemptions += 1
        self.num_preemptions_total += 1
        self.waiting.push_front(req)
        st.out.preempted.append(req)
        hit = st.scheduled.pop(req.request_id, None)
        if hit is not None:
            st.budget += hit[1]  # its tokens go back to the step

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

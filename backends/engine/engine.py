"""The engine: a scheduler driving an executor, one step at a time, on a clock.

``Engine`` is synchronous and knows nothing of asyncio or HTTP: tests call ``step()`` on a
virtual clock (each step advances it by the executor's step time), and ``AsyncEngine`` (in
``async_engine.py``) splits a step into ``schedule()`` / execute / ``finish_step()`` to run it on
an event loop. Per-request timestamps and counts feed an optional ``EngineObserver`` (the
server's Prometheus metrics) so the engine stays free of any metrics library.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from backends.engine.clock import Clock, VirtualClock
from backends.engine.detokenizer import OutputText, TextDecoder
from backends.engine.request import EngineRequest, RequestStatus
from backends.engine.scheduler import Scheduler, SchedulerOutput
from backends.engine.types import Executor, StepResult


@dataclass(slots=True)
class RequestOutput:
    """What one request gained in one step (or several, once merged by a slow consumer)."""

    request_id: str
    new_token_ids: list[int]
    text: str
    token_times: list[float]
    finished: bool
    finish_reason: str | None
    num_prompt_tokens: int
    num_output_tokens: int
    num_preemptions: int = 0

    def merge(self, later: RequestOutput) -> None:
        self.new_token_ids.extend(later.new_token_ids)
        self.text += later.text
        self.token_times.extend(later.token_times)
        self.finished = later.finished
        self.finish_reason = later.finish_reason
        self.num_output_tokens = later.num_output_tokens
        self.num_preemptions = later.num_preemptions


class EngineObserver(Protocol):
    def on_scheduled(self, req: EngineRequest, queue_time_s: float) -> None: ...
    def on_first_token(self, req: EngineRequest, ttft_s: float) -> None: ...
    def on_tokens(self, num_tokens: int, inter_token_s: list[float]) -> None: ...
    def on_finished(self, req: EngineRequest, e2e_s: float) -> None: ...
    def on_preempted(self, num: int) -> None: ...


@dataclass(slots=True)
class _Tracked:
    request: EngineRequest
    text: OutputText | None


class Engine:
    def __init__(
        self,
        scheduler: Scheduler,
        executor: Executor,
        clock: Clock,
        *,
        decoder: TextDecoder | None = None,
        observer: EngineObserver | None = None,
    ) -> None:
        if executor.block_size != scheduler.blocks.block_size:
            raise ValueError("executor and block manager disagree on block_size")
        self.scheduler = scheduler
        self.executor = executor
        self.clock = clock
        self.decoder = decoder
        self.observer = observer
        self._tracked: dict[str, _Tracked] = {}
        eos = executor.eos_token_id
        self._skip_ids = frozenset() if eos is None else frozenset({eos})

    # ---- requests --------------------------------------------------------------------------

    def add_request(self, req: EngineRequest, arrival_time: float | None = None) -> None:
        """Queue a request. Raises ValueError for a request that can never run.

        ``arrival_time`` defaults to now; a virtual-clock driver passes the true arrival of a
        request that came in while a step was running (it is only seen at the step's end, as in
        a real engine, but its latency counts from when it arrived).
        """
        vocab = self.executor.vocab_size
        if any(t < 0 or t >= vocab for t in req.prompt_token_ids):
            raise ValueError(f"prompt token ids must be in [0, {vocab})")
        if req.stop and self.decoder is None:
            raise ValueError("stop strings need a text decoder")
        req.arrival_time = self.clock.now() if arrival_time is None else arrival_time
        self.scheduler.add(req)
        text = OutputText(self.decoder, req.stop, self._skip_ids) if self.decoder is not None else None
        self._tracked[req.request_id] = _Tracked(req, text)

    def abort(self, request_id: str) -> bool:
        """Abort and free the request's KV blocks at once. Idempotent."""
        self._tracked.pop(request_id, None)
        return self.scheduler.abort(request_id) is not None

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # ---- stepping ----------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        return self.scheduler.schedule(self.clock.now())

    def step(self) -> list[RequestOutput]:
        """Schedule, execute and apply one step synchronously (tests, virtual clock)."""
        sched = self.schedule()
        if sched.is_empty:
            self._observe_schedule(sched)
            return []
        result = self.executor.execute(sched.plan)
        if isinstance(self.clock, VirtualClock):
            self.clock.advance(result.step_time_s)
        return self.finish_step(sched, result)

    def finish_step(self, sched: SchedulerOutput, result: StepResult) -> list[RequestOutput]:
        now = self.clock.now()
        self._observe_schedule(sched)
        outputs: dict[str, RequestOutput] = {}
        itls: list[float] = []
        for event in self.scheduler.update(result):
            req = event.request
            tracked = self._tracked.get(req.request_id)
            if tracked is None:
                continue
            if req.first_token_time is None:
                req.first_token_time = now
                if self.observer is not None:
                    self.observer.on_first_token(req, now - req.arrival_time)
            elif req.last_token_time is not None:
                itls.append(now - req.last_token_time)
            req.last_token_time = now
            finished = event.finished
            text = ""
            if tracked.text is not None:
                tracked.text.add(event.token_id)
                if tracked.text.stopped and not finished:
                    self.scheduler.finish(req.request_id, RequestStatus.FINISHED_STOPPED)
                    finished = True
                text = tracked.text.take(final=finished)
            if finished:
                req.finish_time = now
                del self._tracked[req.request_id]
                if self.observer is not None:
                    self.observer.on_finished(req, now - req.arrival_time)
            outputs[req.request_id] = RequestOutput(
                request_id=req.request_id,
                new_token_ids=[event.token_id],
                text=text,
                token_times=[now],
                finished=finished,
                finish_reason=req.status.finish_reason if finished else None,
                num_prompt_tokens=req.num_prompt_tokens,
                num_output_tokens=req.num_output_tokens,
                num_preemptions=req.num_preemptions,
            )
        if self.observer is not None and outputs:
            self.observer.on_tokens(len(outputs), itls)
        return list(outputs.values())

    def _observe_schedule(self, sched: SchedulerOutput) -> None:
        if self.observer is None:
            return
        for req in sched.newly_scheduled:
            assert req.first_scheduled_time is not None
            self.observer.on_scheduled(req, req.first_scheduled_time - req.arrival_time)
        if sched.preempted:
            self.observer.on_preempted(len(sched.preempted))

"""Runs an ``Engine`` as an asyncio task and streams each request's outputs to its consumer.

One loop task steps the engine while it has work and sleeps on an event when idle. With the
simulated executor the loop sleeps the modelled step time (times ``time_scale``) measured from
the step's start, so Python overhead does not slow the simulated GPU down. A real executor's
``execute`` is blocking compute, so it runs in a worker thread (``offload=True``) and the event
loop keeps serving HTTP meanwhile; only ``execute`` leaves the loop thread, so the scheduler's
state is never touched concurrently (an abort during a step frees blocks that no one can reuse
before the step ends, and the late token is dropped).

``generate`` queues a request and returns an async iterator of ``RequestOutput`` deltas; outputs a slow consumer has not
read yet are merged, so a stalled client costs memory per request, not per token. Leaving the
iterator early (cancellation, client disconnect, ``aclose``) aborts the request at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator

from backends.engine.engine import Engine, RequestOutput
from backends.engine.request import EngineRequest

log = logging.getLogger("tokengate.engine")


class EngineDeadError(RuntimeError):
    pass


class _Stream:
    __slots__ = ("_error", "_event", "_pending")

    def __init__(self) -> None:
        self._pending: RequestOutput | None = None
        self._error: BaseException | None = None
        self._event = asyncio.Event()

    def put(self, out: RequestOutput) -> None:
        if self._pending is None:
            self._pending = out
        else:
            self._pending.merge(out)
        self._event.set()

    def fail(self, exc: BaseException) -> None:
        self._error = exc
        self._event.set()

    async def get(self) -> RequestOutput:
        await self._event.wait()
        self._event.clear()
        if self._error is not None:
            raise self._error
        out, self._pending = self._pending, None
        assert out is not None
        return out


class AsyncEngine:
    def __init__(
        self, engine: Engine, *, simulate_time: bool, time_scale: float = 1.0, offload: bool = False
    ):
        if time_scale < 0:
            raise ValueError("time_scale must be >= 0")
        self.engine = engine
        self.simulate_time = simulate_time
        self.time_scale = time_scale
        self.offload = offload
        self._streams: dict[str, _Stream] = {}
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self.steps = 0

    @property
    def running(self) -> bool:
        return self._task is not None and not self._task.done()

    async def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._loop(), name="tokengate-engine-loop")

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        for request_id, stream in list(self._streams.items()):
            self.engine.abort(request_id)
            stream.fail(EngineDeadError("engine stopped"))
        self._streams.clear()

    def abort(self, request_id: str) -> bool:
        self._streams.pop(request_id, None)
        return self.engine.abort(request_id)

    def generate(self, request: EngineRequest) -> AsyncIterator[RequestOutput]:
        """Queue ``request`` now (raising ValueError at once if it can never run) and return its
        output stream. Iterate it to the end or close it: leaving it early aborts the request."""
        if not self.running:
            raise EngineDeadError("engine is not running")
        self.engine.add_request(request)
        stream = _Stream()
        self._streams[request.request_id] = stream
        self._wake.set()
        return self._iterate(request.request_id, stream)

    async def _iterate(self, request_id: str, stream: _Stream) -> AsyncIterator[RequestOutput]:
        finished = False
        try:
            while not finished:
                out = await stream.get()
                finished = out.finished
                yield out
        finally:
            if not finished:
                self.abort(request_id)
            else:
                self._streams.pop(request_id, None)

    async def _loop(self) -> None:
        engine = self.engine
        clock = engine.clock
        while True:
            if not engine.has_unfinished():
                self._wake.clear()
                await self._wake.wait()
                continue
            start = clock.now()
            sched = engine.schedule()
            if sched.is_empty:
                # Nothing fits (should not happen: a lone request always fits); wait for a change.
                self._wake.clear()
                await self._wake.wait()
                continue
            try:
                if self.offload:
                    result = await asyncio.to_thread(engine.executor.execute, sched.plan)
                else:
                    result = engine.executor.execute(sched.plan)
            except Exception as exc:  # the executor broke: fail its requests, keep serving
                log.exception("executor step failed; aborting %d requests", len(sched.plan.seqs))
                for seq in sched.plan.seqs:
                    engine.abort(seq.request_id)
                    stream = self._streams.pop(seq.request_id, None)
                    if stream is not None:
                        stream.fail(EngineDeadError(f"executor step failed: {exc}"))
                continue
            if self.simulate_time:
                delay = start + result.step_time_s * self.time_scale - clock.now()
                await asyncio.sleep(delay if delay > 0 else 0)
            elif not self.offload:
                await asyncio.sleep(0)  # let the server run between steps
            self.steps += 1
            for out in engine.finish_step(sched, result):
                stream = self._streams.get(out.request_id)
                if stream is not None:
                    stream.put(out)

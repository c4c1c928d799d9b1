"""A thread pool that shares its threads fairly among keys (tenants), for pricing's encodes.

A long prompt is tokenized in a small pool of threads before it is priced (`Pricer.aprice_*`).
With a first-in-first-out queue, a tenant that sends a flood of multi-megabyte bodies — refused
for their length only once counted, so the flood costs it no budget — put every other tenant's
long prompt behind all of them: measured, 2.4 s instead of 10 ms for a 100 KB prompt behind one
tenant's sixteen 3.5 MB bodies. The budget promise held, and the latency promise did not.

Here each caller submits a *batch*: the jobs of one request, each with a weight (its characters).
The rule, start-time fair queueing over the weights handed out:

* every key with jobs waiting has a *tag*, the weight its jobs have been handed so far, counted
  from when it last became backlogged; the next free thread takes the next job of the key with
  the lowest tag (ties: the key that has waited longest), and the tag grows by that job's weight;
* a key that becomes backlogged starts at the tag of the job handed out last (the pool's virtual
  time), so an idle tenant banks no credit and a newcomer waits behind no one's history;
* within a key, batches run in arrival order, the jobs of a batch in order.

So with ``k`` keys backlogged each gets ~1/k of the threads' characters, whatever its number of
requests, and a newcomer's first job starts as soon as a thread is free: it waits for one job per
thread (the callers cut texts into jobs of ~16 K characters, ~1 ms of tiktoken), not for the queue.
One dispatch costs O(log k) for k backlogged keys; an idle key keeps no state.

A batch completes one `concurrent.futures.Future` with the jobs' results in order (one wake-up of
the caller's event loop per request, however many jobs). Cancelling that future (the client went
away) drops the batch's jobs not yet started; `shutdown` cancels every batch still waiting.
"""

from __future__ import annotations

import concurrent.futures
import heapq
import threading
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

__all__ = ["FairPool"]

J = TypeVar("J")
R = TypeVar("R")


@dataclass(eq=False)
class _Batch(Generic[J, R]):
    fn: Callable[[J], R]
    jobs: Sequence[J]
    weights: Sequence[int]
    future: concurrent.futures.Future[list[R]]
    results: list[Any] = field(default_factory=list)
    handed: int = 0  # jobs handed to a thread
    done: int = 0  # jobs finished
    failed: bool = False


@dataclass(eq=False)
class _Key:
    name: str
    batches: deque[_Batch[Any, Any]] = field(default_factory=deque)
    tag: int = 0
    running: int = 0  # jobs of this key in a thread now


class FairPool:
    """``threads`` worker threads, started on the first `submit`, shared fairly among keys.

    ``initializer(*initargs)`` runs in each thread as it starts (pricing lowers their priority).
    """

    def __init__(
        self,
        threads: int,
        *,
        name: str = "fair-pool",
        initializer: Callable[..., object] | None = None,
        initargs: tuple[Any, ...] = (),
    ) -> None:
        if threads < 1:
            raise ValueError(f"threads must be at least 1, got {threads}")
        self._size = threads
        self._name = name
        self._initializer = initializer
        self._initargs = initargs
        self._cond = threading.Condition(threading.Lock())
        self._keys: dict[str, _Key] = {}  # keys with jobs waiting or running
        self._ready: list[tuple[int, int, str]] = []  # (tag, seq, key) for each key with jobs waiting
        self._seq = 0
        self._now = 0  # virtual time: the tag of the job handed out last
        self._threads: list[threading.Thread] = []
        self._closed = False

    def submit(
        self, key: str, fn: Callable[[J], R], jobs: Sequence[J], weights: Sequence[int]
    ) -> concurrent.futures.Future[list[R]]:
        """Run ``fn`` on each of ``jobs`` for ``key``; the future's result is their results in order.

        ``weights[i]`` is what job ``i`` costs in the fair share (pricing: its characters). An
        exception in any job fails the whole future with it. Raises RuntimeError after `shutdown`.
        """
        if len(weights) != len(jobs):
            raise ValueError("one weight per job")
        future: concurrent.futures.Future[list[R]] = concurrent.futures.Future()
        batch: _Batch[J, R] = _Batch(fn, jobs, weights, future, [None] * len(jobs))
        if not jobs:
            future.set_result([])
            return future
        with self._cond:
            if self._closed:
                raise RuntimeError("cannot submit to a pool that is shut down")
            entry = self._keys.get(key)
            if entry is None:
                entry = self._keys[key] = _Key(key, tag=self._now)
            if not entry.batches:  # backlogged from now on; it keeps its tag while a job of it runs
                entry.tag = max(entry.tag, self._now)
                self._push(key, entry.tag)
            entry.batches.append(batch)
            for _ in range(min(len(jobs), self._size - len(self._threads))):
                self._start_thread()
            self._cond.notify(len(jobs))
        return future

    def backlog(self) -> dict[str, int]:
        """Characters (weights) waiting for a thread, per key with any; a snapshot for /stats."""
        with self._cond:
            waiting = {
                key: sum(sum(b.weights[b.handed :]) for b in entry.batches if not b.future.done())
                for key, entry in self._keys.items()
            }
        return {key: n for key, n in waiting.items() if n}

    def shutdown(self) -> None:
        """Cancel every batch still waiting and wait for the jobs running to finish; idempotent."""
        with self._cond:
            self._closed = True
            waiting = [b for entry in self._keys.values() for b in entry.batches]
            self._keys.clear()
            self._ready.clear()
            self._cond.notify_all()
            threads = list(self._threads)
        for batch in waiting:
            batch.future.cancel()
        for thread in threads:
            if thread is not threading.current_thread():
                thread.join()

    # ---- workers --------------------------------------------------------------------------------

    def _start_thread(self) -> None:
        thread = threading.Thread(target=self._work, name=f"{self._name}_{len(self._threads)}", daemon=True)
        self._threads.append(thread)
        thread.start()

    def _push(self, key: str, tag: int) -> None:
        self._seq += 1
        heapq.heappush(self._ready, (tag, self._seq, key))

    def _next(self) -> tuple[_Key, _Batch[Any, Any], int] | None:
        """The next job to run, by the module's rule; None when nothing waits. Lock held."""
        while self._ready:
            _, _, key = heapq.heappop(self._ready)
            entry = self._keys[key]
            batches = entry.batches
            while batches and (batches[0].future.done() or batches[0].failed):
                batches.popleft()  # cancelled by its caller, or failed: its other jobs are moot
            if not batches:
                if not entry.running:
                    del self._keys[key]
                continue
            batch = batches[0]
            index = batch.handed
            batch.handed += 1
            if batch.handed == len(batch.jobs):
                batches.popleft()
            self._now = entry.tag
            entry.tag += batch.weights[index]
            entry.running += 1
            if batches:
                self._push(key, entry.tag)
            return entry, batch, index
        return None

    def _finished(self, entry: _Key) -> None:
        """A job of ``entry``'s key left its thread. Lock held."""
        entry.running -= 1
        if not entry.running and not entry.batches and self._keys.get(entry.name) is entry:
            del self._keys[entry.name]

    def _work(self) -> None:
        if self._initializer is not None:
            self._initializer(*self._initargs)
        while True:
            with self._cond:
                picked = self._next()
                while picked is None:
                    if self._closed:
                        return
                    self._cond.wait()
                    picked = self._next()
            entry, batch, index = picked
            try:
                self._run(batch, index)
            finally:
                with self._cond:
                    self._finished(entry)

    def _run(self, batch: _Batch[Any, Any], index: int) -> None:
        if batch.future.done() or batch.failed:
            return
        try:
            result = batch.fn(batch.jobs[index])
        except BaseException as exc:  # delivered to the caller, like an executor's future
            with self._cond:
                batch.failed = True
            _settle(batch.future, exc=exc)
            return
        with self._cond:
            batch.results[index] = result
            batch.done += 1
            finished = batch.done == len(batch.jobs)
        if finished:
            _settle(batch.future, result=batch.results)


def _settle(
    future: concurrent.futures.Future[Any], *, result: Any = None, exc: BaseException | None = None
) -> None:
    # The caller may cancel at any moment, so settling can lose that race: the cancel stands.
    try:
        if exc is not None:
            future.set_exception(exc)
        else:
            future.set_result(result)
    except concurrent.futures.InvalidStateError:
        pass

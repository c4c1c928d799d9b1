"""Coalesce concurrent acquire/release calls of one replica into one ``batch`` script call.

Under load many requests reach the store in the same event-loop turn. Sending each as its own
EVALSHA costs a round trip, a script start and a fresh script-level cache per operation; sending
them together costs one of each, and Redis runs them in submission order, exactly as if they had
been separate calls at the same instant. A sender task is started as soon as an operation is
queued and takes whatever is queued when it first runs, so a lone request pays one loop turn, not
a timer.

At most ``max_in_flight`` batches are on the wire at once; while they are, new operations queue
and leave together with the next batch (that is what makes batches grow with load).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

BatchCall = Callable[[list[str]], Awaitable[Sequence[Any]]]


class ScriptBatcher:
    def __init__(self, call: BatchCall, max_in_flight: int = 4, max_ops: int = 128) -> None:
        self._call = call
        self._max_in_flight = max_in_flight
        self._max_ops = max_ops
        self._pending: list[tuple[str, Sequence[str], asyncio.Future[Any]]] = []
        self._in_flight = 0
        self._scheduled = False
        self._tasks: set[asyncio.Task[None]] = set()
        self.batches = 0  # batches sent (observability)
        self.ops = 0  # operations sent

    def submit(self, name: str, args: Sequence[str]) -> asyncio.Future[Any]:
        """Queue one operation; the future gets its reply, or the batch's exception.

        The operation is sent even if the future is cancelled meanwhile: callers that must know
        its outcome (acquire) shield the future and clean up after it.
        """
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[Any] = loop.create_future()
        self._pending.append((name, args, fut))
        self._schedule(loop)
        return fut

    def _schedule(self, loop: asyncio.AbstractEventLoop) -> None:
        # The sender task takes its operations when it starts running, so everything submitted
        # until then (this loop turn) leaves in the same batch.
        if not self._scheduled and self._in_flight < self._max_in_flight:
            self._scheduled = True
            self._in_flight += 1
            task = loop.create_task(self._send())
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _send(self) -> None:
        self._scheduled = False
        items, self._pending = self._pending[: self._max_ops], self._pending[self._max_ops :]
        try:
            if items:
                await self._send_items(items)
        finally:
            self._in_flight -= 1
            if self._pending:
                self._schedule(asyncio.get_running_loop())

    async def _send_items(self, items: list[tuple[str, Sequence[str], asyncio.Future[Any]]]) -> None:
        args: list[str] = []
        for name, op_args, _ in items:
            args += [name, str(len(op_args)), *op_args]
        self.batches += 1
        self.ops += len(items)
        try:
            replies = await self._call(args)
        except asyncio.CancelledError:
            for _, _, fut in items:
                fut.cancel()
            raise
        except Exception as err:
            for _, _, fut in items:
                if not fut.done():
                    fut.set_exception(err)
        else:
            for (_, _, fut), reply in zip(items, replies, strict=True):
                if not fut.done():
                    fut.set_result(reply)

    async def drain(self, timeout_s: float) -> None:
        """Wait (bounded) until every queued operation has been sent and answered."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while (self._pending or self._tasks) and loop.time() < deadline:
            if self._tasks:
                await asyncio.wait(list(self._tasks), timeout=max(0.0, deadline - loop.time()))
            else:
                await asyncio.sleep(0)  # a flush is scheduled: let it run

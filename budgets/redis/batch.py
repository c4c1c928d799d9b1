"""Coalesce concurrent acquire/release calls of one replica into one ``batch`` script call.

Under load many requests reach the store in the same event-loop turn. Sending each as its own
EVALSHA costs a round trip, a script start and a fresh script-level cache per operation; sending
them together costs one of each, and Redis runs them in submission order, exactly as if they had
been separate calls at the same instant. A sender task is started as soon as an operation is
queued and takes whatever is queued when it first runs, so a lone request pays one loop turn, not
a timer.

At most ``max_in_flight`` batches are on the wire at once; while they are, new operations queue
and leave together with the next batch (that is what makes batches grow with load).

With a ``fast`` sender (the store's lean connection, when it is connected) a batch is written from
a plain loop callback and its replies are handed out from the reply future's callback: no task
and no coroutine chain per batch. Whatever the fast sender cannot finish (not connected yet, a
NOSCRIPT to reload) goes through the async ``call`` instead.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

BatchCall = Callable[[list[str]], Awaitable[Sequence[Any]]]
_Item = tuple[str, Sequence[str], "asyncio.Future[Any]"]


class SendAgain(Exception):
    """Raised by ``FastSend.finish``: this batch was not applied; send it with the async call."""


@dataclass(frozen=True, slots=True)
class FastSend:
    """Send a batch without a task: ``start(args)`` writes it and returns the raw reply future (None
    when it cannot, e.g. not connected); ``finish(future)`` turns that into the operations' replies
    or raises (``SendAgain`` to retry through the async call)."""

    start: Callable[[list[str]], asyncio.Future[Any] | None]
    finish: Callable[[asyncio.Future[Any]], Sequence[Any]]


class ScriptBatcher:
    def __init__(
        self, call: BatchCall, max_in_flight: int = 4, max_ops: int = 128, fast: FastSend | None = None
    ) -> None:
        self._call = call
        self._fast = fast
        self._max_in_flight = max_in_flight
        self._max_ops = max_ops
        self._pending: list[_Item] = []
        self._in_flight = 0
        self._scheduled = False
        self._tasks: set[asyncio.Task[None]] = set()
        self._wire: set[asyncio.Future[Any]] = set()  # fast-path batches awaiting their reply
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
            if self._fast is not None:
                loop.call_soon(self._flush, loop)
            else:
                self._start_task(loop, self._send())

    def _start_task(self, loop: asyncio.AbstractEventLoop, coro: Any) -> None:
        task = loop.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _take(self) -> list[_Item]:
        self._scheduled = False
        items, self._pending = self._pending[: self._max_ops], self._pending[self._max_ops :]
        return items

    def _sent(self, loop: asyncio.AbstractEventLoop) -> None:
        self._in_flight -= 1
        if self._pending:
            self._schedule(loop)

    def _flush(self, loop: asyncio.AbstractEventLoop) -> None:
        assert self._fast is not None
        items = self._take()
        if not items:
            self._sent(loop)
            return
        args = self._encode(items)
        try:
            wire = self._fast.start(args)
        except Exception as err:
            self._fail(items, err)
            self._sent(loop)
            return
        if wire is None:  # cannot send synchronously: the async call (connects if needed)
            self._start_task(loop, self._send_items(items, args, loop))
            return
        self._wire.add(wire)
        wire.add_done_callback(lambda f: self._fast_done(items, args, loop, f))

    def _fast_done(
        self, items: list[_Item], args: list[str], loop: asyncio.AbstractEventLoop, wire: asyncio.Future[Any]
    ) -> None:
        self._wire.discard(wire)
        assert self._fast is not None
        try:
            replies = self._fast.finish(wire)
        except SendAgain:
            self._start_task(loop, self._send_items(items, args, loop))
            return
        except Exception as err:
            self._fail(items, err)
        else:
            self._deliver(items, replies)
        self._sent(loop)

    async def _send(self) -> None:
        items = self._take()
        loop = asyncio.get_running_loop()
        if not items:
            self._sent(loop)
            return
        await self._send_items(items, self._encode(items), loop)

    def _encode(self, items: list[_Item]) -> list[str]:
        args: list[str] = []
        for name, op_args, _ in items:
            args += [name, str(len(op_args)), *op_args]
        self.batches += 1
        self.ops += len(items)
        return args

    @staticmethod
    def _fail(items: list[_Item], err: Exception) -> None:
        for _, _, fut in items:
            if not fut.done():
                fut.set_exception(err)

    @staticmethod
    def _deliver(items: list[_Item], replies: Sequence[Any]) -> None:
        for (_, _, fut), reply in zip(items, replies, strict=True):
            if not fut.done():
                fut.set_result(reply)

    async def _send_items(self, items: list[_Item], args: list[str], loop: asyncio.AbstractEventLoop) -> None:
        try:
            await self._send_args(items, args)
        finally:
            self._sent(loop)

    async def _send_args(self, items: list[_Item], args: list[str]) -> None:
        try:
            replies = await self._call(args)
        except asyncio.CancelledError:
            for _, _, fut in items:
                fut.cancel()
            raise
        except Exception as err:
            self._fail(items, err)
        else:
            self._deliver(items, replies)

    async def drain(self, timeout_s: float) -> None:
        """Wait (bounded) until every queued operation has been sent and answered."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while (self._pending or self._tasks or self._wire) and loop.time() < deadline:
            if self._tasks or self._wire:
                waits = [*self._tasks, *self._wire]
                await asyncio.wait(waits, timeout=max(0.0, deadline - loop.time()))
            else:
                await asyncio.sleep(0)  # a flush is scheduled: let it run

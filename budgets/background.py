"""One long-lived background task: started by name, stopped for sure, never dead in silence.

Five loops use it: the memory store's lease reaper, and the gateway's health checker, lease
heartbeat, observer ticker and backend scraper. It lives in ``budgets`` because that is the
lowest package all of them may import: ``budgets`` imports nothing of the other packages and
``gateway`` imports ``budgets``, so neither side imports upwards. The top-level layout is fixed
(no ``common/`` package), and a copy per package is what this module replaces.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine
from typing import Any


class BackgroundTask:
    """Runs ``body()`` as a named task; ``start`` and ``stop`` are idempotent.

    A body that raises is logged on ``log`` with its traceback the moment it dies: a reaper or a
    heartbeat that stops silently leaks tokens with nothing to show for it. Loops that must
    outlive a failed pass still catch per pass; this is the last line, not the first.
    """

    def __init__(self, name: str, body: Callable[[], Coroutine[Any, Any, None]], log: logging.Logger) -> None:
        self.name = name
        self._body = body
        self._log = log
        self._task: asyncio.Task[None] | None = None

    @property
    def running(self) -> bool:
        return self._task is not None and not self._task.done()

    def start(self) -> None:
        """Start the body in the running event loop; a no-op while it runs."""
        if self.running:
            return
        task = asyncio.get_running_loop().create_task(self._body(), name=self.name)
        task.add_done_callback(self._ended)
        self._task = task

    async def stop(self) -> None:
        """Cancel the task and return once it has ended; a no-op when there is none.

        ``asyncio.wait`` rather than ``await task`` under ``suppress(CancelledError)``: the latter
        would also swallow a cancellation of the caller itself, and would raise again a crash
        that was already logged.
        """
        task, self._task = self._task, None
        if task is None:
            return
        task.cancel()
        await asyncio.wait((task,))

    def _ended(self, task: asyncio.Task[None]) -> None:
        if task.cancelled():
            return
        exc = task.exception()
        if exc is not None:
            self._log.error("background task %s died", self.name, exc_info=exc)
        elif task is self._task:  # returned although nobody stopped it: as dead as a crash
            self._log.error("background task %s ended on its own", self.name)

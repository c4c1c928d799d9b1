"""Helpers every test folder shares. Tests wait on conditions, never on a fixed sleep."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable


async def eventually(
    predicate: Callable[[], bool | Awaitable[bool]],
    timeout_s: float = 3.0,
    *,
    interval_s: float = 0.001,
    message: str = "condition not reached in time",
) -> None:
    """Poll ``predicate`` (plain or async) until it holds; AssertionError after ``timeout_s``.

    For what happens asynchronously: grants handed over by pub/sub, a disconnect reaching the
    upstream, a server coming up. The timeout only bounds a failing test; a passing one returns as
    soon as the condition holds.
    """
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while True:
        result = predicate()
        if not isinstance(result, bool):
            result = await result
        if result:
            return
        if loop.time() > deadline:
            raise AssertionError(message)
        await asyncio.sleep(interval_s)

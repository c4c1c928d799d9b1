"""Helpers every test folder shares. Tests wait on conditions, never on a fixed sleep."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Awaitable, Callable

# ``make test-long`` (TOKENGATE_TEST_LONG=1): property tests explore with random seeds and ten
# times the examples, and exhaustive tests widen their scope. ``make test`` is deterministic
# (tests/conftest.py loads a derandomized Hypothesis profile): the same examples every run.
LONG = os.environ.get("TOKENGATE_TEST_LONG") == "1"


def examples(n: int) -> int:
    """A property test's ``max_examples``: ``n`` under ``make test``, ``10 * n`` under ``make test-long``."""
    return 10 * n if LONG else n


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

"""The memory store's own machinery, beyond the store contract (tests/budgets/test_contract_*)."""

from __future__ import annotations

import asyncio

import pytest

from budgets.memory import MemoryStore
from budgets.types import Lease, QueueTimeout
from tests.budgets.support import demand, layout, shared

P = "backend:p"


def test_a_store_used_from_a_new_event_loop_still_times_its_waiters_out() -> None:
    # The waiters' deadlines share one loop timer. A store whose timer was armed on a loop that
    # has since closed must arm it again on the loop that waits now, or its waiters never expire.
    store = MemoryStore(layout([shared(P, 100)], ["a", "b"]))
    blocker: list[Lease] = []

    async def first_loop() -> None:
        blocker.append(await store.acquire(demand("a", 100, P), 1))
        waiter = asyncio.create_task(store.acquire(demand("b", 10, P), 0.5))
        await asyncio.sleep(0.01)
        waiter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiter

    async def second_loop() -> None:
        with pytest.raises(QueueTimeout):
            await asyncio.wait_for(store.acquire(demand("b", 10, P), 1.0), 5)
        assert await store.release(blocker[0].id)

    with asyncio.Runner() as runner:
        runner.run(first_loop())
    with asyncio.Runner() as runner:
        runner.run(second_loop())

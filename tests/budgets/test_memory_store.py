"""The memory store's own machinery, beyond the store contract (tests/budgets/test_contract_*)."""

from __future__ import annotations

import asyncio

import pytest

from budgets.memory import MemoryStore
from budgets.types import Lease, QueueTimeout
from tests.budgets.support import P, demand, layout, shared


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


async def test_a_waiter_or_lease_that_leaves_takes_its_deadline_expiry_and_index_entries_with_it() -> None:
    # Granted, cancelled or timed out: nothing a waiter left behind is walked later (a lazy heap
    # kept granted waiters' deadlines until they came up, then dropped them all in one step).
    store = MemoryStore(layout([shared(P, 10)], ["a", "b", "c"]))
    await store.start()
    try:
        held = await store.acquire(demand("a", 10, P), 1)
        granted = [asyncio.create_task(store.acquire(demand("b", 10, P), 30)) for _ in range(3)]
        cancelled = [asyncio.create_task(store.acquire(demand("c", 10, P), 30)) for _ in range(3)]
        late = asyncio.create_task(store.acquire(demand("a", 10, P), 0.05))  # times out
        await asyncio.sleep(0.01)
        assert len(store._deadlines) == 7
        for task in cancelled:
            task.cancel()
        with pytest.raises(QueueTimeout):
            await late
        assert len(store._deadlines) == 3
        for task in granted:
            await store.release(held.id)
            held = await task
        await store.heartbeat([held.id])  # moves its expiry entry, leaves no second one
        assert len(store._expiry) == 1
        await store.release(held.id)
        assert len(store._deadlines) == 0 and not store._waiters and len(store._expiry) == 0
        state = store._state
        assert not state.index.age and not state.backlog_min and not state.lease_min
        assert not state.index.heads and not state.index.groups
    finally:
        await store.close()

"""Store contract: the order inside one tenant's queue (``tenant_queue_order``, policy docstring).

Under ``shortest_first`` a tenant's ticket with a shorter predicted output (its reservation,
``decode``) is granted before its longer ones, never before another tenant's, and never before a
ticket of its own enqueued ``max_defer_s`` or more earlier. Here ``defer_s_per_token`` is 1 s, so a
ticket reserving ``n`` output tokens is deferred ``min(n, 5)`` virtual seconds.
"""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from budgets.types import BudgetLayout, Demand, QueueOrder, UnknownTenantOrTier
from tests.budgets.conftest import StoreFactory
from tests.budgets.support import (
    FLAT,
    FakeClock,
    P,
    assert_idle,
    demand,
    layout,
    shared,
    wait_queued,
    waiting,
)
from tests.budgets.test_contract_queue import Waiters


def ordered(order: QueueOrder = "shortest_first", tenants: tuple[str, ...] = ("a", "b", "c")) -> BudgetLayout:
    """One shared pool of 10 tokens; every request below costs 10, so they are served one at a time."""
    base = layout([shared(P, 10)], list(tenants), tiers=FLAT)
    spec = dataclasses.replace(base.policy, tenant_queue_order=order, max_defer_s=5.0, defer_s_per_token=1.0)
    return dataclasses.replace(base, policy=spec)


def ask(tenant: str, output: int) -> Demand:
    """A request of 10 tokens, ``output`` of them reserved for the output (the prediction)."""
    return demand(tenant, 10, P, tier="std", decode=output)


@pytest.mark.parametrize(
    ("order", "expected"),
    [("fifo", ["long", "mid", "short"]), ("shortest_first", ["short", "mid", "long"])],
)
async def test_a_tenants_short_request_is_granted_before_its_long_ones_only_under_shortest_first(
    store_factory: StoreFactory, order: QueueOrder, expected: list[str]
) -> None:
    store = await store_factory(ordered(order))
    blocker = await store.acquire(ask("c", 0), 1)
    w = Waiters(store)
    await w.add("long", ask("a", 9))
    await w.add("mid", ask("a", 3))
    await w.add("short", ask("a", 1))
    assert await w.serve_one_at_a_time(blocker, 3) == expected
    await assert_idle(store)


async def test_a_short_request_never_passes_another_tenants_long_one(store_factory: StoreFactory) -> None:
    store = await store_factory(ordered())
    blocker = await store.acquire(ask("c", 0), 1)
    w = Waiters(store)
    # a and b join at c's counter: tied, a's first ticket is the older, so a is served first, with
    # its shortest ticket; b's short ticket waits for its turn in fair share like under fifo.
    await w.add("a-long", ask("a", 9))
    await w.add("b-short", ask("b", 0))
    await w.add("a-mid", ask("a", 4))
    order = await w.serve_one_at_a_time(blocker, 3)
    assert order == ["a-mid", "b-short", "a-long"]
    await assert_idle(store)


async def test_a_long_request_is_passed_by_nothing_enqueued_max_defer_s_after_it(
    store_factory: StoreFactory, clock: FakeClock
) -> None:
    store = await store_factory(ordered())
    blocker = await store.acquire(ask("c", 0), 1)
    w = Waiters(store)
    await w.add("long", ask("a", 9))  # key t + 5 (capped at max_defer_s)
    clock.advance(3.0)
    await w.add("short-at-3s", ask("a", 1))  # key t + 4: passes
    clock.advance(2.0)
    await w.add("instant-at-5s", ask("a", 0))  # key t + 5: the same key, the older ticket first
    clock.advance(1.0)
    await w.add("instant-at-6s", ask("a", 0))  # key t + 6
    order = await w.serve_one_at_a_time(blocker, 4)
    assert order == ["short-at-3s", "long", "instant-at-5s", "instant-at-6s"]
    await assert_idle(store)


async def test_withdrawing_the_head_or_the_first_ticket_of_an_ordered_queue_keeps_the_rest_in_order(
    store_factory: StoreFactory,
) -> None:
    store = await store_factory(ordered())
    blocker = await store.acquire(ask("c", 0), 1)
    w = Waiters(store)
    first = await w.add("a-first", ask("a", 9))  # the queue's first ticket: a's rank
    await w.add("b", ask("b", 0))
    head = await w.add("a-head", ask("a", 0))  # the queue's head
    await w.add("a-mid", ask("a", 4))
    await w.add("a-long", ask("a", 6))
    for task in (head, first):
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    assert await waiting(store) == 3
    # a now ranks by a-mid's seq, after b's: b is served first.
    assert await w.serve_one_at_a_time(blocker, 3) == ["b", "a-mid", "a-long"]
    await assert_idle(store)


@pytest.mark.parametrize(
    ("before", "after", "expected"),
    [
        ("fifo", "shortest_first", ["short", "long"]),
        ("shortest_first", "fifo", ["long", "short"]),
    ],
)
async def test_switching_the_order_live_reorders_the_tickets_already_waiting(
    store_factory: StoreFactory, before: QueueOrder, after: QueueOrder, expected: list[str]
) -> None:
    store = await store_factory(ordered(before))
    blocker = await store.acquire(ask("c", 0), 1)
    w = Waiters(store)
    await w.add("long", ask("a", 9))
    await w.add("short", ask("a", 1))
    await store.apply_layout(ordered(after))
    assert await waiting(store) == 2
    assert await w.serve_one_at_a_time(blocker, 2) == expected
    await assert_idle(store)


async def test_dropping_a_tenant_live_fails_its_ordered_tickets_and_the_others_keep_their_order(
    store_factory: StoreFactory,
) -> None:
    store = await store_factory(ordered())
    blocker = await store.acquire(ask("c", 0), 1)
    dropped = [asyncio.create_task(store.acquire(ask("b", n), 10)) for n in (9, 1)]
    await wait_queued(store, 2)
    w = Waiters(store)
    await w.add("long", ask("a", 9))
    await w.add("short", ask("a", 1))
    await store.apply_layout(ordered(tenants=("a", "c")))
    for task in dropped:
        with pytest.raises(UnknownTenantOrTier):
            await task
    assert await waiting(store) == 2
    assert await w.serve_one_at_a_time(blocker, 2) == ["short", "long"]
    # b comes back (a newcomer) and queues again without a trace of its old tickets.
    await store.apply_layout(ordered())
    lease = await store.acquire(ask("b", 1), 1)
    await store.release(lease.id)
    await assert_idle(store)

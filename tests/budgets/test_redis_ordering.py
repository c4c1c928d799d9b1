"""Redis-only facts of shortest_first: its per-queue sorted sets leave nothing behind, head
records written before the rank seq existed still rank by their own seq, and the setting reaches
other replicas without changing the digest of layouts that leave it at its defaults."""

from __future__ import annotations

import asyncio
import dataclasses
import json

from redis.asyncio import Redis

from budgets.redis.keys import layout_from_json, layout_json
from budgets.types import BudgetLayout
from tests.budgets.redis_fixtures import RedisServer, StoreMaker, make_store, redis_server
from tests.budgets.support import FLAT, P, assert_idle, demand, layout, shared, wait_queued

__all__ = ["make_store", "redis_server"]  # fixtures used below


def shortest_first() -> BudgetLayout:
    base = layout([shared(P, 10)], ["a", "b"], tiers=FLAT)
    return dataclasses.replace(
        base, policy=dataclasses.replace(base.policy, tenant_queue_order="shortest_first")
    )


async def test_ordered_queues_leave_no_key_behind_once_served_withdrawn_or_dropped(
    redis_server: RedisServer, make_store: StoreMaker
) -> None:
    store = make_store(redis_server, shortest_first())
    await store.start()
    tag = store._keys.tag
    blocker = await store.acquire(demand("b", 10, P, tier="std"), 1)
    tasks = [
        asyncio.create_task(store.acquire(demand(t, 10, P, tier="std", decode=n), 10))
        for t, n in (("a", 9), ("a", 1), ("a", 5), ("b", 3))
    ]
    await wait_queued(store, 4)
    raw = Redis.from_url(redis_server.url, decode_responses=False)
    try:
        assert len([k async for k in raw.scan_iter(f"{tag}:qo:*")]) == 2
        tasks[2].cancel()  # a's withdrawn ticket
        await store.apply_layout(
            dataclasses.replace(shortest_first(), tenants={"a": shortest_first().tenants["a"]})
        )
        await asyncio.gather(tasks[2], tasks[3], return_exceptions=True)  # b's ticket fails: b is gone
        await wait_queued(store, 2)
        assert await store.release(blocker.id)
        for task in (tasks[1], tasks[0]):  # a's short ticket first
            lease = await asyncio.wait_for(task, 5)
            assert await store.release(lease.id)
        assert [k async for k in raw.scan_iter(f"{tag}:qo:*")] == []
        assert [k async for k in raw.scan_iter(f"{tag}:q:*")] == []
    finally:
        await raw.aclose()
    await assert_idle(store)


async def test_head_records_written_before_the_rank_seq_existed_rank_by_their_own_seq(
    redis_server: RedisServer, make_store: StoreMaker
) -> None:
    lay = layout([shared(P, 10)], ["a", "b", "c"], tiers=FLAT)
    store = make_store(redis_server, lay)
    await store.start()
    tag = store._keys.tag
    blocker = await store.acquire(demand("c", 10, P, tier="std"), 1)
    tasks = [asyncio.create_task(store.acquire(demand(t, 10, P, tier="std"), 10)) for t in ("a", "b", "a")]
    await wait_queued(store, 3)
    raw = Redis.from_url(redis_server.url, decode_responses=False)
    try:
        heads = await raw.hgetall(f"{tag}:heads")
        assert len(heads) == 2
        # The older format: the same fields without the trailing rank seq.
        await raw.hset(f"{tag}:heads", mapping={k: v.rsplit(b"\x1f", 1)[0] for k, v in heads.items()})
    finally:
        await raw.aclose()
    assert await store.release(blocker.id)
    # a and b were lifted to c's counter: tied, a's older ticket goes first, then b (a was charged).
    for task in (tasks[0], tasks[1], tasks[2]):
        lease = await asyncio.wait_for(task, 5)
        assert not any(t.done() for t in tasks[tasks.index(task) + 1 :])
        assert await store.release(lease.id)
    await assert_idle(store)


def test_the_queue_order_travels_to_other_replicas_and_its_defaults_keep_the_older_digest() -> None:
    fifo = layout([shared(P, 10)], ["a"], tiers=FLAT)
    # What versions before the queue order wrote: six policy fields, nothing more.
    assert json.loads(layout_json(fifo))["policy"] == [1.0, 2.0, 2.0, 10.0, 256, 3600.0]
    assert layout_from_json(layout_json(fifo)) == fifo
    ordered = dataclasses.replace(
        fifo,
        policy=dataclasses.replace(
            fifo.policy, tenant_queue_order="shortest_first", max_defer_s=4.0, defer_s_per_token=0.002
        ),
    )
    assert layout_from_json(layout_json(ordered)) == ordered
    assert layout_json(ordered) != layout_json(fifo)

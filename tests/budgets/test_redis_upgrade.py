"""A Redis that holds data written before the index existed is upgraded in place.

The older scripts kept counters in a hash and no index of the waiting heads; a replica of this
version must take over such a domain without losing a ticket or a fair-share decision.
"""

from __future__ import annotations

import asyncio

from redis.asyncio import Redis

from tests.budgets.redis_fixtures import RedisServer, StoreMaker, make_store, redis_server, unique_prefix
from tests.budgets.support import FLAT, P, demand, layout, shared, wait_queued

__all__ = ["make_store", "redis_server"]  # fixtures used below

DERIVED = ("vb", "vl", "idle", "ahead", "heads", "age", "gtiers", "clock")


async def make_it_old(server: RedisServer, tag: str) -> None:
    """Rewrite a domain as the older scripts left it: counters in a hash, no derived keys."""
    raw = Redis.from_url(server.url, decode_responses=True)
    counters = await raw.zrange(f"{tag}:vtc", 0, -1, withscores=True)
    await raw.delete(f"{tag}:vtc", *(f"{tag}:{k}" for k in DERIVED))
    await raw.delete(
        *[k async for k in raw.scan_iter(f"{tag}:g*")], *[k async for k in raw.scan_iter(f"{tag}:pv:*")]
    )
    await raw.hset(f"{tag}:vtc", mapping={t: repr(c) for t, c in counters})
    await raw.hdel(f"{tag}:layout", "index")
    await raw.aclose()


async def test_waiting_tickets_of_an_older_version_are_granted_in_fair_share_order(
    redis_server: RedisServer, make_store: StoreMaker
) -> None:
    lay = layout([shared(P, 100)], ["a", "b", "c"], tiers=FLAT)
    prefix = unique_prefix()
    old = make_store(redis_server, lay, prefix)
    await old.start()
    held = await old.acquire(demand("a", 100, P, tier="std"), 1)
    waiters = [
        asyncio.create_task(old.acquire(demand(t, 50, P, tier="std"), 30)) for t in ("a", "a", "b", "c")
    ]
    await wait_queued(old, 4)
    await make_it_old(redis_server, old.keys.tag)
    new = make_store(redis_server, lay, prefix)
    await new.start()  # its apply_layout upgrades the domain
    raw = Redis.from_url(redis_server.url, decode_responses=True)
    assert await raw.type(f"{old.keys.tag}:vtc") == "zset"
    assert await raw.hlen(f"{old.keys.tag}:heads") == 3
    await raw.aclose()
    assert await new.release(held.id, 0)
    # b and c were lifted to a's counter (100) as they queued: all level, so arrival decides (a's
    # first ticket, then b); a is charged 50 and goes behind c.
    first = await asyncio.wait_for(asyncio.gather(waiters[0], waiters[2]), 5)
    assert not waiters[1].done() and not waiters[3].done()
    await old.release(first[0].id, 0)
    assert (await asyncio.wait_for(waiters[3], 5)).demand.tenant == "c"
    assert not waiters[1].done()
    await old.release(first[1].id, 0)
    await asyncio.wait_for(waiters[1], 5)
    for task in (waiters[1], waiters[3]):
        await old.release(task.result().id, 0)
    snap = await new.snapshot()
    assert sum(snap.queue_depth.values()) == 0 and snap.leases == 0

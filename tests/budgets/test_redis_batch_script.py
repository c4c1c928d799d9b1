"""The ``batch`` script (budgets/redis/lua/batch.lua) makes exactly the decisions of the same
operations sent as separate script calls at the same instant.

A batch shares per-call state between its operations: the specs and counts read, the heads parsed,
and whether the last grant pass ran to its end ("Settled" in budgets/policy.py, kept per call: an
acquire that queues behind its tenant's existing head skips its pass). None of that may change a
decision. Two domains of one real Redis get the same layout and the same history; then the same
random operations go to one as a single ``batch`` call and to the other as one call each, all with
the same clock reading. The replies, the wake-ups and every key of the two domains must be equal
(but for emptied groups a skipped pass has not dropped yet: ``without_emptied_groups``).

Two more scenarios put forty tenants in one group: a crowded one (old and young sets of dozens of
heads, grants and promotions through them) and a run of newcomers (a young set growing from nothing
within the batch, then let in by releases).
"""

from __future__ import annotations

import asyncio
import random
from typing import Any

import pytest
from redis.asyncio import Redis

from budgets.redis import RedisOptions, RedisStore
from budgets.redis.keys import pack_demand
from budgets.redis.scripts import load_library
from budgets.types import BudgetLayout, Demand, PolicySpec, TenantSpec
from tests.budgets.redis_fixtures import session_redis, unique_prefix
from tests.budgets.support import TIERS, private, shared

P, Q = "backend:p", "backend:q"
TENANTS = ("a", "b", "c", "d", "e", "f", "g", "h")
TIER_NAMES = tuple(TIERS)
OWNER = "r1"
START = 1_796_113_271.25  # the history's clock; the operations run 0.75 s later


def busy_layout(tenants: tuple[str, ...] = TENANTS) -> BudgetLayout:
    pools = [shared(P, 100), shared(Q, 60)] + [private(f"tenant:{t}", 45) for t in tenants]
    return BudgetLayout(
        pools={p.name: p for p in pools},
        tiers=dict(TIERS),
        tenants={
            t: TenantSpec(t, weight=(1.0, 2.0, 0.5)[i % 3], max_queue_len=6) for i, t in enumerate(tenants)
        },
        policy=PolicySpec(backfill_limit_s=0.5, max_scan=8, lease_ttl_s=30.0),
    )


class Domain:
    """One budget domain, driven with raw FCALLs on a fixed clock reading."""

    def __init__(self, client: Redis, store: RedisStore) -> None:
        self.client = client
        self.store = store
        self.key = store.keys.layout
        self.fn = load_library().functions

    async def call(self, now: float, name: str, args: list[str]) -> list[Any]:
        """One script call: [reply, wake-ups for the caller]."""
        return list(await self.client.fcall(self.fn[name], 1, self.key, repr(now), OWNER, *args))

    async def batch(self, now: float, ops: list[tuple[str, list[str]]]) -> list[Any]:
        flat: list[str] = []
        for name, args in ops:
            flat += [name, str(len(args)), *args]
        return await self.call(now, "batch", flat)

    async def dump(self) -> dict[str, Any]:
        """Every key of the domain (its hash tag stripped) with its whole value, but the epoch (each
        domain's random identity, written when its first replica starts)."""
        out: dict[str, Any] = {}
        tag = self.store.keys.tag
        async for key in self.client.scan_iter(f"{tag}:*", count=1000):
            kind = await self.client.type(key)
            if kind == "hash":
                value: Any = await self.client.hgetall(key)
            elif kind == "zset":
                value = await self.client.zrange(key, 0, -1, withscores=True)
            elif kind == "list":
                value = await self.client.lrange(key, 0, -1)
            elif kind == "set":
                value = sorted(await self.client.smembers(key))
            else:
                value = await self.client.get(key)
            out[key[len(tag) :]] = value
        del out[":epoch"]
        return without_emptied_groups(out)


def without_emptied_groups(keys: dict[str, Any]) -> dict[str, Any]:
    """The dump without the group ids that ``T:gt:<tier>`` (and tiers that ``T:gtiers``) still list
    with no head left: a grant pass drops those when it finds them (lib.lua, next_candidate), so a
    pass skipped on a settled state leaves them for the next one. Not a decision."""
    out = dict(keys)
    for key in [k for k in keys if k.startswith(":gt:")]:
        tier = key[len(":gt:") :]
        live = [
            g
            for g in keys[key]
            if f":go:{len(tier)}:{tier}:{g}" in keys or f":gy:{len(tier)}:{tier}:{g}" in keys
        ]
        if live:
            out[key] = live
        else:
            del out[key]
            out[":gtiers"] = [t for t in out.get(":gtiers", []) if t != tier]
    if not out.get(":gtiers", True):
        del out[":gtiers"]
    return out


def acquire(lease_id: str, rng: random.Random, tenants: tuple[str, ...] = TENANTS) -> tuple[str, list[str]]:
    tenant = rng.choice(tenants)
    pools = rng.choice([(P,), (Q,), (P, Q)])
    cost, decode = rng.choice([(5, 0), (10, 5), (20, 10), (35, 15)])
    d = Demand(tenant, rng.choice(TIER_NAMES), (f"tenant:{tenant}", *pools), cost - decode, decode)
    return "acquire", [lease_id, *pack_demand(d)]


async def domains(n: int, layout: BudgetLayout | None = None) -> tuple[Redis, list[Domain]]:
    server = session_redis()
    client = Redis.from_url(server.url, decode_responses=True, encoding="latin-1")
    out = []
    for _ in range(n):
        store = RedisStore(
            layout or busy_layout(),
            RedisOptions(url=server.url, key_prefix=unique_prefix()),
            replica_id=OWNER,
        )
        await store.start()  # writes the layout and loads the library
        await store.close()
        out.append(Domain(client, store))
    return client, out


async def same_decisions(one: Domain, each: Domain, now: float, ops: list[tuple[str, list[str]]]) -> None:
    batch_reply, batch_wakes = await one.batch(now, ops)
    replies, wakes = [], []
    for name, args in ops:
        reply, mine = await each.call(now, name, args)
        replies.append(reply)
        wakes += mine
    assert batch_reply == replies
    assert batch_wakes == wakes
    assert await one.dump() == await each.dump()


async def compare(seed: int) -> None:
    rng = random.Random(seed)
    client, (one, each) = await domains(2)
    try:
        # The same history in both: leases of every tenant that fill the pools, then tickets of
        # half of them in every tier (a release of the others' leases moves no head).
        history = [acquire(f"h{i}", rng, TENANTS if i < 14 else TENANTS[:4]) for i in range(40)]
        for name, args in history:
            assert await one.call(START, name, args) == await each.call(START, name, args)
        held = [f"h{i}" for i in range(40)]
        rng.shuffle(held)
        ops: list[tuple[str, list[str]]] = []
        for i in range(60):  # mostly acquires (many behind their tenant's head), some releases
            if held and rng.random() < 0.3:
                ops.append(("release", [held.pop(), rng.choice(["", "0", "3", "40"])]))
            else:
                ops.append(acquire(f"n{i}", rng))
        now = START + 0.75  # heads of the history are past the backfill limit: promotions
        await same_decisions(one, each, now, ops)
    finally:
        await client.aclose()


@pytest.mark.parametrize("seed", range(40))
def test_a_batch_makes_the_decisions_of_its_operations_sent_one_by_one(seed: int) -> None:
    asyncio.run(compare(seed))


CROWD = tuple(f"t{i:02d}" for i in range(40))
CROWD_TIER = TIER_NAMES[1]


def crowd_acquire(lease_id: str, tenant: str, cost: int, decode: int = 0) -> tuple[str, list[str]]:
    """An acquire of pool P (and the tenant's own) in CROWD_TIER: every head in one group."""
    d = Demand(tenant, CROWD_TIER, (f"tenant:{tenant}", P), cost - decode, decode)
    return "acquire", [lease_id, *pack_demand(d)]


async def compare_crowded(seed: int) -> None:
    """One group of forty heads, old and young. Small leases fill the pool; releasing them (and
    leases granted in the batch) lets heads in, in rank order through dozens of members."""
    rng = random.Random(seed)
    client, (one, each) = await domains(2, busy_layout(CROWD))

    def op(lease_id: str, cost: int, decode: int) -> tuple[str, list[str]]:
        return crowd_acquire(lease_id, rng.choice(CROWD), cost, decode)

    try:
        history = [op(f"h{i}", 5, 0) for i in range(20)]  # 20 x 5 tokens: P is full
        history += [op(f"h{i}", *rng.choice([(5, 0), (10, 5), (15, 5)])) for i in range(20, 90)]  # waiting
        for name, args in history:
            assert await one.call(START, name, args) == await each.call(START, name, args)
        ids = [f"h{i}" for i in range(90)]
        ops: list[tuple[str, list[str]]] = []
        for i in range(90):  # grants (releases), repositions, promotions, new young heads
            if rng.random() < 0.45:  # a held lease, or a waiting one the batch may have granted by then
                ops.append(("release", [ids.pop(rng.randrange(len(ids))), rng.choice(["", "0", "3"])]))
            else:
                ops.append(op(f"n{i}", *rng.choice([(5, 0), (10, 5)])))
        await same_decisions(one, each, START + 0.75, ops)
    finally:
        await client.aclose()


async def compare_newcomers(seed: int) -> None:
    """A full pool, then twenty tenants new to the queue: one group's young set grows from nothing
    within the batch; releases at the end let its heads in."""
    rng = random.Random(seed)
    client, (one, each) = await domains(2, busy_layout(CROWD))
    try:
        for i in range(20):  # 20 x 5 tokens: P is full
            name, args = crowd_acquire(f"h{i}", CROWD[i], 5)
            assert await one.call(START, name, args) == await each.call(START, name, args)
        newcomers = list(CROWD[20:])
        rng.shuffle(newcomers)
        ops = [crowd_acquire(f"n{i}", t, rng.choice([5, 10])) for i, t in enumerate(newcomers)]
        held = [f"h{i}" for i in range(20)]
        rng.shuffle(held)
        for i in range(30):
            if held and rng.random() < 0.6:
                ops.append(("release", [held.pop(), ""]))
            else:
                ops.append(crowd_acquire(f"m{i}", rng.choice(CROWD), rng.choice([5, 10])))
        await same_decisions(one, each, START + 0.25, ops)
    finally:
        await client.aclose()


@pytest.mark.parametrize("seed", range(12))
def test_a_batch_decides_the_same_in_one_group_of_forty_tenants(seed: int) -> None:
    asyncio.run(compare_crowded(seed))
    asyncio.run(compare_newcomers(seed))

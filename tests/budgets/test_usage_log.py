"""The usage log for billing (budgets/usage_log.py) on every store kind: adds from several writers sum
per (hour, tenant, key, model), reads return the rows of the hours asked for, a hour is forgotten
after its keep time, and a part a client named with the separator in it cannot split a row."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest

from budgets.memory import MemoryStore
from budgets.redis.store import RedisStore
from budgets.usage_log import COUNTS, SEP, MemoryUsageLog, UsageLog, UsageRow, hour_of
from tests.budgets.conftest import FACTORIES, STORE_KINDS
from tests.budgets.redis_fixtures import RedisServer, StoreMaker, fresh_redis, make_store
from tests.budgets.support import FakeClock, layout, shared

__all__ = ["fresh_redis", "make_store"]  # fixtures used below

H = hour_of(1_796_000_000.0)
LogFactory = Callable[[], Awaitable[UsageLog]]


@pytest.fixture(params=STORE_KINDS)
async def log_factory(request: pytest.FixtureRequest, clock: FakeClock) -> AsyncIterator[LogFactory]:
    made: list[MemoryStore | RedisStore] = []

    async def make() -> UsageLog:
        store = await FACTORIES[request.param](layout([shared("p", 100)], ["a"]), clock)
        await store.start()
        made.append(store)
        return store.usage_log() if isinstance(store, RedisStore) else MemoryUsageLog()

    yield make
    for store in made:
        await store.close()


def counts(requests: int, prompt: int, completion: int, cost: int = 0) -> tuple[int, ...]:
    return (requests, prompt, 0, completion, cost, 0)


async def test_adds_from_every_writer_sum_per_row(log_factory: LogFactory) -> None:
    log = await log_factory()
    a = ("acme", "k1", "llama")
    b = ("acme", "k2", "llama")
    await asyncio.gather(
        *(log.add(H, {a: counts(1, 10, 5, 7)}, 3600) for _ in range(20)),
        log.add(H, {b: counts(2, 3, 4)}, 3600),
        log.add(H + 3600, {a: counts(1, 1, 1)}, 3600),
    )
    rows = await log.read([H, H + 3600, H + 7200])
    assert rows == [
        UsageRow(H, "acme", "k1", "llama", counts(20, 200, 100, 140)),
        UsageRow(H, "acme", "k2", "llama", counts(2, 3, 4)),
        UsageRow(H + 3600, "acme", "k1", "llama", counts(1, 1, 1)),
    ]
    assert await log.read([H + 3600]) == rows[2:]
    assert await log.read([]) == []
    assert len(COUNTS) == len(rows[0].counts)


async def test_a_separator_in_a_name_cannot_split_a_row(log_factory: LogFactory) -> None:
    log = await log_factory()
    await log.add(H, {("acme", "", f"evil{SEP}model"): counts(1, 1, 1)}, 3600)
    [row] = await log.read([H])
    assert row.tenant == "acme" and row.key == "" and SEP not in row.model and row.counts == counts(1, 1, 1)


async def test_an_hour_is_forgotten_after_its_keep_time() -> None:
    now = [1000.0]
    log = MemoryUsageLog(clock=lambda: now[0])
    await log.add(H, {("acme", "", "m"): counts(1, 1, 1)}, 60)
    now[0] += 59
    assert len(await log.read([H])) == 1
    now[0] += 2
    assert await log.read([H]) == []


async def test_redis_forgets_an_hour_after_its_keep_time(
    fresh_redis: RedisServer, make_store: StoreMaker
) -> None:
    store = make_store(fresh_redis, layout([shared("p", 100)], ["a"]))
    await store.start()
    log = store.usage_log()
    await log.add(H, {("acme", "", "m"): counts(1, 1, 1)}, 1)
    assert len(await log.read([H])) == 1
    await asyncio.sleep(1.5)
    assert await log.read([H]) == []

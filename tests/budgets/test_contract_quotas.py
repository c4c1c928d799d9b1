"""Quota ledger contract (budgets/quotas.py), run against every store kind: the in-process ledger and
Redis (functions, scripts, Cluster). Windows on a fake wall clock (``NOW``); reservation expiry on
the store's FakeClock."""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from budgets.memory import MemoryStore
from budgets.quota import QuotaSpec, Refused, Reserved, Window, retry_after_s
from budgets.quotas import MemoryQuotas, QuotaLedger
from budgets.redis.store import RedisStore
from budgets.types import StoreUnavailable
from tests.budgets.conftest import FACTORIES, STORE_KINDS
from tests.budgets.redis_fixtures import RedisServer, StoreMaker, fresh_redis, make_store
from tests.budgets.support import FakeClock, layout, shared
from tests.support import eventually

__all__ = ["fresh_redis", "make_store"]  # fixtures used below

NOW = 1_796_000_000.0  # a wall-clock instant (2026-11-30, a Monday, 22:53:20 UTC)
TTL = 5.0

LedgerFactory = Callable[[], Awaitable[QuotaLedger]]


@pytest.fixture(params=STORE_KINDS)
async def ledger_factory(request: pytest.FixtureRequest, clock: FakeClock) -> AsyncIterator[LedgerFactory]:
    made: list[tuple[object, QuotaLedger]] = []

    async def make() -> QuotaLedger:
        store = await FACTORIES[request.param](layout([shared("p", 100)], ["a"]), clock)
        await store.start()
        ledger: QuotaLedger = (
            store.quota_ledger(TTL) if isinstance(store, RedisStore) else MemoryQuotas(TTL, clock=clock)
        )
        await ledger.start()
        made.append((store, ledger))
        return ledger

    yield make
    for store, ledger in made:
        await ledger.close()
        assert isinstance(store, (MemoryStore, RedisStore))
        await store.close()


def tokens(
    limit: int, period: str = "day", *, rolling: bool = False, enforce: bool = True, name: str = "q"
) -> QuotaSpec:
    return QuotaSpec(name, "a", "tokens", limit, Window(period, rolling=rolling), enforce=enforce)


async def test_reservations_never_take_more_than_the_limit(ledger_factory: LedgerFactory) -> None:
    ledger = await ledger_factory()
    q = tokens(100)
    assert await ledger.reserve("r1", [q.charge(60, NOW)]) == Reserved((60,))
    refused = await ledger.reserve("r2", [q.charge(41, NOW)])
    assert isinstance(refused, Refused) and refused.index == 0
    assert dict(refused.buckets) == {q.window.bucket(NOW): 60}
    assert await ledger.reserve("r3", [q.charge(40, NOW)]) == Reserved((100,))
    assert await ledger.usage([(q.key, q.window.oldest(NOW))]) == [(0, 100)]


async def test_settle_replaces_the_reservation_with_the_use_once(ledger_factory: LedgerFactory) -> None:
    ledger = await ledger_factory()
    q = tokens(100)
    await ledger.reserve("r1", [q.charge(60, NOW)])
    assert await ledger.settle("r1", [25]) is True
    assert await ledger.settle("r1", [25]) is False
    assert await ledger.usage([(q.key, q.window.oldest(NOW))]) == [(25, 0)]
    # the refund makes room: 75 more fit now
    assert isinstance(await ledger.reserve("r2", [q.charge(75, NOW)]), Reserved)
    # an overdraft (the output grew past its reservation) is charged
    assert await ledger.settle("r2", [90]) is True
    assert await ledger.usage([(q.key, q.window.oldest(NOW))]) == [(115, 0)]
    assert isinstance(await ledger.reserve("r3", [q.charge(1, NOW)]), Refused)


async def test_all_or_nothing_across_quotas(ledger_factory: LedgerFactory) -> None:
    ledger = await ledger_factory()
    day, minute = tokens(1000, "day", name="d"), tokens(50, "minute", name="m")
    assert isinstance(await ledger.reserve("r1", [day.charge(40, NOW), minute.charge(40, NOW)]), Reserved)
    refused = await ledger.reserve("r2", [day.charge(20, NOW), minute.charge(20, NOW)])
    assert isinstance(refused, Refused) and refused.index == 1
    windows = [(day.key, day.window.oldest(NOW)), (minute.key, minute.window.oldest(NOW))]
    assert await ledger.usage(windows) == [(0, 40), (0, 40)]  # the day took nothing for r2


async def test_a_fixed_window_forgets_its_use_when_it_ends(ledger_factory: LedgerFactory) -> None:
    ledger = await ledger_factory()
    q = tokens(100, "minute")
    start, end = q.window.bucket(NOW), q.window.bucket(NOW) + 60
    await ledger.reserve("r1", [q.charge(100, start + 59.9)])
    refused = await ledger.reserve("r2", [q.charge(10, start + 59.9)])
    assert isinstance(refused, Refused)
    assert retry_after_s(q, 10, refused.buckets, start + 59.9) == pytest.approx(0.1)
    assert isinstance(await ledger.reserve("r3", [q.charge(100, end)]), Reserved)
    # settling r1 after its window ended charges nothing to the new one
    assert await ledger.settle("r1", [100]) is True
    assert await ledger.usage([(q.key, q.window.oldest(end))]) == [(0, 100)]


async def test_a_rolling_window_frees_its_oldest_buckets_first(ledger_factory: LedgerFactory) -> None:
    ledger = await ledger_factory()
    q = tokens(100, "hour", rolling=True)  # 60 buckets of a minute
    for i, t in enumerate((NOW, NOW + 600, NOW + 1200)):
        assert isinstance(await ledger.reserve(f"r{i}", [q.charge(30, t)]), Reserved)
        await ledger.settle(f"r{i}", None)
    at = NOW + 1800
    refused = await ledger.reserve("x", [q.charge(40, at)])
    assert isinstance(refused, Refused)
    # 30 must leave: the first bucket, an hour after its minute ends
    first = q.window.bucket(NOW)
    assert retry_after_s(q, 40, refused.buckets, at) == pytest.approx(first + 60 + 3600 - at)
    later = first + 60 + 3600
    assert isinstance(await ledger.reserve("y", [q.charge(40, later)]), Reserved)


async def test_shadow_quotas_never_refuse_and_say_so(ledger_factory: LedgerFactory) -> None:
    ledger = await ledger_factory()
    shadow, real = tokens(10, enforce=False, name="s"), tokens(1000, name="r")
    assert await ledger.reserve("r1", [real.charge(8, NOW), shadow.charge(8, NOW)]) == Reserved((8, 8))
    assert await ledger.reserve("r2", [real.charge(8, NOW), shadow.charge(8, NOW)]) == Reserved(
        (16, 16), (1,)
    )
    assert await ledger.usage([(shadow.key, shadow.window.oldest(NOW))]) == [(0, 16)]


async def test_an_abandoned_reservation_expires_at_its_amount(
    ledger_factory: LedgerFactory, clock: FakeClock
) -> None:
    ledger = await ledger_factory()
    q = tokens(100)
    await ledger.reserve("dead", [q.charge(30, NOW)])
    await ledger.reserve("alive", [q.charge(30, NOW)])
    clock.advance(TTL - 1)
    await ledger.heartbeat(["alive"])
    clock.advance(1.5)
    assert await ledger.expire() == 1
    assert await ledger.settle("dead", [0]) is False  # already settled by its expiry
    assert await ledger.usage([(q.key, q.window.oldest(NOW))]) == [(30, 30)]
    assert await ledger.settle("alive", [5]) is True
    assert await ledger.usage([(q.key, q.window.oldest(NOW))]) == [(35, 0)]


async def test_a_reset_forgets_the_use_and_keeps_running_reservations(ledger_factory: LedgerFactory) -> None:
    ledger = await ledger_factory()
    q, other = tokens(100), tokens(100, name="other")
    await ledger.reserve("r1", [q.charge(70, NOW), other.charge(70, NOW)])
    await ledger.settle("r1", [70, 70])
    await ledger.reserve("r2", [q.charge(20, NOW)])  # still running
    assert await ledger.reset([q.key]) == 70
    windows = [(q.key, q.window.oldest(NOW)), (other.key, other.window.oldest(NOW))]
    assert await ledger.usage(windows) == [(0, 20), (70, 0)]  # the other quota keeps its use
    assert isinstance(await ledger.reserve("r3", [q.charge(80, NOW)]), Reserved)
    assert await ledger.settle("r2", [15]) is True  # settles as usual after the reset
    assert await ledger.usage(windows[:1]) == [(15, 80)]
    assert await ledger.reset(["never-used"]) == 0


async def test_unknown_reservations_settle_nothing(ledger_factory: LedgerFactory) -> None:
    ledger = await ledger_factory()
    assert await ledger.settle("never", [10]) is False
    assert await ledger.settle("never", None) is False


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    seed=st.integers(0, 2**32 - 1),
    limit=st.integers(1, 500),
    asks=st.lists(st.integers(1, 120), min_size=1, max_size=40),
)
async def test_concurrent_reservations_never_exceed_and_all_settle(
    ledger_factory: LedgerFactory, seed: int, limit: int, asks: list[int]
) -> None:
    """Property: whatever order concurrent requests reserve, settle (for less, more, or at the
    reservation) or vanish (expiry), the window never holds more than the limit plus what grew past
    reservations, and once all are settled it holds exactly the settled amounts."""
    ledger = await ledger_factory()
    rng = random.Random(seed)
    q = tokens(limit, rolling=rng.random() < 0.5, period="hour")
    window = [(q.key, q.window.oldest(NOW))]

    async def one(i: int, ask: int) -> int:
        outcome = await ledger.reserve(f"p{seed}-{i}", [q.charge(ask, NOW)])
        if isinstance(outcome, Refused):
            return 0
        _, reserved = (await ledger.usage(window))[0]
        assert reserved <= limit
        await asyncio.sleep(0)
        actual = rng.randint(0, ask)  # never more than reserved: the bound holds exactly
        assert await ledger.settle(f"p{seed}-{i}", [actual]) is True
        return actual

    results = await asyncio.gather(*(one(i, a) for i, a in enumerate(asks)))
    expected = sum(results)
    used, reserved = (await ledger.usage(window))[0]
    assert reserved == 0 and used == expected <= limit


@pytest.mark.redis_outage
async def test_a_redis_restart_loses_the_windows_and_settles_nothing(
    make_store: StoreMaker, fresh_redis: RedisServer
) -> None:
    """What a restart without persistence loses: every window's use and the reservations held.
    Settling a lost reservation returns False and charges nothing (no negative reservation)."""
    store = make_store(fresh_redis, layout([shared("p", 100)], ["a"]))
    await store.start()
    ledger = store.quota_ledger(TTL)
    q = tokens(100)
    window = [(q.key, q.window.oldest(NOW))]
    await ledger.reserve("before", [q.charge(60, NOW)])
    await ledger.settle("before", [50])
    await ledger.reserve("held", [q.charge(40, NOW)])
    assert await ledger.usage(window) == [(50, 40)]
    fresh_redis.restart()

    async def answers() -> bool:
        try:
            return await ledger.usage(window) == [(0, 0)]
        except StoreUnavailable:
            return False

    await eventually(answers, timeout_s=10)
    assert await ledger.settle("held", [40]) is False
    assert await ledger.usage(window) == [(0, 0)]
    assert isinstance(await ledger.reserve("after", [q.charge(100, NOW)]), Reserved)

"""The store contract suite runs once per store kind.

Adding a store is one line in STORE_KINDS plus its factory in FACTORIES: a factory gets the layout
and the test's FakeClock and returns an unstarted store (for Redis: on a fresh key prefix, so tests
never see each other's state).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable

import pytest

from budgets.memory import MemoryStore
from budgets.types import BudgetLayout, BudgetStore
from tests.budgets.redis_fixtures import (
    redis_cluster_store_factory,
    redis_scripts_store_factory,
    redis_store_factory,
)
from tests.budgets.support import FakeClock

StoreFactory = Callable[[BudgetLayout], Awaitable[BudgetStore]]


async def _memory(layout: BudgetLayout, clock: FakeClock) -> BudgetStore:
    return MemoryStore(layout, clock=clock)


FACTORIES: dict[str, Callable[[BudgetLayout, FakeClock], Awaitable[BudgetStore]]] = {
    "memory": _memory,
    "redis": redis_store_factory,
    "redis-scripts": redis_scripts_store_factory,
    "redis-cluster": redis_cluster_store_factory,
}
STORE_KINDS = ["memory", "redis", "redis-scripts", "redis-cluster"]


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture(params=STORE_KINDS)
async def store_factory(request: pytest.FixtureRequest, clock: FakeClock) -> AsyncIterator[StoreFactory]:
    made: list[BudgetStore] = []

    async def make(layout: BudgetLayout) -> BudgetStore:
        store = await FACTORIES[request.param](layout, clock)
        await store.start()
        made.append(store)
        return store

    yield make
    for store in made:
        await store.close()

"""Shared helpers for the budgets tests: a drivable clock, layout builders, polling (``eventually``
from tests.support)."""

from __future__ import annotations

from collections.abc import Iterable

from budgets.types import (
    BudgetLayout,
    BudgetStore,
    Demand,
    PolicySpec,
    PoolSpec,
    TenantSpec,
    TierSpec,
)
from tests.support import eventually


class FakeClock:
    """A clock the test advances by hand; stores read it for ages, expiries and rates."""

    def __init__(self, start: float = 1000.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


TIERS = {
    "critical": TierSpec("critical", rank=0, ceiling=1.0, max_queue_wait_s=30.0),
    "standard": TierSpec("standard", rank=1, ceiling=0.9, max_queue_wait_s=60.0),
    "batch": TierSpec("batch", rank=2, ceiling=0.7, max_queue_wait_s=600.0),
}
# One tier with no ceiling, for tests about fairness and backfill only.
FLAT = {"std": TierSpec("std", rank=0, ceiling=1.0, max_queue_wait_s=30.0)}
TIER_NAMES = ("critical", "standard", "batch")

# Two backend pools' names.
P = "backend:p"
Q = "backend:q"


def shared(name: str, capacity: int) -> PoolSpec:
    return PoolSpec(name, capacity, shared=True)


def private(name: str, capacity: int) -> PoolSpec:
    return PoolSpec(name, capacity, shared=False)


def layout(
    pools: Iterable[PoolSpec],
    tenants: Iterable[str | TenantSpec],
    tiers: dict[str, TierSpec] | None = None,
    **policy: float,
) -> BudgetLayout:
    specs = [t if isinstance(t, TenantSpec) else TenantSpec(t) for t in tenants]
    return BudgetLayout(
        pools={p.name: p for p in pools},
        tiers=dict(TIERS if tiers is None else tiers),
        tenants={t.name: t for t in specs},
        policy=PolicySpec(**policy),  # type: ignore[arg-type]
    )


def small_layout(ttl: float = 10.0) -> BudgetLayout:
    """One shared pool P and tenant a's private pool, 100 each; tenants a and b."""
    return layout([shared(P, 100), private("tenant:a", 100)], ["a", "b"], lease_ttl_s=ttl)


def demand(tenant: str, cost: int, *pools: str, tier: str = "critical", decode: int = 0) -> Demand:
    return Demand(tenant=tenant, tier=tier, pools=pools, prefill=cost - decode, decode=decode)


async def in_flight(store: BudgetStore, pool: str) -> int:
    return (await store.snapshot()).pools[pool].in_flight


async def waiting(store: BudgetStore) -> int:
    return sum((await store.snapshot()).queue_depth.values())


async def wait_queued(store: BudgetStore, n: int) -> None:
    async def check() -> bool:
        return await waiting(store) == n

    await eventually(check)


async def assert_idle(store: BudgetStore) -> None:
    """Nothing leaked: every pool at zero, no lease, no ticket."""
    snap = await store.snapshot()
    assert {name: p.in_flight for name, p in snap.pools.items() if p.in_flight} == {}
    assert snap.leases == 0
    assert sum(snap.queue_depth.values()) == 0

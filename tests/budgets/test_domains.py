"""Several budget domains behind one store (budgets.domains): each request is granted in its backend
pool's domain, a tenant's budget holds per domain, leases find their way back by id, the snapshot
merges the domains and keeps each; on process-local stores and on real Redis (one server, two key
prefixes; and a three-primary Cluster with the domains on different shards)."""

from __future__ import annotations

import asyncio

import pytest

from budgets.domains import DEFAULT_DOMAIN, DomainStore, domain_layout, merge_snapshots, pool_owners
from budgets.memory import MemoryStore
from budgets.redis import RedisOptions, RedisStore
from budgets.types import BudgetLayout, BudgetStore, QueueTimeout
from tests.budgets.redis_fixtures import (
    FAST,
    prefixes_on_distinct_shards,
    session_cluster,
    session_redis,
    unique_prefix,
)
from tests.budgets.support import P, Q, assert_idle, demand, layout, private, shared

EU = "backend:eu"


def three_pools() -> BudgetLayout:
    """P and Q (default domain), EU (domain eu); tenant a's budget 100, class c's 80."""
    return layout(
        [shared(P, 100), shared(Q, 100), shared(EU, 100), private("tenant:a", 100), shared("class:c", 80)],
        ["a", "b"],
        lease_ttl_s=2.0,
    )


OWNER = pool_owners({"eu": ["eu"]})


def memory_domains(lay: BudgetLayout | None = None) -> DomainStore:
    lay = lay or three_pools()
    return DomainStore({d: MemoryStore(domain_layout(lay, d, OWNER)) for d in (DEFAULT_DOMAIN, "eu")}, OWNER)


def redis_domains(url: str, prefixes: dict[str, str] | None = None) -> DomainStore:
    lay = three_pools()
    prefixes = prefixes or {DEFAULT_DOMAIN: unique_prefix(), "eu": unique_prefix()}
    return DomainStore(
        {
            d: RedisStore(domain_layout(lay, d, OWNER), RedisOptions(url=url, key_prefix=prefixes[d], **FAST))  # type: ignore[arg-type]
            for d in (DEFAULT_DOMAIN, "eu")
        },
        OWNER,
    )


def test_a_domain_holds_its_backend_pools_and_every_tenant_and_class_pool() -> None:
    lay = three_pools()
    assert set(domain_layout(lay, DEFAULT_DOMAIN, OWNER).pools) == {P, Q, "tenant:a", "class:c"}
    eu = domain_layout(lay, "eu", OWNER)
    assert set(eu.pools) == {EU, "tenant:a", "class:c"}
    assert eu.pools["tenant:a"].capacity == 100 and eu.tiers == lay.tiers and eu.tenants == lay.tenants


def test_a_store_without_the_default_domain_or_with_an_unknown_one_is_refused() -> None:
    lay = three_pools()
    with pytest.raises(ValueError, match="'default' domain is required"):
        DomainStore({"eu": MemoryStore(lay)}, OWNER)
    with pytest.raises(ValueError, match="unknown domains: \\['us'\\]"):
        DomainStore({DEFAULT_DOMAIN: MemoryStore(lay)}, pool_owners({"us": ["us"]}))
    with pytest.raises(ValueError, match="cannot contain '/'"):
        DomainStore({DEFAULT_DOMAIN: MemoryStore(lay), "e/u": MemoryStore(lay)}, {})


async def _budgets_hold_per_domain(store: DomainStore) -> None:
    await store.start()
    try:
        # Tenant a's 100 in the default domain is full ...
        home = await store.acquire(demand("a", 100, "tenant:a", P), 1)
        with pytest.raises(QueueTimeout):
            await store.acquire(demand("a", 10, "tenant:a", Q), 0.05)
        # ... and its 100 in eu is its own: a domain never sees another's leases.
        away = await store.acquire(demand("a", 100, "tenant:a", EU), 1)
        assert home.id.startswith("default/") and away.id.startswith("eu/")
        snap = await store.snapshot()
        assert snap.pools[P].in_flight == 100 and snap.pools[EU].in_flight == 100
        assert snap.pools["tenant:a"].in_flight == 200 and snap.pools["tenant:a"].capacity == 200
        assert snap.leases == 2
        assert snap.domains["default"].pools["tenant:a"].in_flight == 100
        assert EU not in snap.domains["default"].pools and P not in snap.domains["eu"].pools
        # Each id goes back to the store that granted it; exactly once.
        assert await store.extend(away.id, 0) == 0
        await store.heartbeat([home.id, away.id, "nowhere/x", "no-domain"])
        assert await store.release(away.id, 0) is True
        assert await store.release(away.id, 0) is False
        assert await store.release("eu/" + home.id.partition("/")[2], 0) is False  # wrong domain
        assert await store.release("no-domain", 0) is False and await store.extend("x/y", 5) is None
        assert (await store.snapshot()).pools[EU].in_flight == 0
        # The default domain's waiter is served when its own release frees the tenant's budget.
        waiter = asyncio.ensure_future(store.acquire(demand("a", 10, "tenant:a", Q), 2))
        await asyncio.sleep(0.05)
        assert not waiter.done()
        assert await store.release(home.id, 0) is True
        await store.release((await waiter).id, 0)
        await assert_idle(store)
        for part in (await store.snapshot()).domains.values():
            assert {n: p.in_flight for n, p in part.pools.items() if p.in_flight} == {}
        assert await store.healthy()
    finally:
        await store.close()


async def test_budgets_hold_per_domain_in_memory() -> None:
    await _budgets_hold_per_domain(memory_domains())


async def test_budgets_hold_per_domain_on_one_redis_two_prefixes() -> None:
    await _budgets_hold_per_domain(redis_domains(session_redis().url))


async def test_domains_on_a_cluster_live_on_different_shards() -> None:
    cluster = session_cluster()
    first, second = prefixes_on_distinct_shards(cluster, 2)  # each domain on its own primary
    store = redis_domains(cluster.url, {DEFAULT_DOMAIN: first, "eu": second})
    await _budgets_hold_per_domain(store)
    where = store.describe()
    assert where["kind"] == "domains"
    domains = where["domains"]
    assert isinstance(domains, dict) and domains["eu"]["domain"] == second  # type: ignore[index]


async def test_a_layout_change_reaches_every_domain_split_by_owner() -> None:
    store = memory_domains()
    await store.start()
    try:
        bigger = layout(
            [shared(P, 100), shared(Q, 100), shared(EU, 300), private("tenant:a", 50)],
            ["a", "b"],
            lease_ttl_s=2.0,
        )
        await store.apply_layout(bigger)
        snap = await store.snapshot()
        assert snap.domains["eu"].pools[EU].capacity == 300
        assert snap.domains["default"].pools["tenant:a"].capacity == 50
        assert snap.domains["eu"].pools["tenant:a"].capacity == 50
        assert EU not in snap.domains["default"].pools
    finally:
        await store.close()


async def test_a_domain_that_fails_to_start_closes_the_ones_started() -> None:
    class Broken(MemoryStore):
        async def start(self) -> None:
            raise RuntimeError("no")

    lay = three_pools()
    first = MemoryStore(domain_layout(lay, DEFAULT_DOMAIN, OWNER))
    closed: list[BudgetStore] = []
    original = first.close

    async def close() -> None:
        closed.append(first)
        await original()

    first.close = close  # type: ignore[method-assign]
    store = DomainStore({DEFAULT_DOMAIN: first, "eu": Broken(domain_layout(lay, "eu", OWNER))}, OWNER)
    with pytest.raises(RuntimeError):
        await store.start()
    assert closed == [first]


def test_merge_sums_shared_names_and_keeps_each_part() -> None:
    lay = three_pools()
    a = asyncio.run(MemoryStore(domain_layout(lay, DEFAULT_DOMAIN, OWNER)).snapshot())
    b = asyncio.run(MemoryStore(domain_layout(lay, "eu", OWNER)).snapshot())
    merged = merge_snapshots({"default": a, "eu": b})
    assert merged.pools["class:c"].capacity == 160 and merged.pools[P].capacity == 100
    assert merged.queue_depth == {"critical": 0, "standard": 0, "batch": 0}
    assert set(merged.domains) == {"default", "eu"} and merged.domains["eu"] is b

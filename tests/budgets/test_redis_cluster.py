"""The Redis store on a real Redis Cluster (three primaries on loopback): domains spread over the
shards, each store talking to its slot's owner, and a domain's slot moved to another primary under
load without a grant past capacity. The store contract suite runs on the cluster too (its
``redis-cluster`` kind, tests/budgets/conftest.py)."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Iterator

import pytest

from budgets.redis import RedisOptions, RedisStore
from budgets.redis.cluster import ClusterSpec, migrate_slot, parse_cluster_url, slot_of
from budgets.redis.resp import Address
from budgets.types import QueueTimeout, StoreUnavailable
from loadtest.redis_server import RedisCluster
from tests.budgets.redis_fixtures import STEADY, unique_prefix
from tests.budgets.support import P, assert_idle, demand, eventually, in_flight, small_layout


@pytest.fixture(scope="module")
def cluster() -> Iterator[RedisCluster]:
    group = RedisCluster().start()
    try:
        yield group
    finally:
        group.stop()


def store_on(cluster: RedisCluster, prefix: str) -> RedisStore:
    return RedisStore(small_layout(ttl=2.0), RedisOptions(url=cluster.url, key_prefix=prefix, **STEADY))  # type: ignore[arg-type]


async def test_domains_spread_over_the_shards_each_store_on_its_slots_owner(cluster: RedisCluster) -> None:
    # Four domains on each shard (random prefixes would miss a shard now and then: 3 x (2/3)^12).
    by_node: dict[int, list[str]] = {n.port: [] for n in cluster.nodes}
    while any(len(found) < 4 for found in by_node.values()):
        prefix = unique_prefix()
        found = by_node[cluster.owner(slot_of("{tg:" + prefix + "}")).port]
        if len(found) < 4:
            found.append(prefix)
    prefixes = [p for found in by_node.values() for p in found]
    stores = [store_on(cluster, p) for p in prefixes]
    try:
        for store in stores:
            await store.start()
        leases = [await store.acquire(demand("a", 70, P, "tenant:a"), 1) for store in stores]
        for store in stores:
            assert await in_flight(store, P) == 70
            with pytest.raises(QueueTimeout):  # each domain's own capacity, on its own shard
                await store.acquire(demand("b", 40, P), 0.05)
        for store, lease in zip(stores, leases, strict=True):
            await store.release(lease.id, 0)
            await assert_idle(store)
    finally:
        for store in stores:
            await store.close()


@pytest.mark.parametrize("keys_per_migrate", [1, 10, 100_000])
async def test_a_domains_slot_moved_under_load_grants_nothing_past_capacity(
    cluster: RedisCluster, keys_per_migrate: int
) -> None:
    """Four clients keep acquiring 30 of P's 100 and holding it a moment; the slot moves to another
    primary meanwhile, a key per MIGRATE, ten (redis-cli --cluster reshard's pipeline) or all at once.
    What the clients hold, counted here, never passes 100; they are served again on the new owner;
    nothing is left afterwards."""
    prefix = unique_prefix()
    slot = slot_of("{tg:" + prefix + "}")
    store = store_on(cluster, prefix)
    await store.start()
    held = 0
    most = 0
    served_after = 0
    moved = asyncio.Event()
    stop = asyncio.Event()

    async def client(n: int) -> None:
        nonlocal held, most, served_after
        rng = random.Random(n)
        while not stop.is_set():
            try:
                lease = await store.acquire(demand("b", 30, P), 0.3)
            except (StoreUnavailable, QueueTimeout):
                await asyncio.sleep(0.01)
                continue
            held += 30
            most = max(most, held)
            served_after += moved.is_set()
            await asyncio.sleep(rng.uniform(0.001, 0.01))
            held -= 30
            await store.release(lease.id, 0)

    clients = [asyncio.create_task(client(n)) for n in range(4)]
    try:
        await asyncio.sleep(0.5)
        source = cluster.owner(slot)
        target = next(n for n in cluster.nodes if n is not source)
        described = store.describe()
        assert {k: described[k] for k in ("kind", "domain", "topology", "slot", "node", "degraded")} == {
            "kind": "redis", "domain": prefix, "topology": "cluster", "slot": slot,
            "node": f"127.0.0.1:{source.port}", "degraded": False,
        }  # fmt: skip
        keys = await migrate_slot(
            Address("127.0.0.1", source.port), Address("127.0.0.1", target.port), slot, keys_per_migrate
        )
        moved.set()
        assert keys > 0 and cluster.owner(slot) is target
        await eventually(lambda: served_after > 20, timeout_s=10, message="not served after the move")
        assert store.describe()["node"] == f"127.0.0.1:{target.port}"  # what /stats shows the operator
    finally:
        stop.set()
        await asyncio.gather(*clients)
    try:
        assert most <= 100, most
        resolver = store._transport.resolver
        assert resolver is not None and resolver.resolved >= 2  # the old owner, then the new one
        await assert_idle(store)
    finally:
        await store.close()


def test_a_cluster_url_names_its_seed_nodes() -> None:
    assert parse_cluster_url("redis+cluster://:pw@10.0.0.1:7000,10.0.0.2:7001") == ClusterSpec(
        (("10.0.0.1", 7000), ("10.0.0.2", 7001)), None, "pw"
    )
    for bad, says in (
        ("redis+cluster://n1/", "expected host:port"),
        ("redis+cluster://n1:7000/2", "only database 0"),
    ):
        with pytest.raises(ValueError, match=says):
            parse_cluster_url(bad)

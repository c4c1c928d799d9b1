"""The store's state as a StoreSnapshot: read from Redis's hashes, or, while Redis is down and there
is no fallback, from the leases this replica holds."""

from __future__ import annotations

from budgets.redis.held import HeldLeases
from budgets.redis.keys import KeyLayout
from budgets.redis.transport import Transport
from budgets.types import BudgetLayout, PoolState, StoreSnapshot


async def read_snapshot(transport: Transport, keys: KeyLayout, layout: BudgetLayout) -> StoreSnapshot:
    """One transaction over the domain's counters (raises Down). ``layout`` is this replica's: it
    stands in for the one Redis lost, if it did."""
    t = keys.tag
    async with transport.client.pipeline(transaction=True) as pipe:
        for name in ("spec", "used", "tierq", "twait"):
            pipe.hgetall(f"{t}:{name}")
        pipe.zrange(f"{t}:vtc", 0, -1, withscores=True)
        pipe.hlen(f"{t}:leases")
        spec, used, tierq, twait, vtc, leases = await transport.call(pipe.execute())
    specs = {k[2:]: v for k, v in spec.items() if k.startswith("p:")}
    tiers = [k[2:] for k in spec if k.startswith("t:")]
    tenants = [k[2:] for k in spec if k.startswith("n:")]
    if not spec:  # Redis lost the layout: report this replica's view of it
        specs = {n: f"{p.capacity}|{int(p.shared)}" for n, p in layout.pools.items()}
        tiers, tenants = list(layout.tiers), list(layout.tenants)
    pools: dict[str, PoolState] = {}
    for name, packed in specs.items():
        cap, shared = packed.split("|")
        pools[name] = PoolState(name, int(cap), int(used.get(name, 0)), shared == "1")
    for name, n in used.items():
        if name not in pools:
            pools[name] = PoolState(name, 0, int(n), True)
    queue_depth = dict.fromkeys(tiers, 0)
    queue_depth.update({k: int(v) for k, v in tierq.items()})
    tenant_depth = dict.fromkeys(tenants, 0)
    tenant_depth.update({k: int(v) for k, v in twait.items()})
    return StoreSnapshot(
        pools=pools,
        queue_depth=queue_depth,
        tenant_queue_depth=tenant_depth,
        virtual_service={k: float(v) for k, v in vtc},
        leases=int(leases),
    )


def held_snapshot(held: HeldLeases, layout: BudgetLayout) -> StoreSnapshot:
    """This replica's own view (its leases, full capacities): what a closed-mode store reports
    while Redis is down, never an error."""
    used: dict[str, int] = {}
    for entry in held.values():
        for name in entry.lease.demand.pools:
            used[name] = used.get(name, 0) + entry.lease.demand.cost
    pools = {n: PoolState(n, p.capacity, used.get(n, 0), p.shared) for n, p in layout.pools.items()}
    return StoreSnapshot(
        pools=pools,
        queue_depth=dict.fromkeys(layout.tiers, 0),
        tenant_queue_depth=dict.fromkeys(layout.tenants, 0),
        virtual_service={},
        leases=len(held),
    )

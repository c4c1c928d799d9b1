"""One gateway, several budget domains: a store that routes each request to its domain's store.

A *budget domain* is one store (one Redis ``key_prefix``, i.e. one hash tag and so one Redis
primary, or one process-local store): its pools, its queue and its fair-share counters. A grant
takes from all of a request's pools atomically, so all of them must live in one domain; a fleet
that outgrows one Redis primary, or that serves regions which never share a request, splits by
**backend pool**: every domain owns some backend pools, and the request's backend pool names its
domain.

What each domain holds:

* its own backend pools (a backend pool belongs to exactly one domain; one no domain names belongs
  to the default domain);
* every tenant's pool and every class pool, each at its configured size: a tenant's
  ``budget_tokens`` and a class's ``budget_tokens`` bound what is in flight *per domain* (a tenant
  with 64k may have 64k in flight in each region), since a domain cannot see another's;
* every tier and tenant, and the same fairness policy; fair share is kept per domain.

Lease ids carry their domain (``<domain>/<id>``), so releases, extensions and heartbeats go to the
store that granted them without any table to keep.

``snapshot`` merges the domains (backend pools as they are; a tenant's or class's pools summed, so
a tenant's capacity reads as what it may hold fleet-wide) and keeps each domain's own snapshot in
``StoreSnapshot.domains`` for the per-domain views of ``/stats`` and the admin API.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence

from budgets.types import (
    BudgetLayout,
    BudgetStore,
    Demand,
    Lease,
    PoolState,
    StoreSnapshot,
    backend_pool,
)

DEFAULT_DOMAIN = "default"


class DomainUnavailable(RuntimeError):
    """A domain's store failed to answer a snapshot (the message names the domain)."""


def domain_layout(layout: BudgetLayout, domain: str, owner: Mapping[str, str]) -> BudgetLayout:
    """What ``domain`` holds of ``layout``: its backend pools, every other pool, every tier and
    tenant. ``owner`` maps store pool names (``backend:<pool>``) to their domain; a backend pool
    it does not name is the default domain's."""
    pools = {
        name: spec
        for name, spec in layout.pools.items()
        if not name.startswith("backend:") or owner.get(name, DEFAULT_DOMAIN) == domain
    }
    return BudgetLayout(pools=pools, tiers=layout.tiers, tenants=layout.tenants, policy=layout.policy)


def pool_owners(domains: Mapping[str, Sequence[str]]) -> dict[str, str]:
    """Config pool names per domain -> store pool name -> domain."""
    return {backend_pool(pool): name for name, pools in domains.items() for pool in pools}


def merge_snapshots(parts: Mapping[str, StoreSnapshot]) -> StoreSnapshot:
    """One fleet-wide view: pools of the same name (a tenant's, a class's) summed across domains,
    queue depths, fair-share counters and lease counts summed; each part kept under its domain."""
    pools: dict[str, PoolState] = {}
    queues: dict[str, int] = {}
    tenant_queues: dict[str, int] = {}
    service: dict[str, float] = {}
    leases = 0
    for snap in parts.values():
        for name, st in snap.pools.items():
            had = pools.get(name)
            pools[name] = (
                st
                if had is None
                else PoolState(name, had.capacity + st.capacity, had.in_flight + st.in_flight, had.shared)
            )
        for tier, n in snap.queue_depth.items():
            queues[tier] = queues.get(tier, 0) + n
        for tenant, n in snap.tenant_queue_depth.items():
            tenant_queues[tenant] = tenant_queues.get(tenant, 0) + n
        for tenant, v in snap.virtual_service.items():
            service[tenant] = service.get(tenant, 0.0) + v
        leases += snap.leases
    return StoreSnapshot(
        pools=pools,
        queue_depth=queues,
        tenant_queue_depth=tenant_queues,
        virtual_service=service,
        leases=leases,
        domains=dict(parts),
    )


class DomainStore:
    """A :class:`BudgetStore` over one store per domain (each built for its part of the layout
    with :func:`domain_layout`). Every contract of the protocol holds per domain; a request's pools
    are always in one."""

    def __init__(self, stores: Mapping[str, BudgetStore], owner: Mapping[str, str]) -> None:
        if DEFAULT_DOMAIN not in stores:
            raise ValueError(f"a {DEFAULT_DOMAIN!r} domain is required: pools no domain names live there")
        unknown = sorted({d for d in owner.values() if d not in stores})
        if unknown:
            raise ValueError(f"pools assigned to unknown domains: {unknown}")
        if any("/" in name for name in stores):
            raise ValueError("domain names cannot contain '/' (lease ids carry them)")
        self.stores = dict(stores)
        self._owner = dict(owner)
        self._default = self.stores[DEFAULT_DOMAIN]

    def domain_of(self, demand: Demand) -> str:
        """The domain of the demand's backend pool (the default domain when it names none)."""
        owner = self._owner
        for pool in demand.pools:
            d = owner.get(pool)
            if d is not None:
                return d
        return DEFAULT_DOMAIN

    def _split(self, lease_id: str) -> tuple[BudgetStore | None, str]:
        domain, sep, inner = lease_id.partition("/")
        return (self.stores.get(domain), inner) if sep else (None, lease_id)

    async def start(self) -> None:
        started: list[BudgetStore] = []
        try:
            for store in self.stores.values():
                await store.start()
                started.append(store)
        except BaseException:
            for store in started:
                await store.close()
            raise

    async def close(self) -> None:
        await asyncio.gather(*(s.close() for s in self.stores.values()))

    async def apply_layout(self, layout: BudgetLayout) -> None:
        await asyncio.gather(
            *(s.apply_layout(domain_layout(layout, d, self._owner)) for d, s in self.stores.items())
        )

    async def acquire(self, demand: Demand, max_wait_s: float) -> Lease:
        domain = self.domain_of(demand)
        lease = await self.stores[domain].acquire(demand, max_wait_s)
        return Lease(f"{domain}/{lease.id}", lease.demand, lease.granted_at, lease.queued_s)

    async def release(self, lease_id: str, actual_decode: int | None = None) -> bool:
        store, inner = self._split(lease_id)
        return False if store is None else await store.release(inner, actual_decode)

    async def extend(self, lease_id: str, tokens: int) -> int | None:
        store, inner = self._split(lease_id)
        return None if store is None else await store.extend(inner, tokens)

    async def heartbeat(self, lease_ids: Sequence[str]) -> None:
        by_domain: dict[str, list[str]] = {}
        for lease_id in lease_ids:
            domain, sep, inner = lease_id.partition("/")
            if sep and domain in self.stores:
                by_domain.setdefault(domain, []).append(inner)
        await asyncio.gather(*(self.stores[d].heartbeat(ids) for d, ids in by_domain.items()))

    async def reap_expired(self) -> int:
        return sum(await asyncio.gather(*(s.reap_expired() for s in self.stores.values())))

    async def snapshot(self) -> StoreSnapshot:
        names = list(self.stores)
        snaps = await asyncio.gather(*(self._snapshot(d) for d in names))
        return merge_snapshots(dict(zip(names, snaps, strict=True)))

    async def _snapshot(self, domain: str) -> StoreSnapshot:
        try:
            return await self.stores[domain].snapshot()
        except Exception as exc:  # say which domain's store is not answering
            raise DomainUnavailable(f"budget domain {domain!r}: {type(exc).__name__}: {exc}") from exc

    async def healthy(self) -> bool:
        """Ready only when every domain is: a request of any pool may arrive at this replica."""
        return all(await asyncio.gather(*(s.healthy() for s in self.stores.values())))

    def describe(self) -> dict[str, object]:
        return {
            "kind": "domains",
            "domains": {d: s.describe() for d, s in self.stores.items()},
        }


__all__ = [
    "DEFAULT_DOMAIN",
    "DomainStore",
    "DomainUnavailable",
    "domain_layout",
    "merge_snapshots",
    "pool_owners",
]

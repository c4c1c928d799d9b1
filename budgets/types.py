"""The budget-store contract: data that crosses the seam and the protocol both stores implement.

A *pool* is a named token budget. A request's *demand* names every pool it must hold tokens
in (its tenant's pool, the backend pool its class routes to, optionally a class pool) and is
granted all-or-nothing. A granted demand is a *lease*; it is held until released exactly once,
or until it expires without heartbeats and is reaped.

Pool names are namespaced by kind so a tenant and a backend pool can share a name:
``tenant:<name>``, ``backend:<name>``, ``class:<name>`` (see :func:`tenant_pool` etc.).
Tier ceilings apply to shared pools only; a tenant's own pool is private to it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal, Protocol, runtime_checkable

QueueOrder = Literal["fifo", "shortest_first"]
QUEUE_ORDERS: tuple[QueueOrder, ...] = ("fifo", "shortest_first")


def tenant_pool(tenant: str) -> str:
    return f"tenant:{tenant}"


def backend_pool(pool: str) -> str:
    return f"backend:{pool}"


def class_pool(klass: str) -> str:
    return f"class:{klass}"


@dataclass(frozen=True, slots=True)
class PoolSpec:
    name: str
    capacity: int
    # Shared pools (backend and class pools) enforce tier ceilings and backfill/starvation rules;
    # a tenant's private pool does not, and a ticket blocked only by its private pool never
    # holds capacity elsewhere.
    shared: bool = True


@dataclass(frozen=True, slots=True)
class TierSpec:
    name: str
    rank: int  # lower rank is served first
    ceiling: float = 1.0  # share of a shared pool's capacity this tier may fill, 0 < ceiling <= 1
    max_queue_wait_s: float = 60.0


@dataclass(frozen=True, slots=True)
class TenantSpec:
    name: str
    weight: float = 1.0  # fair-share weight (service is divided by it)
    max_queue_len: int = 64  # waiting tickets per tenant before 429


@dataclass(frozen=True, slots=True)
class PolicySpec:
    # Virtual Token Counter weights (Sheng et al., OSDI 2024): service = wp*prefill + wd*decode.
    prefill_weight: float = 1.0
    decode_weight: float = 2.0
    # How long a ticket blocked on a shared pool may be passed by smaller ones (backfill) before
    # capacity is held for it so it cannot starve.
    backfill_limit_s: float = 2.0
    lease_ttl_s: float = 10.0
    # Bound on tickets examined per grant pass (keeps one pass O(limit), also in Lua).
    max_scan: int = 256
    # A tenant with no waiting ticket and no live lease for this long is forgotten (its counter
    # deleted; it comes back as a newcomer): per-tenant state stays bounded by recent tenants.
    idle_forget_s: float = 3600.0
    # Order of the tickets inside one (tier, tenant) queue, never across tenants (policy docstring):
    # "fifo" (arrival), or "shortest_first": by ``enqueued_at + min(decode * defer_s_per_token,
    # max_defer_s)``, so a ticket is only ever passed by its own tenant's tickets enqueued less
    # than ``max_defer_s`` after it.
    tenant_queue_order: QueueOrder = "fifo"
    max_defer_s: float = 10.0
    defer_s_per_token: float = 0.01


@dataclass(frozen=True, slots=True)
class BudgetLayout:
    """Everything a store needs to know about pools, tiers and tenants. Replaced as a whole."""

    pools: Mapping[str, PoolSpec]
    tiers: Mapping[str, TierSpec]
    tenants: Mapping[str, TenantSpec]
    policy: PolicySpec = field(default_factory=PolicySpec)


@dataclass(frozen=True, slots=True)
class Demand:
    """What one request holds: ``cost`` (prompt + reserved output) in every pool it names but its
    tenant's own, ``tenant_pool(tenant)``, which holds ``private_cost``: the prompt + the most
    output the request may produce (``decode_limit``) when that is more than the reservation.

    A request that reserves less than it may produce (learned reservations) can run past its
    reservation; what it may run to is held against its tenant's budget, so a tenant whose
    estimate was trained low never has more in flight than its budget, and overdraws a shared pool
    by at most that. (The tenant's pool is private in every layout the gateway builds.)"""

    tenant: str
    tier: str
    pools: tuple[str, ...]  # every pool to acquire from, all or nothing
    prefill: int
    decode: int
    decode_limit: int = 0  # the most output it may produce; <= decode: no more than reserved
    # prefill + decode, stored: the grant path reads it about ten times per grant.
    cost: int = field(init=False, repr=False, compare=False)
    private_cost: int = field(init=False, repr=False, compare=False)  # prefill + max(decode, limit)

    def __post_init__(self) -> None:
        cost = self.prefill + self.decode
        object.__setattr__(self, "cost", cost)
        object.__setattr__(self, "private_cost", max(cost, self.prefill + self.decode_limit))

    def held_in(self, pool: str) -> int:
        """Tokens this demand holds in ``pool``: ``private_cost`` in its tenant's own pool, ``cost``
        in every other. (Decided by the name, not the layout: what a lease gave back must be what it
        took, whatever layout changes came in between.)"""
        if self.private_cost != self.cost and pool == tenant_pool(self.tenant):
            return self.private_cost
        return self.cost


@dataclass(frozen=True, slots=True)
class Lease:
    id: str
    demand: Demand
    granted_at: float  # store clock (seconds)
    queued_s: float  # time spent waiting as a ticket


@dataclass(frozen=True, slots=True)
class PoolState:
    name: str
    capacity: int
    in_flight: int
    shared: bool


@dataclass(frozen=True, slots=True)
class StoreSnapshot:
    pools: Mapping[str, PoolState]
    queue_depth: Mapping[str, int]  # tier -> waiting tickets
    tenant_queue_depth: Mapping[str, int]
    virtual_service: Mapping[str, float]  # tenant -> VTC counter
    leases: int
    # Per budget domain, when the store spans several (budgets.domains); empty for one domain.
    domains: Mapping[str, StoreSnapshot] = field(default_factory=dict)


# ---- errors: each maps to one HTTP status in the gateway ----


class AdmissionError(Exception):
    """Base of every refusal; ``status`` is the HTTP status the gateway answers with."""

    status = 429

    def __init__(self, message: str, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.retry_after_s = retry_after_s


class NeverFits(AdmissionError):
    """The cost exceeds what a pool can ever grant (capacity, or the tier's ceiling of it)."""

    status = 413

    def __init__(self, message: str, pool: str, cost: int, limit: int) -> None:
        super().__init__(message)
        self.pool = pool
        self.cost = cost
        self.limit = limit


class QueueFull(AdmissionError):
    status = 429


class QueueTimeout(AdmissionError):
    status = 429


class UnknownTenantOrTier(AdmissionError):
    status = 400


class StoreUnavailable(AdmissionError):
    status = 503


@runtime_checkable
class BudgetStore(Protocol):
    """Cluster-wide (redis) or process-local (memory) token pools with one wait queue.

    Contract (both stores pass the same suite in tests/budgets):
    - ``acquire`` grants the demand from every named pool atomically, now or after waiting in
      rank order (tier, then fair share, then arrival). It raises NeverFits at once when the cost
      can never fit, QueueFull when the tenant's queue is full, QueueTimeout after
      ``max_wait_s``. If the awaiting task is cancelled the ticket is withdrawn, and a grant that
      raced the cancellation is released: nothing leaks.
    - ``release`` is idempotent by lease id: True the first time, False afterwards.
      ``actual_decode`` (the backend's completion tokens, None when unknown) is the output
      charged to the tenant's fair-share counter, clamped to ``[0, reserved decode]``; unknown
      or not a whole number charges the whole reservation, as does reaping (budgets/policy.py).
    - ``heartbeat`` extends live leases; leases not renewed within ``lease_ttl_s`` are reaped
      (by ``reap_expired`` and by the store's own background task) and their tokens returned.
    - ``extend`` grows a live lease's output reservation by ``tokens`` in every pool it holds
      (its tenant's pool only past ``decode_limit``, which that pool holds already), at
      once and never queued (a stream that outgrew its reservation is already running): the
      overdraft is returned (how far its fullest pool is now above capacity; 0 when it fit), and
      an overdrawn pool grants nothing new until it is back under its limit. None when the lease
      is not live here (released, reaped, or the store cannot reach its state right now); the
      release then returns the grown cost.
    """

    async def start(self) -> None: ...

    async def close(self) -> None: ...

    async def apply_layout(self, layout: BudgetLayout) -> None: ...

    async def acquire(self, demand: Demand, max_wait_s: float) -> Lease: ...

    async def release(self, lease_id: str, actual_decode: int | None = None) -> bool: ...

    async def extend(self, lease_id: str, tokens: int) -> int | None: ...

    async def heartbeat(self, lease_ids: Sequence[str]) -> None: ...

    async def reap_expired(self) -> int: ...

    async def snapshot(self) -> StoreSnapshot: ...

    async def healthy(self) -> bool: ...

    def describe(self) -> Mapping[str, object]:
        """Where the pools live, for operators (/stats): the kind, and for Redis its domain, its
        topology and the node it talks to now."""
        ...

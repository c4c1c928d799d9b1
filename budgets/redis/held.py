"""A lease this replica holds in Redis (granted there, or adopted from the fail-open fallback)."""

from __future__ import annotations

from dataclasses import dataclass

from budgets.types import Lease


@dataclass(slots=True)
class Held:
    """``safe_until`` (event-loop time): until then Redis provably still has the lease (its expiry
    was set at or after a moment we know, plus the TTL), so it cannot have been reaped and a
    release may be acknowledged before Redis applies it.
    """

    lease: Lease
    safe_until: float = 0.0


# lease id -> Held: one table, shared by the store (grants, releases, heartbeats) and the failover
# (a recovery adopts the fallback's leases into it). The fallback's own leases are not in it.
HeldLeases = dict[str, Held]

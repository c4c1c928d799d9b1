"""How many of a gateway process's client connections each tenant holds (``limits.max_connections_per_tenant``).

``limits.max_connections`` bounds a process's open connections, first come, first served: past it
every new connection is a 503, whoever opens it. One tenant keeping many connections alive — each
sending a tiny, cheap request now and then, well within its token budget — could hold them all, and
every other tenant's next connection was refused. Tokens do not bound connections; this does.

A connection belongs to the tenant of the latest request on it (an API server that multiplexes its
customers' keys over one pool of connections moves them between tenants as it goes). A request
that would make its tenant hold more than ``most`` connections is a 429 ``too_many_connections``
answered with ``connection: close``, so the slot it came on is given back at once. A connection is
released when it closes (`gateway.process.signals.Connection.closed`, called by the gateway's protocol).
Not in open mode, where one tenant is everyone.
"""

from __future__ import annotations

from gateway.process.signals import Connection
from gateway.request.errors import ApiError


class TenantConnections:
    """Open client connections per tenant, bounded by ``most`` each (0: no bound)."""

    def __init__(self, most: int) -> None:
        self.most = most
        self.by_tenant: dict[str, int] = {}

    def claim(self, conn: Connection, tenant: str) -> None:
        """Mark ``conn`` as ``tenant``'s; ApiError 429 (closing it) when that is one too many."""
        owner = conn.owner
        if owner == tenant or conn.gone:  # (a client gone before its request got here holds nothing)
            return
        held = self.by_tenant.get(tenant, 0)
        if self.most and held >= self.most:
            raise ApiError(
                429,
                f"This API key's tenant has {held:,} connections open to this gateway process, its most "
                "(limits.max_connections_per_tenant): send more requests on each (HTTP keep-alive) "
                "or close idle ones",
                code="too_many_connections",
                retry_after_s=1.0,
                close=True,
            )
        if owner is not None:
            self._drop(owner)
        conn.owner = tenant
        conn.on_close = self._closed
        self.by_tenant[tenant] = held + 1

    def _closed(self, conn: Connection) -> None:
        if conn.owner is not None:
            self._drop(conn.owner)
            conn.owner = None

    def _drop(self, tenant: str) -> None:
        left = self.by_tenant[tenant] - 1
        if left:
            self.by_tenant[tenant] = left
        else:
            del self.by_tenant[tenant]

    @property
    def total(self) -> int:
        return sum(self.by_tenant.values())

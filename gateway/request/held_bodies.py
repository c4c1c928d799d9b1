"""Request bodies a gateway process holds in memory at once, per tenant and in all.

A request's body is read whole before it is priced, and held until its request ends (queued, then
forwarded). The budget bounds tokens, not bytes: an inline image of 4 MB can be priced at a few
hundred tokens, and a body still being read is priced at nothing. So a tenant dripping hundreds of
4 MB uploads, or queueing cheap ones, held gigabytes in the process, which a container's memory
limit (1 GiB in deploy/k8s) turns into an out-of-memory kill of every tenant's requests. Each
request takes its body's bytes here before reading it (its Content-Length, or ``max_body_bytes``
when it is chunked, trimmed to the real size once read) and gives them back when it ends. Beyond
``max_per_tenant`` the tenant's request is a 429; beyond ``most`` anyone's is a 503.
"""

from __future__ import annotations

from gateway.request.errors import ApiError


class HeldBodies:
    """Bytes of request bodies held, per tenant; ``take`` / ``resize`` / ``give_back`` (0: no bound)."""

    def __init__(self, most: int, most_per_tenant: int) -> None:
        self.most = most
        self.most_per_tenant = most_per_tenant
        self.total = 0
        self.by_tenant: dict[str, int] = {}

    def take(self, tenant: str, n: int, *, open_mode: bool = False) -> None:
        """Hold ``n`` bytes for ``tenant``, or raise the 429 / 503. ``open_mode``: the one open
        tenant is everyone, so only the process's bound applies."""
        held = self.by_tenant.get(tenant, 0)
        if self.most_per_tenant and not open_mode and held + n > self.most_per_tenant:
            raise ApiError(
                429,
                f"This API key's requests already hold {held:,} bytes of request bodies in this gateway "
                f"process; with this one's {n:,} that is above the limit of {self.most_per_tenant:,} "
                "(limits.max_held_body_bytes_per_tenant): wait for some to finish",
                code="too_many_body_bytes",
                retry_after_s=1.0,
            )
        if self.most and self.total + n > self.most:
            raise ApiError(
                503,
                "The gateway holds as many request bodies as it may; retry shortly "
                "(limits.max_held_body_bytes)",
                code="overloaded",
                retry_after_s=1.0,
            )
        self.by_tenant[tenant] = held + n
        self.total += n

    def resize(self, tenant: str, old: int, new: int) -> None:
        """What a request holds, once its body's real size is known (never above what it took)."""
        self.give_back(tenant, old - new)

    def give_back(self, tenant: str, n: int) -> None:
        if n <= 0:
            return
        left = self.by_tenant.get(tenant, 0) - n
        if left > 0:
            self.by_tenant[tenant] = left
        else:
            self.by_tenant.pop(tenant, None)
        self.total -= n

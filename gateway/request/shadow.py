"""Shadow mode for the in-flight limits: a tenant's ``budget_tokens`` or a tier's ``ceiling`` with
``budget_enforce: false`` / ``ceiling_enforce: false`` never holds a request back, and every request
it *would* have held back is counted, logged and exported (docs/quotas.md, "Shadow mode").

The pools do not hold such a limit at all (``gateway.config.layout`` gives the tenant's pool the
backends' capacity and the tier a ceiling of 1.0), so the store's grant path does not change. What
the limit would hold is watched beside it, cluster-wide, in the quota ledger: a running request
holds its tokens in a *gauge* per limit (a reservation never enforced, given back with nothing used
when the request ends; heartbeated with it, expired with a crashed gateway). A request whose gauge
is over its limit once its tokens are in was one the limit would have kept waiting in the queue.

- A budget in shadow mode: the gauge ``inflight/tenant:<t>`` holds each running request of the
  tenant at its prompt + the most output it may produce (what the pool would hold), limit
  ``budget_tokens``.
- A ceiling in shadow mode: the gauge ``inflight/<pool>`` holds every running request on a shared
  pool (whatever its tier: the ceiling bounds the pool's total), and a request of the tier is over
  when the pool's gauge is past ``floor(ceiling * capacity)``.

The gauges are taken after the grant, in their own store step: two requests granted at the same
instant may each see the other (or not), so a count is exact to within the requests racing it. A
lease that grows past its reservation (a stream outgrowing it) is watched at its size at admission.
A gateway that dies leaves its gauges to expire after the lease TTL as used in their bucket, which
is forgotten two hours later (a gauge counts the last two hours' buckets: a request running longer
than an hour drops out of its gauge early).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from budgets.quota import MICRO, Charge
from budgets.types import BudgetLayout, tenant_pool
from gateway.config.schema import TenantConfig, TierConfig
from gateway.request.quotas import QuotaGate

log = logging.getLogger("tokengate.shadow")

_BUCKET_S = 3600
_KEEP_S = 3 * _BUCKET_S
_UNBOUNDED = 2**52  # a gauge's limit for the requests no shadow limit watches (exact in Lua too)


@dataclass(frozen=True, slots=True)
class ShadowLimit:
    kind: str  # "budget" | "ceiling"
    name: str  # the tenant; for a ceiling "<tier>/<pool>"
    limit: int


@dataclass(frozen=True, slots=True)
class ShadowHold:
    rid: str


class ShadowLimits:
    """The in-flight limits in shadow mode, bound to each configuration."""

    def __init__(
        self,
        gate: QuotaGate,
        *,
        wall: Callable[[], float] = time.time,
        on_over: Callable[[str, str], None] | None = None,  # (kind, name): metrics
    ) -> None:
        self.gate = gate
        self._wall = wall
        self._on_over = on_over
        self._budgets: dict[str, int] = {}  # tenant -> budget in shadow mode
        self._ceilings: dict[str, float] = {}  # tier -> ceiling in shadow mode
        self._shared: dict[str, int] = {}  # shared pool -> capacity
        self.counts: dict[tuple[str, str], int] = {}  # (kind, name) -> requests it would have held back
        self.limits: list[ShadowLimit] = []
        self._logged: dict[tuple[str, str], float] = {}  # limit -> when last logged

    def bind(
        self, tenants: Sequence[TenantConfig], tiers: Sequence[TierConfig], layout: BudgetLayout
    ) -> None:
        self._budgets = {
            t.name: t.budget_tokens for t in tenants if not t.budget_enforce and t.budget_tokens is not None
        }
        self._ceilings = {t.name: t.ceiling for t in tiers if not t.ceiling_enforce}
        self._shared = {p.name: p.capacity for p in layout.pools.values() if p.shared}
        limits = [ShadowLimit("budget", t, b) for t, b in self._budgets.items()]
        for tier, ceiling in self._ceilings.items():
            limits += [
                ShadowLimit("ceiling", f"{tier}/{p}", math.floor(ceiling * c))
                for p, c in self._shared.items()
            ]
        self.limits = limits

    @property
    def configured(self) -> bool:
        return bool(self._budgets or self._ceilings)

    def charges(
        self, tenant: str, tier: str, pools: Sequence[str], cost: int, private_cost: int
    ) -> tuple[list[Charge], list[ShadowLimit | None]]:
        """What a running request holds in the gauges, and the shadow limit each one checks (None:
        the request only counts there)."""
        now = self._wall()
        bucket = int(now // _BUCKET_S) * _BUCKET_S
        oldest = bucket - _BUCKET_S

        def gauge(key: str, limit: int, amount: int) -> Charge:
            return Charge(f"inflight/{key}", limit, amount, bucket, oldest, False, _KEEP_S)

        charges: list[Charge] = []
        watched: list[ShadowLimit | None] = []
        budget = self._budgets.get(tenant)
        if budget is not None:
            charges.append(gauge(tenant_pool(tenant), budget, private_cost))
            watched.append(ShadowLimit("budget", tenant, budget))
        if self._ceilings:
            ceiling = self._ceilings.get(tier)
            for p in pools:
                capacity = self._shared.get(p)
                if capacity is None:
                    continue
                if ceiling is None:
                    charges.append(gauge(p, _UNBOUNDED, cost))
                    watched.append(None)
                else:
                    limit = math.floor(ceiling * capacity)
                    charges.append(gauge(p, limit, cost))
                    watched.append(ShadowLimit("ceiling", f"{tier}/{p}", limit))
        return charges, watched

    async def hold(
        self, tenant: str, tier: str, pools: Sequence[str], cost: int, private_cost: int
    ) -> ShadowHold | None:
        """Watch a request that was just granted; None when no shadow limit sees it. Never raises
        for the store: a shadow limit must never fail a request."""
        charges, watched = self.charges(tenant, tier, pools, cost, private_cost)
        if not charges:
            return None
        try:
            rid, outcome = await self.gate.hold(charges)
        except Exception as exc:
            log.warning("shadow limits not watched for a request of %s: %s", tenant, exc)
            return None
        for i in outcome.over:
            limit = watched[i]
            if limit is not None:
                self._over(limit, outcome.used[i])
        return ShadowHold(rid)

    async def release(self, hold: ShadowHold) -> None:
        try:
            await self.gate.drop(hold.rid)
        except Exception as exc:  # left to expire in the store
            log.warning("shadow gauge %s not given back: %s", hold.rid, exc)

    def _over(self, limit: ShadowLimit, held: int) -> None:
        key = (limit.kind, limit.name)
        self.counts[key] = self.counts.get(key, 0) + 1
        if self._on_over is not None:
            self._on_over(limit.kind, limit.name)
        now = self._wall()
        if now - self._logged.get(key, -math.inf) < 60.0:  # counted every time, logged once a minute
            return
        self._logged[key] = now
        what = (
            f"tenant {limit.name}'s budget_tokens" if limit.kind == "budget" else _ceiling_words(limit.name)
        )
        log.warning(
            "shadow limit: %s (%d tokens) would have held a request back (%d tokens in flight with it); "
            "it is not enforced, so the request ran (logged once a minute, counted in "
            "tokengate_shadow_refusals_total)",
            what,
            limit.limit,
            held,
        )

    def view(self) -> list[dict[str, object]]:
        """Every in-flight limit in shadow mode and what it would have held back (this replica)."""
        return [
            {
                "kind": s.kind,
                "name": s.name,
                "unit": "tokens",
                "limit": s.limit,
                "would_refuse": self.counts.get((s.kind, s.name), 0),
            }
            for s in self.limits
        ]


def _ceiling_words(name: str) -> str:
    tier, _, pool = name.partition("/")
    return f"tier {tier}'s ceiling of pool {pool}"


def shadow_view(limits: ShadowLimits, tenants: Sequence[TenantConfig]) -> list[dict[str, object]]:
    """Every limit in shadow mode, quotas included, with what it would have refused here."""
    out = limits.view()
    gate = limits.gate
    for t in tenants:
        for q in t.quotas:
            if not q.enforce:
                count = gate.shadow_counts.get((t.name, q.name), 0)
                limit = q.limit / MICRO if q.unit == "cost" else q.limit
                out.append(
                    {
                        "kind": "quota",
                        "name": f"{t.name}/{q.name}",
                        "unit": q.unit,
                        "limit": limit,
                        "would_refuse": count,
                    }
                )
    return out

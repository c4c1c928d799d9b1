"""What every tenant's quotas hold now, read from the quota ledger every few seconds: the rows of
``/stats`` (``limits.quotas``), the dashboard's quota panel and ``tokengate_quota_*`` gauges.

One ledger read per interval for all quotas (not one per scrape or per page): the gauges are at
most ``interval_s`` old. A ``per: key`` quota is read by the admin API per key
(``GET /admin/v1/tenants/{name}/quotas``); here it is left out, so that the metrics' labels stay
bounded by the configuration, not by the number of keys.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from budgets.background import BackgroundTask
from budgets.quotas import QuotaLedger
from gateway.config.schema import TenantConfig
from gateway.request.quotas import quota_usage

log = logging.getLogger("tokengate.quotas")


class QuotaUse(Collector):
    def __init__(
        self,
        ledger: QuotaLedger,
        tenants: Callable[[], Sequence[TenantConfig]],
        *,
        label: Callable[[str], str] = lambda t: t,
        interval_s: float = 5.0,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self.ledger = ledger
        self._tenants = tenants
        self._label = label  # a tenant's metrics label (the top tenants by name, the rest "other")
        self.interval_s = interval_s
        self._wall = wall
        self.rows: list[dict[str, Any]] = []  # per tenant-wide quota: its window now (quota_usage)
        self.read_at: float | None = None
        self.error: str | None = None
        self._loop = BackgroundTask("quota-use", self._forever, log)

    def start(self) -> None:
        self._loop.start()

    async def close(self) -> None:
        await self._loop.stop()

    async def refresh(self) -> None:
        rows: list[dict[str, Any]] = []
        now = self._wall()
        for t in self._tenants():
            specs = [q for q in t.quotas if not q.per_key]
            if specs:
                rows += [{"tenant": t.name, **r} for r in await quota_usage(self.ledger, specs, {}, now)]
        self.rows, self.read_at, self.error = rows, now, None

    async def _forever(self) -> None:
        while True:
            if any(t.quotas for t in self._tenants()):
                try:
                    await self.refresh()
                except Exception as exc:  # the store down: the last rows stay, marked stale
                    self.error = f"{type(exc).__name__}: {exc}"
            else:
                self.rows = []
            await asyncio.sleep(self.interval_s)

    def describe(self) -> Sequence[Any]:
        return []

    def collect(self) -> Iterator[Any]:
        labels = ["tenant", "quota", "unit"]
        used = GaugeMetricFamily(
            "tokengate_quota_used",
            "Settled use in the quota's window now (cost in currency units)",
            labels=labels,
        )
        reserved = GaugeMetricFamily(
            "tokengate_quota_reserved", "Reserved by requests in flight in the quota's window", labels=labels
        )
        limit = GaugeMetricFamily("tokengate_quota_limit", "The quota's limit per window", labels=labels)
        for r in self.rows:
            tenant = self._label(r["tenant"])
            if tenant == "other":  # (a bounded label set: the other tenants' quotas are not summed)
                continue
            key = [tenant, str(r["name"]), str(r["unit"])]
            used.add_metric(key, float(r["used"]))
            reserved.add_metric(key, float(r["reserved"]))
            limit.add_metric(key, float(r["limit"]))
        yield used
        yield reserved
        yield limit

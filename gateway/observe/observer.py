"""The one object the gateway talks to: a cheap hook on the request path plus background work.

Request path (each call is a few dict/deque operations, no locks, no I/O). With the gateway's
request record (see :class:`RequestRecord`)::

    obs.admitted(rec)        # the lease was granted: the request's tokens are now in flight
    obs.finished(rec, end)   # every finished request (a Gateway.request_hooks entry)

or, without records::

    obs.on_admit(klass, pool, cost)              # lease granted, request goes to a backend
    obs.on_done(klass, cost, queue_wait_s=..., ttft_s=..., backend_s=..., e2e_s=..., ok=...)
    obs.on_rejected(klass, queue_wait_s=...)     # refused or timed out in the queue (never admitted)

Background (``start``/``close`` in the app lifespan): a ticker closes windows and recomputes the
HOL pairs and shape readings once per window; the scraper polls backends' ``/metrics``.
``collector()`` exports all of it into the app's own CollectorRegistry.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from typing import Any, Protocol

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from budgets.background import BackgroundTask
from gateway.observe.hol import HolPair, hol_pairs
from gateway.observe.scrape import BackendLoadCollector, BackendLoads, BackendScraper, ScrapeTarget
from gateway.observe.settings import ObserveSettings
from gateway.observe.shape import ShapeReading, ShapeTracker
from gateway.observe.windows import ClassWindows

log = logging.getLogger("tokengate.observe")


class RequestRecord(Protocol):
    """The fields of the gateway's per-request record (gateway.observe.accesslog.Record) read here."""

    klass: str
    pool: str | None
    prefill: int
    decode: int
    start: float  # perf_counter at arrival
    outcome: str
    queue_s: float | None
    ttft_s: float | None
    backend_s: float | None


# Requests that never got a class (bad key, malformed body) say nothing about a class's latency.
UNCLASSIFIED = "unclassified"


class Observer:
    def __init__(
        self,
        settings: ObserveSettings | None = None,
        targets: Sequence[ScrapeTarget] = (),
        clock: Callable[[], float] = time.monotonic,
        store_health: Callable[[], Awaitable[bool]] | None = None,
    ) -> None:
        self.settings = s = settings or ObserveSettings()
        # The budget store's health, probed off the request path so "store down" is a metric
        # (tokengate_store_healthy / tokengate_store_errors_total) and not only a burst of 503s.
        self.store_health = store_health
        self.store_healthy: bool | None = None
        self.store_errors = 0
        self.clock = clock
        self.started_at = clock()
        self.windows = ClassWindows(s.window_s, s.windows, clock=clock)
        self.shape = ShapeTracker(s.shape)
        self.loads = BackendLoads(targets, s.scrape, clock=clock)
        self.scraper = BackendScraper(self.loads)
        self._pairs: list[HolPair] = []
        self._readings: list[ShapeReading] = []
        self._ticker = BackgroundTask("tokengate-observe-ticker", self._tick, log)
        self._seen_closed = -1
        # Admitted requests whose tokens are in flight, by record identity -> (class, cost).
        self._in_flight: dict[int, tuple[str, int]] = {}

    # ---- the request-path hook, on the gateway's records ----

    def admitted(self, rec: RequestRecord) -> None:
        cost = rec.prefill + rec.decode
        self._in_flight[id(rec)] = (rec.klass, cost)
        self.on_admit(rec.klass, rec.pool or "-", cost)

    def finished(self, rec: RequestRecord, end: float) -> None:
        held = self._in_flight.pop(id(rec), None)
        if held is not None:
            self.windows.released(*held)
        if rec.klass == UNCLASSIFIED:
            return
        self.windows.record(
            rec.klass,
            queue_wait_s=rec.queue_s,
            ttft_s=rec.ttft_s,
            backend_s=rec.backend_s,
            e2e_s=end - rec.start,
            ok=rec.outcome == "ok",
        )

    # ---- the request-path hook, plain values ----

    def on_admit(self, klass: str, pool: str, cost: int) -> None:
        self.windows.admitted(klass, cost)
        self.shape.record(pool, klass, cost)

    def on_done(
        self,
        klass: str,
        cost: int,
        *,
        queue_wait_s: float | None = None,
        ttft_s: float | None = None,
        backend_s: float | None = None,
        e2e_s: float | None = None,
        ok: bool = True,
    ) -> None:
        w = self.windows
        w.released(klass, cost)
        w.record(klass, queue_wait_s=queue_wait_s, ttft_s=ttft_s, backend_s=backend_s, e2e_s=e2e_s, ok=ok)

    def on_rejected(self, klass: str, *, queue_wait_s: float | None = None) -> None:
        self.windows.record(klass, queue_wait_s=queue_wait_s, ok=False)

    # ---- derived state (recomputed by the ticker, never on the request path) ----

    def refresh(self) -> None:
        """Close ended windows and recompute what depends on them (once per window)."""
        self.windows.roll()
        if self.windows.windows_closed == self._seen_closed:
            return
        self._seen_closed = self.windows.windows_closed
        h = self.settings.hol
        self._pairs = hol_pairs(self.windows, h.lookback_windows, h.min_windows, h.min_swing, h.min_swing_s)
        self._readings = self.shape.readings()

    def hol(self) -> list[HolPair]:
        return self._pairs

    def shape_readings(self) -> list[ShapeReading]:
        return self._readings

    # ---- lifecycle ----

    async def retarget(self, targets: Sequence[ScrapeTarget]) -> None:
        """Scrape these backends from now on (after a reconfiguration)."""
        self.loads.retarget(targets, clock=self.clock)
        if self._ticker.running:
            await self.scraper.start()  # no-op when already scraping; starts it for a first target

    async def start(self) -> None:
        self._ticker.start()
        await self.scraper.start()

    async def close(self) -> None:
        await self._ticker.stop()
        await self.scraper.close()

    async def check_store(self) -> None:
        if self.store_health is None:
            return
        try:
            ok = await asyncio.wait_for(self.store_health(), self.settings.scrape.timeout_s)
        except Exception:  # a hung or failing store is exactly what this measures
            ok = False
        if not ok:
            self.store_errors += 1
        self.store_healthy = bool(ok)

    async def _tick(self) -> None:
        period = min(1.0, self.settings.window_s / 4)
        next_store = 0.0
        while True:
            try:
                self.refresh()
                now = self.clock()
                if now >= next_store:
                    next_store = now + self.settings.scrape.interval_s
                    await self.check_store()
            except Exception:  # stale stats are survivable; a dead ticker never refreshes again
                log.exception("observer tick failed")
            await asyncio.sleep(period)

    # ---- Prometheus ----

    def collectors(self) -> list[Collector]:
        return [ObserverCollector(self), BackendLoadCollector(self.loads)]


class ObserverCollector(Collector):
    """``tokengate_hol_*``, ``tokengate_class_*`` and ``tokengate_pool_shape_*`` gauges."""

    def __init__(self, obs: Observer) -> None:
        self.obs = obs

    def describe(self) -> Sequence[Any]:
        return self._families(False)

    def collect(self) -> Iterator[Any]:
        return iter(self._families(True))

    def _families(self, fill: bool) -> list[Any]:
        obs = self.obs
        corr = GaugeMetricFamily(
            "tokengate_hol_correlation",
            "Head-of-line fingerprint: Pearson r of the victim class's per-window p99 TTFT with the "
            "aggressor class's in-flight tokens (or its p99 TTFT when in-flight is flat), this replica",
            labels=["victim", "aggressor"],
        )
        thr = GaugeMetricFamily(
            "tokengate_hol_threshold", "Configured HOL correlation threshold (alerting reference)"
        )
        inflight = GaugeMetricFamily(
            "tokengate_class_inflight_tokens", "Tokens in flight per request class", labels=["class"]
        )
        slo = GaugeMetricFamily(
            "tokengate_class_slo_seconds",
            "Configured per-class p99 SLO (signal: ttft | queue_wait)",
            labels=["class", "signal"],
        )
        ratio = GaugeMetricFamily(
            "tokengate_pool_shape_ratio",
            "Largest / median request cost over the pool's recent requests",
            labels=["pool"],
        )
        advice = GaugeMetricFamily(
            "tokengate_pool_split_advice",
            "0 fine, 1 plan a split (ratio >= split_at), 2 two services in one pool (>= two_services_at)",
            labels=["pool"],
        )
        store_ok = GaugeMetricFamily(
            "tokengate_store_healthy", "1 while the budget store answers its health check"
        )
        store_err = CounterMetricFamily("tokengate_store_errors", "Failed health checks of the budget store")
        if fill:
            obs.refresh()
            if obs.store_healthy is not None:
                store_ok.add_metric([], 1.0 if obs.store_healthy else 0.0)
            store_err.add_metric([], float(obs.store_errors))
            for p in obs.hol():
                corr.add_metric([p.victim, p.aggressor], p.score)
            thr.add_metric([], obs.settings.hol.threshold)
            for k, v in obs.windows.inflight_all().items():
                inflight.add_metric([k], float(v))
            for k, s in obs.settings.slos.items():
                if s.ttft_p99_s is not None:
                    slo.add_metric([k, "ttft"], s.ttft_p99_s)
                if s.queue_wait_p99_s is not None:
                    slo.add_metric([k, "queue_wait"], s.queue_wait_p99_s)
            for r in obs.shape_readings():
                if r.ratio is not None:
                    ratio.add_metric([r.pool], r.ratio)
                advice.add_metric([r.pool], float(r.advice))
        return [corr, thr, inflight, slo, ratio, advice, store_ok, store_err]

"""Backend load from each engine's own ``/metrics``: KV-cache usage, running/waiting, preemptions.

The gateway's budgets know what *it* sent to a backend; the engine knows what that costs it
right now. This module scrapes vLLM, SGLang and TGI names (and the reference backend, which
speaks vLLM's), keeps one :class:`BackendLoad` per backend, and lets the router ask it cheaply:
``load.saturated`` and ``load.penalty()`` read cached numbers and the clock, nothing else.

Staleness is pessimistic on purpose: a backend we cannot scrape is treated as saturated, not as
idle, because "no news" during an overload usually means the engine is too busy to answer.
A backend that has no ``/metrics`` at all (404) is not penalised: we just know nothing about it.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import httpx
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from budgets.background import BackgroundTask
from gateway.observe.settings import ScrapeSettings

log = logging.getLogger("tokengate.observe")

# A backend whose /metrics is missing or speaks no engine's names is asked again this rarely
# (it may be upgraded or restarted with metrics on, but polling it every interval is noise).
NO_METRICS_RECHECK_S = 60.0

# Engine name -> (metric name, role). Roles: kv (0..1 usage), kv_used / kv_total (tokens, SGLang
# older builds), running, waiting, preempt (a counter), batch_tokens (TGI's rough KV proxy).
_NAMES: dict[str, tuple[str, str]] = {
    # vLLM (labels model_name, engine). gpu_cache_usage_perc is the deprecated name of kv_cache_usage_perc.
    "vllm:kv_cache_usage_perc": ("vllm", "kv"),
    "vllm:gpu_cache_usage_perc": ("vllm", "kv"),
    "vllm:num_requests_running": ("vllm", "running"),
    "vllm:num_requests_waiting": ("vllm", "waiting"),
    "vllm:num_preemptions_total": ("vllm", "preempt"),
    # SGLang (--enable-metrics). "retracted" is its word for preempted.
    "sglang:token_usage": ("sglang", "kv"),
    "sglang:num_used_tokens": ("sglang", "kv_used"),
    "sglang:max_total_num_tokens": ("sglang", "kv_total"),
    "sglang:num_running_reqs": ("sglang", "running"),
    "sglang:num_queue_reqs": ("sglang", "waiting"),
    "sglang:num_retracted_requests_total": ("sglang", "preempt"),
    "sglang:num_retracted_reqs_total": ("sglang", "preempt"),
    # TGI: no KV usage and no preemption counter.
    "tgi_queue_size": ("tgi", "waiting"),
    "tgi_batch_current_size": ("tgi", "running"),
    "tgi_batch_current_max_tokens": ("tgi", "batch_tokens"),
}


# An engine's scheduler settings, as an info gauge (value 1, settings in the labels). Only the
# reference backend exports one; vLLM, SGLang and TGI keep theirs out of /metrics.
SCHEDULER_INFO = "tokengate:scheduler_config_info"
_LABEL = re.compile(r'([A-Za-z_][A-Za-z0-9_]*)="((?:[^"\\]|\\.)*)"')


@dataclass(frozen=True, slots=True)
class EngineSample:
    """One scrape, normalised. ``None`` = the engine does not export it."""

    flavor: str  # vllm | sglang | tgi | unknown
    kv_usage: float | None  # 0..1
    running: float | None
    waiting: float | None
    preemptions_total: float | None  # monotonic counter (resets on engine restart)
    batch_tokens: float | None = None  # TGI only: tokens of the current batch
    scheduler: Mapping[str, str] | None = None  # the scheduler settings in effect, where exported


def parse_engine_metrics(text: str) -> EngineSample:
    """Pick the load signals out of a Prometheus text exposition.

    A line scanner rather than prometheus_client's parser: vLLM's /metrics is mostly histogram
    buckets we do not want, and this runs on the event loop. Several label sets of one name
    (engines, models) are summed, except KV usage, where the fullest engine is what matters.
    """
    acc: dict[str, float] = {}
    flavors: dict[str, int] = {}
    scheduler: dict[str, str] | None = None
    for line in text.splitlines():
        if not line or line[0] == "#":
            continue
        brace = line.find("{")
        if brace >= 0:
            name = line[:brace]
            if name == SCHEDULER_INFO:
                scheduler = dict(_LABEL.findall(line[brace : line.rfind("}")]))
                continue
            rest = line[line.rfind("}") + 1 :].split()
        else:
            parts = line.split()
            name, rest = parts[0], parts[1:]
        hit = _NAMES.get(name)
        if hit is None or not rest:
            continue
        try:
            value = float(rest[0])
        except ValueError:
            continue
        if value != value:  # NaN: an engine with nothing to report yet
            continue
        flavor, role = hit
        flavors[flavor] = flavors.get(flavor, 0) + 1
        if role == "kv":
            acc[role] = max(acc.get(role, 0.0), value)
        else:
            acc[role] = acc.get(role, 0.0) + value
    kv = acc.get("kv")
    if kv is None and "kv_used" in acc and acc.get("kv_total", 0.0) > 0:
        kv = acc["kv_used"] / acc["kv_total"]
    flavor = max(flavors, key=lambda f: flavors[f]) if flavors else "unknown"
    return EngineSample(
        flavor=flavor,
        kv_usage=None if kv is None else min(max(kv, 0.0), 1.0),
        running=acc.get("running"),
        waiting=acc.get("waiting"),
        preemptions_total=acc.get("preempt"),
        batch_tokens=acc.get("batch_tokens"),
        scheduler=scheduler,
    )


class BackendLoad:
    """What the router may consult about one backend; updated only by the scraper.

    ``penalty()`` is 0 for a backend with room, rising towards 1 as KV fills, requests wait or
    preemptions start; exactly 1 when ``saturated`` (KV at/above the threshold, preemption
    thrash, or stale metrics). A router scores ``free_tokens * (1 - penalty())`` and prefers
    backends that are not saturated.
    """

    __slots__ = (
        "_created",
        "_first_scrape_done",
        "_last_preempt",
        "_last_preempt_t",
        "backend",
        "capacity_tokens",
        "clock",
        "errors_total",
        "last_error",
        "last_ok",
        "metrics_url",
        "next_scrape_at",
        "no_metrics",
        "pool",
        "preemption_rate",
        "sample",
        "settings",
    )

    def __init__(
        self,
        pool: str,
        backend: str,
        metrics_url: str,
        settings: ScrapeSettings,
        capacity_tokens: int | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.pool = pool
        self.backend = backend
        self.metrics_url = metrics_url
        self.settings = settings
        self.capacity_tokens = capacity_tokens
        self.clock = clock
        self.sample: EngineSample | None = None
        self.last_ok: float | None = None
        self.last_error: str | None = None
        self.errors_total = 0
        self.no_metrics = False
        self.next_scrape_at = 0.0  # a backend without engine metrics is re-checked rarely
        self.preemption_rate = 0.0  # preemptions per second over the last scrape interval
        self._last_preempt: float | None = None
        self._last_preempt_t: float | None = None
        self._created = clock()
        self._first_scrape_done = False

    # ---- written by the scraper ----

    def update(self, sample: EngineSample, now: float | None = None) -> None:
        now = self.clock() if now is None else now
        p = sample.preemptions_total
        if p is not None and self._last_preempt is not None and self._last_preempt_t is not None:
            dt = now - self._last_preempt_t
            # A counter that went down is an engine restart: count from the new value.
            delta = p - self._last_preempt if p >= self._last_preempt else p
            self.preemption_rate = delta / dt if dt > 0 else self.preemption_rate
        elif p is None:
            self.preemption_rate = 0.0
        self._last_preempt, self._last_preempt_t = p, now
        self.sample = sample
        self.last_ok = now
        self.last_error = None
        self.no_metrics = False
        self._first_scrape_done = True

    def mark_error(self, message: str) -> None:
        self.errors_total += 1
        self.last_error = message
        self._first_scrape_done = True

    def mark_no_metrics(self) -> None:
        self.no_metrics = True
        self.next_scrape_at = self.clock() + NO_METRICS_RECHECK_S
        self.last_error = None
        self._first_scrape_done = True

    # ---- read by the router, /stats and the collector ----

    @property
    def age_s(self) -> float | None:
        return None if self.last_ok is None else self.clock() - self.last_ok

    @property
    def stale(self) -> bool:
        if self.no_metrics:
            return False
        ref = self.last_ok if self.last_ok is not None else self._created
        return self.clock() - ref > self.settings.stale_after_s

    @property
    def kv_usage(self) -> float | None:
        s = self.sample
        if s is None:
            return None
        if s.kv_usage is not None:
            return s.kv_usage
        # TGI exports no KV usage; its current batch's token total over our configured capacity
        # is the closest thing, and only when we know the capacity.
        if s.batch_tokens is not None and self.capacity_tokens:
            return min(s.batch_tokens / self.capacity_tokens, 1.0)
        return None

    @property
    def thrashing(self) -> bool:
        return self.preemption_rate >= self.settings.thrash_preemptions_per_s

    @property
    def saturated(self) -> bool:
        if self.stale:
            return True
        kv = self.kv_usage
        return (kv is not None and kv >= self.settings.kv_threshold) or self.thrashing

    @property
    def reason(self) -> str:
        """Why the penalty is what it is, in words for /stats and the doctor."""
        if self.no_metrics:
            return "no /metrics (not judged)"
        if self.stale:
            return f"metrics stale ({self.last_error or 'no answer'}): treated as saturated"
        kv = self.kv_usage
        if kv is not None and kv >= self.settings.kv_threshold:
            return f"KV cache {kv:.0%} >= {self.settings.kv_threshold:.0%}"
        if self.thrashing:
            return f"preemption thrash ({self.preemption_rate:.2f}/s)"
        if self.sample is None:
            return "not scraped yet"
        return "ok"

    def penalty(self) -> float:
        if self.saturated:
            return 1.0
        s = self.sample
        if s is None:
            return 0.0
        st = self.settings
        p = 0.0
        kv = self.kv_usage
        if kv is not None and kv > st.kv_soft:
            p = max(p, 0.5 * (kv - st.kv_soft) / max(st.kv_threshold - st.kv_soft, 1e-9))
        if self.preemption_rate > 0:
            p = max(p, 0.5 * self.preemption_rate / st.thrash_preemptions_per_s)
        if s.waiting:
            # Requests waiting inside the engine are queueing we cannot see or order: a mild,
            # bounded nudge towards a backend whose own queue is empty.
            running = s.running or 0.0
            p = max(p, min(0.5, 0.1 * s.waiting / (running + 1.0) + 0.1))
        return min(p, 0.99)

    def as_dict(self) -> dict[str, Any]:
        s = self.sample
        return {
            "pool": self.pool,
            "backend": self.backend,
            "flavor": s.flavor if s else None,
            "kv_usage": self.kv_usage,
            "running": s.running if s else None,
            "waiting": s.waiting if s else None,
            "preemptions_per_s": round(self.preemption_rate, 4),
            "stale": self.stale,
            "saturated": self.saturated,
            "penalty": round(self.penalty(), 4),
            "age_s": None if self.age_s is None else round(self.age_s, 3),
            "reason": self.reason,
            "scheduler": dict(s.scheduler) if s is not None and s.scheduler is not None else None,
        }


@dataclass(frozen=True, slots=True)
class ScrapeTarget:
    pool: str
    backend: str  # the backend's base URL, as configured; also its label value
    capacity_tokens: int | None = None
    metrics_url: str | None = None  # default: <backend>/metrics


class BackendLoads:
    """Every backend's load, looked up by base URL (what the router knows a backend by)."""

    def __init__(
        self,
        targets: Iterable[ScrapeTarget],
        settings: ScrapeSettings,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.settings = settings
        self._by_url: dict[str, BackendLoad] = {}
        for t in targets:
            url = t.metrics_url or t.backend.rstrip("/") + "/metrics"
            self._by_url[t.backend] = BackendLoad(
                t.pool, t.backend, url, settings, t.capacity_tokens, clock=clock
            )

    def retarget(self, targets: Iterable[ScrapeTarget], clock: Callable[[], float] | None = None) -> None:
        """Scrape these from now on; a backend that stays keeps what was learned of it."""
        old = self._by_url
        self._by_url = {}
        for t in targets:
            load = old.get(t.backend)
            if load is None or load.pool != t.pool:
                url = t.metrics_url or t.backend.rstrip("/") + "/metrics"
                load = BackendLoad(
                    t.pool, t.backend, url, self.settings, t.capacity_tokens, clock=clock or time.monotonic
                )
            else:
                load.capacity_tokens = t.capacity_tokens
            self._by_url[t.backend] = load

    def get(self, backend: str) -> BackendLoad | None:
        return self._by_url.get(backend)

    def kv_usage(self, pool: str) -> float | None:
        """The fullest fresh KV-cache usage among ``pool``'s backends; None when none reports one."""
        usages = []
        for load in self._by_url.values():
            s = load.sample
            if load.pool != pool or s is None or s.kv_usage is None or load.last_ok is None:
                continue
            if load.clock() - load.last_ok <= self.settings.stale_after_s:
                usages.append(s.kv_usage)
        return max(usages) if usages else None

    def __iter__(self) -> Iterator[BackendLoad]:
        return iter(self._by_url.values())

    def __len__(self) -> int:
        return len(self._by_url)

    def penalty(self, backend: str) -> float:
        load = self._by_url.get(backend)
        return 0.0 if load is None else load.penalty()


class BackendScraper:
    """Scrapes every backend every ``interval_s`` with one httpx client, off the request path."""

    def __init__(self, loads: BackendLoads, headers: Mapping[str, str] | None = None) -> None:
        self.loads = loads
        self._headers = dict(headers or {})
        self._client: httpx.AsyncClient | None = None
        self._poller = BackgroundTask("tokengate-backend-scraper", self._loop, log)

    async def start(self) -> None:
        if self._poller.running or not len(self.loads):
            return
        s = self.loads.settings
        self._client = httpx.AsyncClient(timeout=s.timeout_s, headers=self._headers)
        self._poller.start()

    async def close(self) -> None:
        await self._poller.stop()
        if self._client is not None:
            await self._client.aclose()
            self._client = None

    async def scrape_all(self) -> None:
        own = self._client is None
        client = self._client or httpx.AsyncClient(timeout=self.loads.settings.timeout_s)
        try:
            due = [ld for ld in self.loads if not ld.no_metrics or ld.clock() >= ld.next_scrape_at]
            await asyncio.gather(*(self._scrape_one(client, load) for load in due))
        finally:
            if own:
                await client.aclose()

    async def _loop(self) -> None:
        interval = self.loads.settings.interval_s
        # The first pass waits one interval: start-up is not held up by slow engines, and until a
        # backend has been scraped routing judges it by free tokens alone.
        await asyncio.sleep(interval)
        while True:
            started = time.monotonic()
            try:
                await self.scrape_all()
            except Exception:  # never let one bad scrape end the loop
                log.exception("backend scrape pass failed")
            await asyncio.sleep(max(0.05, interval - (time.monotonic() - started)))

    async def _scrape_one(self, client: httpx.AsyncClient, load: BackendLoad) -> None:
        try:
            resp = await client.get(load.metrics_url)
        except (httpx.HTTPError, OSError) as e:
            load.mark_error(f"{type(e).__name__}")
            return
        if resp.status_code == 404:
            if not load.no_metrics:
                log.info("backend %s has no /metrics; its load is not judged", load.backend)
            load.mark_no_metrics()
            return
        if resp.status_code != 200:
            load.mark_error(f"HTTP {resp.status_code}")
            return
        sample = parse_engine_metrics(resp.text)
        if sample.flavor == "unknown":
            # A /metrics without any engine names we know (e.g. another proxy): nothing to judge.
            load.mark_no_metrics()
            return
        load.update(sample)


class BackendLoadCollector(Collector):
    """Exports every backend's scraped load as ``tokengate_backend_*{pool,backend}``."""

    def __init__(self, loads: BackendLoads) -> None:
        self.loads = loads

    def describe(self) -> Sequence[Any]:
        return list(self._families([]))

    def collect(self) -> Iterator[Any]:
        return iter(self._families(list(self.loads)))

    @staticmethod
    def _families(loads: list[BackendLoad]) -> list[Any]:
        labels = ["pool", "backend"]
        kv = GaugeMetricFamily(
            "tokengate_backend_kv_usage",
            "Backend KV-cache usage (0-1), scraped from the engine",
            labels=labels,
        )
        run = GaugeMetricFamily(
            "tokengate_backend_requests_running", "Requests running in the backend engine", labels=labels
        )
        wait = GaugeMetricFamily(
            "tokengate_backend_requests_waiting", "Requests waiting inside the backend engine", labels=labels
        )
        pre = GaugeMetricFamily(
            "tokengate_backend_preemptions_per_second",
            "Backend preemption rate over the last scrape interval",
            labels=labels,
        )
        stale = GaugeMetricFamily(
            "tokengate_backend_metrics_stale",
            "1 when the backend's metrics are stale (treated as saturated)",
            labels=labels,
        )
        sat = GaugeMetricFamily(
            "tokengate_backend_saturated",
            "1 when routing treats the backend as saturated (KV full, thrash or stale)",
            labels=labels,
        )
        pen = GaugeMetricFamily(
            "tokengate_backend_penalty", "Routing penalty 0 (free) .. 1 (saturated)", labels=labels
        )
        errs = CounterMetricFamily(
            "tokengate_backend_scrape_errors", "Failed scrapes of the backend's /metrics", labels=labels
        )
        for ld in loads:
            lv = [ld.pool, ld.backend]
            s = ld.sample
            k = ld.kv_usage
            if k is not None:
                kv.add_metric(lv, k)
            if s is not None and s.running is not None:
                run.add_metric(lv, s.running)
            if s is not None and s.waiting is not None:
                wait.add_metric(lv, s.waiting)
            pre.add_metric(lv, ld.preemption_rate)
            stale.add_metric(lv, 1.0 if ld.stale else 0.0)
            sat.add_metric(lv, 1.0 if ld.saturated else 0.0)
            pen.add_metric(lv, ld.penalty())
            errs.add_metric(lv, float(ld.errors_total))
        return [kv, run, wait, pre, stale, sat, pen, errs]

"""The gateway's Prometheus metrics (``tokengate_*``), one class, one registry per app.

Observing sits on the hot path, so label children are bound once per (class, tenant, tier) and
cached; per-pool and per-tier gauges are filled from a store snapshot at scrape time only.
Tenant label cardinality is bounded: the first ``top_tenants`` configured tenants keep their
name, every other tenant is ``other``. Time histograms carry class and tier, not tenant. Model
labels (``tokengate_prompt_overhead_tokens``) are the at most 256 (model, route) pairs the prompt
overhead learner keeps (``classifiers.prompt_overhead``).

The per-request children are buffered (``BufferedCounter``, ``BufferedHistogram``): an observation
is a list index and an add (~0.2 us, against ~1 us for prometheus_client's locked child, eight to
eleven of them per request), and the sums are handed to the prometheus_client children when the
registry is collected. Everything runs on the event loop, scrapes included, so nothing is lost
between the two.
"""

from __future__ import annotations

import gc
from bisect import bisect_left
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, GCCollector, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from budgets.quota import QuotaSpec
from budgets.types import StoreSnapshot
from gateway.observe.percentile import percentile
from gateway.upstream.pools import Backend

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_WAIT_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 30, 60, 120, 300, 600)
_RATIO_BUCKETS = (0.25, 0.5, 0.75, 0.9, 0.95, 0.99, 1.0, 1.01, 1.05, 1.1, 1.25, 1.5, 2.0, 4.0)

OUTCOMES = (
    "ok",  # 2xx from the backend, relayed
    "backend_4xx",  # the backend refused the request; relayed as is
    "upstream_error",  # 502/504: connect failure, timeout, backend 5xx, broken stream
    "rejected",  # refused before reaching a backend: 400/401/404/413/415/429/503
    "client_disconnect",  # the client went away (queued, waiting or mid-stream)
    "shutdown",  # cancelled by the drain deadline
    "internal_error",
)


class PrefillGateCollector(Collector):
    """``tokengate_prefill_gate_*{pool,backend}`` for every backend whose pool has a prefill gate
    (nothing at all when no pool has one). The backends are handed over at scrape time."""

    def __init__(self) -> None:
        self.backends: list[Backend] = []

    def describe(self) -> Sequence[Any]:
        return []

    def collect(self) -> Iterator[Any]:
        gated = [b for b in self.backends if b.gate is not None]
        if not gated:
            return
        labels = ["pool", "backend"]
        tokens = GaugeMetricFamily(
            "tokengate_prefill_gate_tokens",
            "Prompt tokens sent to the backend whose first token has not come back yet",
            labels=labels,
        )
        limit = GaugeMetricFamily(
            "tokengate_prefill_gate_limit_tokens", "The pool's prefill_gate_tokens", labels=labels
        )
        inside = GaugeMetricFamily(
            "tokengate_prefill_gate_requests", "Requests inside the prefill gate", labels=labels
        )
        waiting = GaugeMetricFamily(
            "tokengate_prefill_gate_waiting", "Requests waiting at the prefill gate", labels=labels
        )
        held = CounterMetricFamily(
            "tokengate_prefill_gate_held", "Requests that had to wait at the prefill gate", labels=labels
        )
        waited = CounterMetricFamily(
            "tokengate_prefill_gate_wait_seconds", "Time requests spent waiting at the gate", labels=labels
        )
        # Per prompt class (short: fits in the reserve; long: the rest), so a short prompt's wait,
        # which the reserve should make rare, is not lost among long ones'.
        by_class = [*labels, "prompt"]
        let_in = CounterMetricFamily(
            "tokengate_prefill_gate_prompts", "Prompts let in by the prefill gate, by class", labels=by_class
        )
        class_held = CounterMetricFamily(
            "tokengate_prefill_gate_prompts_held",
            "Prompts let in by the prefill gate after waiting, by class",
            labels=by_class,
        )
        class_waited = CounterMetricFamily(
            "tokengate_prefill_gate_prompt_wait_seconds",
            "Time prompts let in by the prefill gate spent waiting, by class",
            labels=by_class,
        )
        class_p99 = GaugeMetricFamily(
            "tokengate_prefill_gate_prompt_wait_p99_seconds",
            "p99 wait at the prefill gate over the class's last 512 prompts",
            labels=by_class,
        )
        for b in gated:
            gate = b.gate
            assert gate is not None
            lv = [b.pool, b.name]
            tokens.add_metric(lv, gate.tokens)
            limit.add_metric(lv, gate.limit)
            inside.add_metric(lv, gate.requests)
            waiting.add_metric(lv, gate.waiting)
            held.add_metric(lv, gate.held_total)
            waited.add_metric(lv, gate.wait_s_total)
            for name, st in (("short", gate.short_stats), ("long", gate.long_stats)):
                cv = [*lv, name]
                let_in.add_metric(cv, st.requests)
                class_held.add_metric(cv, st.held)
                class_waited.add_metric(cv, st.wait_s_total)
                p99 = percentile((w for _, _, w in st.recent), 99)
                if p99 is not None:
                    class_p99.add_metric(cv, p99)
        yield from (tokens, limit, inside, waiting, held, waited, let_in, class_held, class_waited, class_p99)


class BufferedCounter:
    """A counter child's increments as a plain number until the registry is collected."""

    __slots__ = ("_child", "_pending")

    def __init__(self, child: Counter) -> None:
        self._child = child
        self._pending = 0.0

    def inc(self, amount: float = 1.0) -> None:
        self._pending += amount

    def flush(self) -> None:
        if self._pending:
            self._child.inc(self._pending)
            self._pending = 0.0


class BufferedHistogram:
    """A histogram child's observations as bucket counts and a sum until the registry is collected."""

    __slots__ = ("_bounds", "_child", "_counts", "_last", "_n", "_sum")

    def __init__(self, child: Histogram) -> None:
        self._child = child
        self._bounds: tuple[float, ...] = tuple(child._upper_bounds)  # ends with +Inf
        self._last = len(self._bounds) - 1
        self._counts = [0] * len(self._bounds)
        self._sum = 0.0
        self._n = 0

    def observe(self, amount: float) -> None:
        # The first bucket whose upper bound is >= amount, as prometheus_client's `le` (NaN: +Inf).
        self._counts[min(bisect_left(self._bounds, amount), self._last)] += 1
        self._sum += amount
        self._n += 1

    def flush(self) -> None:
        if not self._n:
            return
        buckets = self._child._buckets
        counts = self._counts
        for i, c in enumerate(counts):
            if c:
                buckets[i].inc(c)
                counts[i] = 0
        self._child._sum.inc(self._sum)
        self._sum = 0.0
        self._n = 0


@dataclass(slots=True)
class Bound:
    """Pre-bound label children for one (class, tenant, tier)."""

    outcomes: dict[str, BufferedCounter]
    queue_wait: BufferedHistogram
    ttft: BufferedHistogram
    backend: BufferedHistogram
    e2e: BufferedHistogram
    prompt_ratio: BufferedHistogram
    output_ratio: BufferedHistogram
    prompt_est: BufferedCounter
    prompt_act: BufferedCounter
    output_est: BufferedCounter
    output_act: BufferedCounter
    reservation_ratio: BufferedHistogram
    overdrafts: BufferedCounter
    overdraft_tokens: BufferedCounter
    extensions: BufferedCounter

    def flush(self) -> None:
        for c in self.outcomes.values():
            c.flush()
        for m in (
            self.queue_wait,
            self.ttft,
            self.backend,
            self.e2e,
            self.prompt_ratio,
            self.output_ratio,
            self.prompt_est,
            self.prompt_act,
            self.output_est,
            self.output_act,
            self.reservation_ratio,
            self.overdrafts,
            self.overdraft_tokens,
            self.extensions,
        ):
            m.flush()


class _FlushBuffered(Collector):
    """Registered first, so every collection hands the buffered children's sums over before the
    prometheus_client metrics are read."""

    def __init__(self, metrics: GatewayMetrics) -> None:
        self._metrics = metrics

    def describe(self) -> Sequence[Any]:
        return []

    def collect(self) -> Iterator[Any]:
        self._metrics.flush()
        return iter(())


class _FrozenHeap(Collector):
    """How many objects start-up froze out of the garbage collector's full collections
    (gateway.process.serve.freeze_startup_heap; 0 when the app is not run by ``tokengate serve``), and the
    collector's thresholds (gateway.process.serve.tune_collector)."""

    def describe(self) -> Sequence[Any]:
        return []

    def collect(self) -> Iterator[Any]:
        yield GaugeMetricFamily(
            "tokengate_gc_frozen_objects",
            "Objects kept out of full garbage collections since start-up (gc.freeze)",
            value=gc.get_freeze_count(),
        )
        thresholds = GaugeMetricFamily(
            "tokengate_gc_threshold",
            "The garbage collector's thresholds (gc.get_threshold(); config gc.threshold0..2)",
            labels=["generation"],
        )
        for generation, value in enumerate(gc.get_threshold()):
            thresholds.add_metric([str(generation)], value)
        yield thresholds


class GatewayMetrics:
    def __init__(self, *, tenants: Sequence[str] = (), top_tenants: int = 20) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self._top = top_tenants
        self._named_tenants = frozenset(list(tenants)[:top_tenants])
        self._bound: dict[tuple[str, str, str], Bound] = {}
        r = self.registry
        r.register(_FlushBuffered(self))
        # Full collections stall the event loop (python_gc_collections_total{generation="2"}
        # against a p99 step); the frozen start-up heap is what they no longer traverse.
        GCCollector(registry=r)
        r.register(_FrozenHeap())
        self.requests = Counter(
            "tokengate_requests",
            "Requests by class, tenant, tier and outcome",
            ("class", "tenant", "tier", "outcome"),
            registry=r,
        )
        self.queue_wait = Histogram(
            "tokengate_queue_wait_seconds",
            "Time waiting for admission",
            ("class", "tier"),
            buckets=_WAIT_BUCKETS,
            registry=r,
        )
        self.ttft = Histogram(
            "tokengate_ttft_seconds",
            "Streaming: arrival at the gateway to the first relayed byte (queue wait included)",
            ("class", "tier"),
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.backend_time = Histogram(
            "tokengate_backend_seconds",
            "Time on the backend: request sent to answer complete",
            ("class", "tier"),
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "tokengate_request_duration_seconds",
            "End to end inside the gateway: arrival to last byte sent",
            ("class", "tier"),
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.estimate_ratio = Histogram(
            "tokengate_token_estimate_ratio",
            "Actual / estimated tokens per request (prompt: prefill estimate; output: reserved decode)",
            ("class", "kind"),
            buckets=_RATIO_BUCKETS,
            registry=r,
        )
        self.tokens_estimated = Counter(
            "tokengate_tokens_estimated", "Tokens estimated at admission", ("class", "kind"), registry=r
        )
        self.tokens_actual = Counter(
            "tokengate_tokens_actual", "Tokens the backend reported in usage", ("class", "kind"), registry=r
        )
        self.reservation_ratio = Histogram(
            "tokengate_reservation_ratio",
            "Output tokens used / output tokens reserved at admission, per request",
            ("class", "tenant"),
            buckets=_RATIO_BUCKETS,
            registry=r,
        )
        self.overdrafts = Counter(
            "tokengate_overdraft_requests",
            "Requests whose output outgrew what their pools could give (reservation exceeded)",
            ("class", "tenant"),
            registry=r,
        )
        self.overdraft_tokens = Counter(
            "tokengate_overdraft_tokens",
            "Output tokens beyond what the pools had room for when a reservation was outgrown",
            ("class", "tenant"),
            registry=r,
        )
        self.quota_refusals = Counter(
            "tokengate_quota_refusals",
            "Requests a quota refused (enforced=true) or would have refused in shadow mode (enforced=false)",
            ("tenant", "quota", "enforced"),
            registry=r,
        )
        self.shadow_refusals = Counter(
            "tokengate_shadow_refusals",
            "Requests a limit in shadow mode (enforce: false) would have refused or kept waiting; they "
            "ran. kind: quota, budget (a tenant's budget_tokens) or ceiling (a tier's, of a pool)",
            ("kind", "limit"),
            registry=r,
        )
        self.extensions = Counter(
            "tokengate_lease_extensions",
            "Leases grown while a stream ran (its output outgrew the reservation)",
            ("class",),
            registry=r,
        )
        self.pool_used = Gauge(
            "tokengate_pool_used_tokens",
            "Tokens requests in flight really occupy now (prompt + output so far), beside the reserved "
            "tokengate_pool_in_flight_tokens",
            ("pool",),
            registry=r,
        )
        self.pool_in_flight = Gauge(
            "tokengate_pool_in_flight_tokens", "Tokens held by granted leases", ("pool", "kind"), registry=r
        )
        self.pool_capacity = Gauge(
            "tokengate_pool_capacity_tokens", "Pool capacity", ("pool", "kind"), registry=r
        )
        self.queue_depth = Gauge(
            "tokengate_queue_depth", "Tickets waiting for admission", ("tier",), registry=r
        )
        self.leases = Gauge("tokengate_leases", "Live leases in the store", registry=r)
        self.backend_in_flight = Gauge(
            "tokengate_backend_in_flight_tokens",
            "Tokens this gateway has in flight on a backend",
            ("pool", "backend"),
            registry=r,
        )
        self.backend_capacity = Gauge(
            "tokengate_backend_capacity_tokens", "Backend capacity", ("pool", "backend"), registry=r
        )
        self.backend_healthy = Gauge(
            "tokengate_backend_healthy",
            "1 while the backend's breaker is closed",
            ("pool", "backend"),
            registry=r,
        )
        self.in_flight_requests = Gauge(
            "tokengate_requests_in_flight", "Requests inside the gateway now", registry=r
        )
        self.held_body_bytes = Gauge(
            "tokengate_held_body_bytes",
            "Bytes of request bodies this process holds now (limits.max_held_body_bytes)",
            registry=r,
        )
        self.encode_backlog_chars = Gauge(
            "tokengate_encode_backlog_chars",
            "Characters of long prompts waiting for a tokenizer thread (pricing.settings.encode_threads)",
            registry=r,
        )
        self.draining = Gauge("tokengate_draining", "1 while the gateway is draining", registry=r)
        # Model labels are bounded by the learner (classifiers.prompt_overhead.MAX_KEYS pairs).
        self.prompt_overhead = Gauge(
            "tokengate_prompt_overhead_tokens",
            "Tokens added to each priced prompt of the model and route (configured or learned from "
            "usage; negative: taken off)",
            ("model", "route"),
            registry=r,
        )
        self.prefill_gates = PrefillGateCollector()
        r.register(self.prefill_gates)

    def set_tenants(self, tenants: Sequence[str]) -> None:
        """The tenants that get their own label from now on (after a reconfiguration)."""
        named = frozenset(list(tenants)[: self._top])
        if named != self._named_tenants:
            self._named_tenants = named
            self.flush()
            self._bound.clear()  # children bound under the old naming

    def tenant_label(self, tenant: str) -> str:
        return tenant if tenant in self._named_tenants else "other"

    def quota_refused(self, quota: QuotaSpec, enforced: bool) -> None:
        label = self.tenant_label(quota.tenant)
        name = quota.name if label != "other" else "other"
        self.quota_refusals.labels(label, name, "true" if enforced else "false").inc()
        if not enforced:
            self.shadow_refusals.labels("quota", f"{label}/{name}").inc()

    def shadow_over(self, kind: str, name: str) -> None:
        """A limit in shadow mode would have held a request back (``name``: the tenant of a budget,
        ``<tier>/<pool>`` of a ceiling)."""
        if kind == "budget":
            name = self.tenant_label(name)
        self.shadow_refusals.labels(kind, name).inc()

    def bind(self, klass: str, tenant: str, tier: str) -> Bound:
        key = (klass, tenant, tier)
        b = self._bound.get(key)
        if b is None:
            b = self._make(klass, self.tenant_label(tenant), tier)
            self._bound[key] = b
        return b

    def flush(self) -> None:
        """Hand every buffered observation to its prometheus_client child (collection does this)."""
        for b in self._bound.values():
            b.flush()

    def _make(self, klass: str, tenant: str, tier: str) -> Bound:
        c, h = BufferedCounter, BufferedHistogram
        return Bound(
            outcomes={o: c(self.requests.labels(klass, tenant, tier, o)) for o in OUTCOMES},
            queue_wait=h(self.queue_wait.labels(klass, tier)),
            ttft=h(self.ttft.labels(klass, tier)),
            backend=h(self.backend_time.labels(klass, tier)),
            e2e=h(self.e2e.labels(klass, tier)),
            prompt_ratio=h(self.estimate_ratio.labels(klass, "prompt")),
            output_ratio=h(self.estimate_ratio.labels(klass, "output")),
            prompt_est=c(self.tokens_estimated.labels(klass, "prompt")),
            prompt_act=c(self.tokens_actual.labels(klass, "prompt")),
            output_est=c(self.tokens_estimated.labels(klass, "output")),
            output_act=c(self.tokens_actual.labels(klass, "output")),
            reservation_ratio=h(self.reservation_ratio.labels(klass, tenant)),
            overdrafts=c(self.overdrafts.labels(klass, tenant)),
            overdraft_tokens=c(self.overdraft_tokens.labels(klass, tenant)),
            extensions=c(self.extensions.labels(klass)),
        )

    @staticmethod
    def observe_reservation(b: Bound, reserved: int, extended: int, output: int) -> None:
        """A finished request's output against what it reserved at admission (plus its growth)."""
        if reserved > 0:
            b.reservation_ratio.observe(output / reserved)
        over = output - reserved - extended
        if over > 0:  # more than the lease ever held: settled only at release (non-streaming)
            b.overdrafts.inc()
            b.overdraft_tokens.inc(over)

    @staticmethod
    def observe_usage(
        b: Bound, *, est_prompt: int, est_output: int, prompt: int | None, output: int | None
    ) -> None:
        if prompt is not None:
            b.prompt_est.inc(est_prompt)
            b.prompt_act.inc(prompt)
            if est_prompt > 0:
                b.prompt_ratio.observe(prompt / est_prompt)
        if output is not None:
            b.output_est.inc(est_output)
            b.output_act.inc(output)
            if est_output > 0:
                b.output_ratio.observe(output / est_output)

    def set_prompt_overheads(self, snapshot: Mapping[str, Any]) -> None:
        """``tokengate_prompt_overhead_tokens`` from the learner's snapshot (at scrape time)."""
        self.prompt_overhead.clear()
        for row in snapshot.get("models") or ():
            self.prompt_overhead.labels(row["model"], row["route"]).set(row["applied_overhead"])

    def update_state(
        self, snapshot: StoreSnapshot, backends: Iterable[Backend], tiers: Iterable[str]
    ) -> None:
        """Refresh the gauges that mirror live state (called at scrape time)."""
        for name, pool in snapshot.pools.items():
            kind, _, short = name.partition(":")
            if not short:
                kind, short = "pool", name
            self.pool_in_flight.labels(short, kind).set(pool.in_flight)
            self.pool_capacity.labels(short, kind).set(pool.capacity)
        for tier in tiers:
            self.queue_depth.labels(tier).set(snapshot.queue_depth.get(tier, 0))
        self.leases.set(snapshot.leases)
        backends = list(backends)
        self.prefill_gates.backends = backends
        for b in backends:
            self.backend_in_flight.labels(b.pool, b.name).set(b.in_flight_tokens)
            self.backend_capacity.labels(b.pool, b.name).set(b.spec.capacity_tokens)
            self.backend_healthy.labels(b.pool, b.name).set(1 if b.healthy else 0)

    def render(self) -> bytes:
        return generate_latest(self.registry)

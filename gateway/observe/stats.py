"""``GET /stats`` (JSON for the dashboard and ``tokengate doctor``), ``GET /insights`` (split advice
as a concrete config edit) and the ``/dashboard`` page.

The endpoints read an :class:`Observer` plus two narrow callables the gateway supplies: the
budget store's snapshot (pools, queues, tenants) and a view of the configured class rules and
pools in config-file shape (for the split YAML). Either may be absent; the JSON says so.

``reservations`` (when the gateway supplies :class:`ReservationSources`) says how good the output
reservations are: per class and tenant the histogram of output used / reserved at admission (from
``tokengate_reservation_ratio``; its mean, and the bucket edges holding the median and p90),
overdrafts and their tokens; leases grown per class; per backend pool the share of capacity the
reservations hold beside the share requests really occupy (prompt + output so far); the learned
estimates and the pools reserving limits again because their KV cache is full.

``pricing`` says how far prompt prices are from what engines count: per model and route, the
decayed means of the priced and the engine-reported prompt, the learned, configured and applied
prompt overhead, and the mean absolute error of the prompt price before and after the correction
(``classifiers.prompt_overhead``).
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from importlib import resources
from typing import Any

import orjson
from prometheus_client.registry import Collector
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Route

from budgets.types import StoreSnapshot
from classifiers import ClassRule
from gateway.observe.diagnose import diagnose
from gateway.observe.observer import Observer
from gateway.observe.oneserver import OneServerPlan, ShortLoad, one_server_plans
from gateway.observe.shape import split_plan
from gateway.observe.windows import Quantiles
from gateway.upstream.pools import DEFAULT_PROBE, Backend, BackendPoolSpec

STATS_VERSION = 1


@dataclass(frozen=True, slots=True)
class ConfigView:
    """Class rules and pools exactly as a config file would spell them (plain mappings)."""

    classes: Sequence[Mapping[str, Any]] = ()
    pools: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)


def config_view(classes: Sequence[ClassRule], pools: Sequence[BackendPoolSpec]) -> ConfigView:
    """The config's class rules and pools in config-file shape, for the split edit.

    API keys and timeouts are left out on purpose: /insights must never echo a secret, and the
    operator keeps their own values when applying the edit.
    """
    out: dict[str, Mapping[str, Any]] = {}
    for p in pools:
        backends = []
        for b in p.backends:
            d: dict[str, Any] = {"url": b.url, "capacity_tokens": b.capacity_tokens}
            if b.models:
                d["models"] = list(b.models)
            if b.accepts_priority:
                d["accepts_priority"] = True
            if b.max_num_seqs is not None:
                d["max_num_seqs"] = b.max_num_seqs
            if b.cache_salt != "client":
                d["cache_salt"] = b.cache_salt
            if b.tenant_header is not None:
                d["tenant_header"] = b.tenant_header
            if b.request_id_header != "x-request-id":
                d["request_id_header"] = b.request_id_header or "none"
            if b.probe != DEFAULT_PROBE:
                probe = b.probe
                d["probe"] = (
                    "off"
                    if probe is None
                    else probe.path
                    if probe.method == "GET"
                    else {"path": probe.path, "method": probe.method}
                )
            if b.name:
                d["name"] = b.name
            backends.append(d)
        pool: dict[str, Any] = {"backends": backends}
        if p.prefill_gate_tokens is not None:
            pool["prefill_gate_tokens"] = p.prefill_gate_tokens
            pool["prefill_gate_hold_s"] = p.prefill_gate_hold_s
            if p.prefill_gate_reserve_tokens is not None:  # the default follows prefill_gate_tokens
                pool["prefill_gate_reserve_tokens"] = p.prefill_gate_reserve_tokens
        out[p.name] = pool
    return ConfigView(classes=[c.to_config() for c in classes], pools=out)


@dataclass(frozen=True, slots=True)
class BackendHealth:
    """What the gateway's own health checks and connects say about one backend."""

    pool: str
    backend: str
    health: str  # up | down (breaker open) | unknown (never answered yet)
    consecutive_failures: int = 0
    usage_reported: int = 0  # metered answers that carried usage
    usage_missing: int = 0  # and those that did not (their usage estimated)


@dataclass(frozen=True, slots=True)
class ReservationSources:
    """How well output reservations match what answers really use (``gateway.request.reservations``): the
    gateway's reservation metrics and live state, read at each /stats."""

    ratio: Collector  # tokengate_reservation_ratio{class, tenant}: output used / reserved at admission
    overdrafts: Collector  # tokengate_overdraft_requests{class, tenant}
    overdraft_tokens: Collector  # tokengate_overdraft_tokens{class, tenant}
    extensions: Collector  # tokengate_lease_extensions{class}
    used_tokens: Callable[[], Mapping[str, int]]  # per backend pool: prompt + output in flight now
    learned: Callable[[], Sequence[Mapping[str, object]]]  # the learned estimates (Reservations.learned)
    tight_pools: Callable[[], Sequence[str]]  # pools reserving limits again (KV feedback)
    # Hands the gateway's buffered per-request observations to the metrics above (GatewayMetrics.flush).
    flush: Callable[[], None] = lambda: None


@dataclass(slots=True)
class StatsSources:
    observer: Observer
    snapshot: Callable[[], Awaitable[StoreSnapshot]] | None = None
    config_view: Callable[[], ConfigView] | None = None
    backends: Callable[[], Iterable[Backend]] | None = None  # the router's, for the prefill gates
    wall: Callable[[], float] = time.time
    backend_health: Callable[[], Sequence[BackendHealth]] | None = None
    reservations: ReservationSources | None = None
    # Request bodies the process holds: (bytes now, the process's limit, per tenant) — gateway/request/held_bodies.py
    held_bodies: Callable[[], tuple[int, int, Mapping[str, int]]] | None = None
    # Characters of long prompts waiting for a tokenizer thread, per tenant (classifiers.fair_pool)
    encode_backlog: Callable[[], Mapping[str, int]] | None = None
    # Client connections per tenant, and the most one may hold (gateway/request/tenant_connections.py)
    tenant_connections: Callable[[], tuple[Mapping[str, int], int]] | None = None
    # The prompt-overhead learner's snapshot (classifiers.prompt_overhead.PromptOverheads.snapshot)
    prompt_overheads: Callable[[], Mapping[str, Any]] | None = None
    # Estimate mode: learned ratios and the exact / estimate distribution (Pricer.estimates)
    estimates: Callable[[], Mapping[str, Any]] | None = None
    # Where the pools live (BudgetStore.describe): the kind; for Redis the domain, topology and node
    store: Callable[[], Mapping[str, Any]] | None = None
    # Limits in shadow mode and what they would have refused; every tenant's quota windows now
    # (gateway/request/shadow.py, gateway/observe/quota_use.py)
    limits: Callable[[], Mapping[str, Any]] | None = None


def _top(counts: Mapping[str, int], n: int = 5) -> list[tuple[str, int]]:
    """The ``n`` largest counts, largest first: who holds most of a shared resource."""
    return sorted(counts.items(), key=lambda kv: -kv[1])[:n]


def _held_bodies(src: StatsSources) -> dict[str, Any] | None:
    if src.held_bodies is None:
        return None
    total, most, by_tenant = src.held_bodies()
    top = _top(by_tenant)
    return {"bytes": total, "limit": most, "top_tenants": [{"tenant": t, "bytes": n} for t, n in top]}


def _tenant_connections(src: StatsSources) -> dict[str, Any] | None:
    if src.tenant_connections is None:
        return None
    by_tenant, most = src.tenant_connections()
    top = _top(by_tenant)
    return {
        "total": sum(by_tenant.values()),
        "limit_per_tenant": most,
        "top_tenants": [{"tenant": t, "connections": n} for t, n in top],
    }


def _encode_backlog(src: StatsSources) -> dict[str, Any] | None:
    if src.encode_backlog is None:
        return None
    waiting = src.encode_backlog()
    top = _top(waiting)
    return {"chars": sum(waiting.values()), "top_tenants": [{"tenant": t, "chars": n} for t, n in top]}


def _q(q: Quantiles) -> dict[str, float | None]:
    return {"p50": _r(q.p50), "p99": _r(q.p99)}


def _r(v: float | None, nd: int = 4) -> float | None:
    return None if v is None else round(v, nd)


def _classes(obs: Observer) -> list[dict[str, Any]]:
    now = obs.clock()
    inflight = obs.windows.inflight_all()
    out = []
    names = sorted(set(obs.windows.classes()) | set(obs.settings.slos))
    for name in names:
        slo = obs.settings.slos.get(name)
        series = [
            {
                "t": round(w.end - now, 3),
                "n": w.count,
                "errors": w.errors,
                "ttft_p50": _r(w.ttft.p50),
                "ttft_p99": _r(w.ttft.p99),
                "queue_wait_p99": _r(w.queue_wait.p99),
                "backend_p99": _r(w.backend.p99),
                "e2e_p99": _r(w.e2e.p99),
                "inflight_avg": round(w.inflight_tokens_avg, 1),
            }
            for w in obs.windows.history(name)
        ]
        recent = obs.windows.recent(name)
        out.append(
            {
                "name": name,
                "slo": {
                    "ttft_p99_s": slo.ttft_p99_s if slo else None,
                    "queue_wait_p99_s": slo.queue_wait_p99_s if slo else None,
                },
                "inflight_tokens": inflight.get(name, 0),
                "recent": {sig: _q(q) for sig, q in recent.items()},
                "series": series,
            }
        )
    return out


def _store(snap: StoreSnapshot | None) -> dict[str, Any]:
    if snap is None:
        return {"pools": [], "queues": {}, "tenants": [], "leases": None}
    pools, tenants = [], {}
    for st in snap.pools.values():
        kind, _, name = st.name.partition(":")
        if not name:
            kind, name = "pool", st.name
        entry = {
            "name": name,
            "kind": kind,
            "capacity": st.capacity,
            "in_flight": st.in_flight,
            "utilisation": round(st.in_flight / st.capacity, 4) if st.capacity else None,
        }
        if kind == "tenant":
            tenants[name] = entry
        else:
            pools.append(entry)
    names = set(tenants) | set(snap.tenant_queue_depth) | set(snap.virtual_service)
    tenant_rows = []
    for t in sorted(names):
        p = tenants.get(t, {})
        tenant_rows.append(
            {
                "name": t,
                "in_flight": p.get("in_flight", 0),
                "capacity": p.get("capacity"),
                "queued": snap.tenant_queue_depth.get(t, 0),
                "virtual_service": round(snap.virtual_service.get(t, 0.0), 1),
            }
        )
    pools.sort(key=lambda e: (e["kind"], e["name"]))
    return {"pools": pools, "queues": dict(snap.queue_depth), "tenants": tenant_rows, "leases": snap.leases}


def _backends(src: StatsSources) -> list[dict[str, Any]]:
    """Each backend's scraped load with its health (configured order; health alone when not scraped)."""
    loads = {(d["pool"], d["backend"]): d for d in (ld.as_dict() for ld in src.observer.loads)}
    if src.backend_health is None:
        return list(loads.values())
    out = []
    for h in src.backend_health():
        d = loads.pop((h.pool, h.backend), None)
        if d is None:
            d = {
                "pool": h.pool,
                "backend": h.backend,
                "flavor": None,
                "kv_usage": None,
                "running": None,
                "waiting": None,
                "preemptions_per_s": 0.0,
                "stale": False,
                "saturated": False,
                "penalty": 0.0,
                "age_s": None,
                "reason": "not scraped",
            }
        d["health"] = h.health
        d["consecutive_failures"] = h.consecutive_failures
        d["usage_reported"] = h.usage_reported
        d["usage_missing"] = h.usage_missing
        out.append(d)
    out.extend(loads.values())
    return out


def _gates(src: StatsSources) -> list[dict[str, Any]]:
    if src.backends is None:
        return []
    return [{"pool": b.pool, "backend": b.name, **b.gate.as_dict()} for b in src.backends() if b.gate]


def _samples(metric: Collector, suffix: str) -> list[tuple[dict[str, str], float]]:
    return [
        (dict(sm.labels), sm.value)
        for family in metric.collect()
        for sm in family.samples
        if sm.name.endswith(suffix)
    ]


def _ratio_rows(res: ReservationSources) -> list[dict[str, Any]]:
    """Per class and tenant: the used / reserved histogram (per-bucket counts), its mean and the
    bucket edges holding its median and p90, overdrafts and their tokens. Rows with nothing yet
    (a bound label set that saw no answer) are left out."""
    rows: dict[tuple[str, str], dict[str, Any]] = {}

    def row(labels: Mapping[str, str]) -> dict[str, Any]:
        key = (labels.get("class", ""), labels.get("tenant", ""))
        r = rows.get(key)
        if r is None:
            r = rows[key] = {
                "class": key[0], "tenant": key[1], "requests": 0, "sum": 0.0, "cumulative": [],
                "overdrafts": 0, "overdraft_tokens": 0,
            }  # fmt: skip
        return r

    for labels, v in _samples(res.ratio, "_bucket"):
        le = labels.pop("le", "+Inf")
        row(labels)["cumulative"].append((float(le), v))
    for labels, v in _samples(res.ratio, "_count"):
        row(labels)["requests"] = int(v)
    for labels, v in _samples(res.ratio, "_sum"):
        row(labels)["sum"] = v
    for labels, v in _samples(res.overdrafts, "_total"):
        row(labels)["overdrafts"] = int(v)
    for labels, v in _samples(res.overdraft_tokens, "_total"):
        row(labels)["overdraft_tokens"] = int(v)
    out = []
    for r in rows.values():
        if not r["requests"] and not r["overdrafts"]:
            continue
        cumulative = sorted(r.pop("cumulative"))
        n, total = r["requests"], r.pop("sum")
        histogram, below = [], 0.0
        for le, c in cumulative:
            histogram.append({"le": None if le == float("inf") else le, "count": int(c - below)})
            below = c
        r["histogram"] = histogram
        r["ratio_mean"] = _r(total / n) if n else None
        r["ratio_p50_le"] = _bucket_edge(cumulative, 0.5 * n) if n else None
        r["ratio_p90_le"] = _bucket_edge(cumulative, 0.9 * n) if n else None
        out.append(r)
    out.sort(key=lambda r: (r["class"], r["tenant"]))
    return out


def _bucket_edge(cumulative: Sequence[tuple[float, float]], rank: float) -> float | None:
    """The upper edge of the first bucket holding ``rank`` observations (None: above the last edge)."""
    for le, c in cumulative:
        if c >= rank:
            return None if le == float("inf") else le
    return None


def _reservations(res: ReservationSources | None, snap: StoreSnapshot | None) -> dict[str, Any] | None:
    """Estimate quality: used / reserved per class and tenant, overdrafts, lease growth, and per
    backend pool the share of capacity reservations hold beside what requests really occupy."""
    if res is None:
        return None
    res.flush()
    used = res.used_tokens()
    tight = set(res.tight_pools())
    pools: list[dict[str, Any]] = []
    for st in snap.pools.values() if snap is not None else ():
        kind, _, name = st.name.partition(":")
        if kind != "backend" or not name:
            continue
        occupied = used.get(name, 0)
        pools.append(
            {
                "pool": name,
                "capacity": st.capacity,
                "reserved": st.in_flight,
                "used": occupied,
                "reserved_share": round(st.in_flight / st.capacity, 4) if st.capacity else None,
                "used_share": round(occupied / st.capacity, 4) if st.capacity else None,
                "kv_feedback": name in tight,
            }
        )
    pools.sort(key=lambda p: p["pool"])
    extensions = {labels.get("class", ""): int(v) for labels, v in _samples(res.extensions, "_total") if v}
    return {
        "classes": _ratio_rows(res),
        "pools": pools,
        "extensions": dict(sorted(extensions.items())),
        "tight_pools": sorted(tight),
        "learned": [dict(x) for x in res.learned()],
    }


def _shape(src: StatsSources) -> list[dict[str, Any]]:
    obs = src.observer
    view = src.config_view() if src.config_view is not None else None
    out = []
    for r in obs.shape_readings():
        d = r.as_dict()
        d["plan"] = None
        if r.advice > 0 and view is not None:
            plan = split_plan(r.pool, obs.shape.samples(r.pool), view.classes, view.pools)
            d["plan"] = plan.as_dict() if plan is not None else None
        out.append(d)
    return out


def _one_server(src: StatsSources, gate_rows: Sequence[Mapping[str, Any]] = ()) -> list[OneServerPlan]:
    obs = src.observer
    view = src.config_view() if src.config_view is not None else ConfigView()
    h = obs.settings.hol
    return one_server_plans(
        obs.hol(),
        threshold=h.threshold,
        min_windows=h.min_windows,
        shape=obs.shape,
        pools=view.pools,
        loads=obs.loads,
        short_loads={k: _short_load(obs, k) for k in obs.windows.classes()},
        gates={g["backend"]: g for g in gate_rows},
    )


def _short_load(obs: Observer, klass: str) -> ShortLoad:
    """A class's admitted tokens per second over its closed windows and its recent p99 TTFT."""
    history = obs.windows.history(klass)
    span = sum(w.end - w.start for w in history)
    rate = sum(w.admitted_cost_sum for w in history) / span if span > 0 else None
    return ShortLoad(None, rate, obs.windows.recent(klass)["ttft"].p99)


class UnknownDomain(LookupError):
    """``/stats?domain=`` named no budget domain of this gateway."""


def _domains(snap: StoreSnapshot | None, where: Mapping[str, Any] | None) -> list[dict[str, Any]]:
    """Each budget domain's pools, queues, tenants and leases, and where it lives (budgets.domains)."""
    if snap is None or not snap.domains:
        return []
    described = (where or {}).get("domains") or {}
    return [{"name": d, "store": described.get(d), **_store(part)} for d, part in snap.domains.items()]


async def build_stats(src: StatsSources, domain: str | None = None) -> dict[str, Any]:
    """The whole page; ``domain`` narrows the store's sections (pools, queues, tenants, leases,
    ``store``) to that budget domain (UnknownDomain when it has none by that name)."""
    obs = src.observer
    obs.refresh()
    snap: StoreSnapshot | None = None
    store_error = None
    if src.snapshot is not None:
        try:
            snap = await src.snapshot()
        except Exception as e:  # the page must still render when the store is down
            store_error = f"{type(e).__name__}: {e}"
    where = dict(src.store()) if src.store is not None else None
    domains = _domains(snap, where)
    if domain is not None:
        names = [d["name"] for d in domains] or ["default"]
        if domain not in names:
            raise UnknownDomain(f"no budget domain {domain!r}; this gateway's domains: {', '.join(names)}")
        if snap is not None and snap.domains:
            snap = snap.domains[domain]
            where = ((where or {}).get("domains") or {}).get(domain)
        domains = [d for d in domains if d["name"] == domain]
    s = obs.settings
    gates = _gates(src)
    stats: dict[str, Any] = {
        "version": STATS_VERSION,
        "time": src.wall(),
        "uptime_s": round(obs.clock() - obs.started_at, 1),
        "window_s": s.window_s,
        "classes": _classes(obs),
        **_store(snap),
        "store_error": store_error,
        "backends": _backends(src),
        "prefill_gates": gates,
        "hol": {
            "threshold": s.hol.threshold,
            "lookback_windows": s.hol.lookback_windows,
            "min_windows": s.hol.min_windows,
            "pairs": [p.as_dict() for p in obs.hol()],
        },
        "shape": _shape(src),
        "one_server": [p.as_dict() for p in _one_server(src, gates)],
        "shape_thresholds": {"split_at": s.shape.split_at, "two_services_at": s.shape.two_services_at},
        "reservations": _reservations(src.reservations, snap),
        "held_bodies": _held_bodies(src),
        "encode_backlog": _encode_backlog(src),
        "estimates": dict(src.estimates()) if src.estimates is not None else None,
        "store": where,
        "domains": domains,
        "tenant_connections": _tenant_connections(src),
        "pricing": dict(src.prompt_overheads()) if src.prompt_overheads is not None else None,
        "limits": dict(src.limits()) if src.limits is not None else None,
    }
    stats["findings"] = [f.as_dict() for f in diagnose(stats)]
    return stats


def insights_yaml(src: StatsSources) -> str:
    """Every pool's split advice as YAML comments + the config edit, one document per pool; then,
    for a pool with head-of-line blocking and one backend, the one-server recipe."""
    obs = src.observer
    obs.refresh()
    view = src.config_view() if src.config_view is not None else ConfigView()
    docs = [p.to_yaml(view.pools) for p in _one_server(src, _gates(src))]
    for r in obs.shape_readings():
        if r.advice == 0:
            continue
        plan = split_plan(r.pool, obs.shape.samples(r.pool), view.classes, view.pools)
        if plan is not None:
            docs.append(plan.to_yaml(r))
    if not docs:
        rs = obs.shape_readings()
        lines = [
            f"# pool {r.pool!r}: largest/median = {r.ratio:.1f}x over {r.requests} requests ({r.advice_words})"
            for r in rs
            if r.ratio is not None
        ]
        return "\n".join(["# tokengate: no pool needs a split", *lines]) + "\n"
    return "---\n".join(docs)


def _json(data: Any, status: int = 200) -> Response:
    return Response(
        orjson.dumps(data, option=orjson.OPT_SERIALIZE_NUMPY),
        status_code=status,
        media_type="application/json",
        headers={"cache-control": "no-store"},
    )


def _dashboard_files() -> dict[str, tuple[bytes, str]]:
    base = resources.files("gateway.observe.dashboard")
    types = {".html": "text/html; charset=utf-8", ".js": "text/javascript", ".css": "text/css"}
    out: dict[str, tuple[bytes, str]] = {}
    for name in ("index.html", "app.js", "app.css"):
        out[name] = (base.joinpath(name).read_bytes(), types[name[name.rfind(".") :]])
    return out


def observe_routes(src: StatsSources) -> list[BaseRoute]:
    """``/stats``, ``/insights`` and ``/dashboard`` (+ its two assets) as Starlette routes."""
    files = _dashboard_files()

    async def stats(request: Request) -> Response:
        try:
            return _json(await build_stats(src, request.query_params.get("domain")))
        except UnknownDomain as exc:
            return _json(
                {
                    "error": {
                        "message": str(exc),
                        "type": "not_found",
                        "param": "domain",
                        "code": "domain_not_found",
                    }
                },
                404,
            )

    async def insights(request: Request) -> Response:
        text = insights_yaml(src)
        want_yaml = request.query_params.get("format") == "yaml" or "yaml" in request.headers.get(
            "accept", ""
        )
        if want_yaml:
            return Response(text, media_type="application/yaml", headers={"cache-control": "no-store"})
        st = await build_stats(src)
        return _json(
            {
                "shape": st["shape"],
                "hol": st["hol"],
                "one_server": st["one_server"],
                "findings": st["findings"],
                "yaml": text,
            }
        )

    async def page(request: Request) -> Response:
        name = request.path_params.get("name", "index.html")
        hit = files.get(name)
        if hit is None:
            return _json(
                {
                    "error": {
                        "message": f"no such file: {name}",
                        "type": "not_found",
                        "param": None,
                        "code": None,
                    }
                },
                404,
            )
        body, ctype = hit
        return Response(body, media_type=ctype, headers={"cache-control": "no-cache"})

    return [
        Route("/stats", stats, methods=["GET"]),
        Route("/insights", insights, methods=["GET"]),
        Route("/dashboard", page, methods=["GET"]),
        Route("/dashboard/{name}", page, methods=["GET"]),
    ]

"""Workload specification: tenants, request classes, arrival schedules, phases (YAML → frozen dataclasses).

A workload file looks like::

    name: example
    seed: 7
    duration_s: 30
    model: tokengate-sim
    tenants:
      chat:  {key: sk-chat, weight: 1, tier: standard, gateway: {budget_tokens: 120000}}
      noisy: {key: sk-noisy, weight: 1, tier: batch}
    classes:
      short:
        tenant: chat
        rate: 4                                   # Poisson arrivals per second
        prompt_tokens: {dist: lognormal, median: 1020, p99: 4142, max: 14050}
        output_tokens: {dist: lognormal, median: 129, p99: 601, max: 1000}
      reasoning:
        tenant: noisy
        rate: 0
        schedule: [{from_s: 10, to_s: 20, rate: 0.5}]   # the noisy burst
        prompt_tokens: 28000
        output_tokens: {dist: uniform, low: 300, high: 600}
      background:
        tenant: chat
        group: short                               # reported together with 'short'
        trace: {file: azure_llm_2023_conv.csv, start_s: 600, time_scale: 2, sample: 0.5}
    phases: {quiet: [[0, 10]], noisy: [[10, 20]]}  # windows of send time, for per-phase statistics
    fairness: {tenants: [chat, noisy], phase: noisy}
    send_max_tokens: planned                       # or a number (4096), or none

``send_max_tokens`` says what each request asks for as ``max_tokens``: ``planned`` (the default) is
the planned output length, which the backend then produces exactly (``ignore_eos``); a number or
``none`` sends what real clients send (a generous limit, or nothing) and asks for the planned length
with the reference backend's benchmark-only body field ``tokengate_stop_after`` instead (the answer
ends there as at an EOS). Every request also carries the header ``x-tokengate-oracle-output: <planned
output>``, which a gateway honours only with ``reservation.oracle_header`` (the oracle arm).

A tenant's ``gateway`` mapping is copied into the gateway's tenant config when the load tester
generates one (budget_tokens, default_max_tokens, ...); ``key``/``keys``, ``weight`` and ``tier`` are
copied too.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

from gateway.config.fields import mapping, number
from loadtest.distributions import (
    Empirical,
    LengthDist,
    LogNormal,
    SpecError,
    check_keys,
    parse_length_dist,
)
from loadtest.traces import (
    KNOWN_TRACE_FITS,
    TraceFit,
    TraceRecord,
    TraceWindow,
    load_trace,
    resolve_trace_path,
)

# What a request sends as max_tokens: the planned output, a fixed limit, or nothing.
SendMaxTokens = int | Literal["planned", "none"]


def parse_send_max_tokens(raw: object, where: str = "send_max_tokens") -> SendMaxTokens:
    """``planned``, ``none`` (or YAML null) or a positive integer (also as text, from the CLI)."""
    if raw is None or raw == "none":
        return "none"
    if raw == "planned":
        return "planned"
    if isinstance(raw, str) and raw.isdigit():
        raw = int(raw)
    if isinstance(raw, int) and not isinstance(raw, bool) and raw >= 1:
        return raw
    raise SpecError(f"{where}: expected planned, none or a positive integer, got {raw!r}")


@dataclass(frozen=True)
class TenantSpec:
    name: str
    keys: tuple[str, ...]
    weight: float = 1.0
    tier: str | None = None
    gateway: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class RateWindow:
    from_s: float
    to_s: float
    rate: float


@dataclass(frozen=True)
class TraceSource:
    """A trace-replayed class: arrivals and sizes from the file, or a synthetic fit when it is absent."""

    name: str
    window: TraceWindow
    records: tuple[TraceRecord, ...] | None  # the loaded file, None → synthetic stand-in
    fit: TraceFit | None


@dataclass(frozen=True)
class ClassSpec:
    name: str
    tenant: str
    group: str
    rate: float = 0.0
    windows: tuple[RateWindow, ...] = ()
    process: str = "poisson"  # or "constant": evenly spaced arrivals
    prompt: LengthDist | None = None
    output: LengthDist | None = None
    trace: TraceSource | None = None

    def rate_at(self, t: float) -> float:
        rate = self.rate
        for w in self.windows:  # later windows win where they overlap
            if w.from_s <= t < w.to_s:
                rate = w.rate
        return rate

    def segments(self, duration_s: float) -> list[tuple[float, float, float]]:
        """(start, end, rate) pieces of the piecewise-constant rate over [0, duration_s)."""
        edges = {0.0, duration_s}
        for w in self.windows:
            for edge in (w.from_s, w.to_s):
                if 0.0 < edge < duration_s:
                    edges.add(edge)
        ordered = sorted(edges)
        return [(a, b, self.rate_at((a + b) / 2)) for a, b in itertools.pairwise(ordered)]


@dataclass(frozen=True)
class Phase:
    name: str
    windows: tuple[tuple[float, float], ...]

    def contains(self, t: float) -> bool:
        return any(a <= t < b for a, b in self.windows)


@dataclass(frozen=True)
class FairnessSpec:
    tenants: tuple[str, ...]
    phase: str | None = None


@dataclass(frozen=True)
class IsolationSpec:
    """How well each target shields a victim group from a noisy one (report table, no effect on load).

    ``solo`` maps a target to the run of the victim alone on the same engine settings; ``direct`` is
    the target whose generated tokens/s is the throughput baseline; ``phase`` limits the victim's
    statistics to requests sent in that phase (default: the whole run).
    """

    victim: str
    noisy: str
    solo: Mapping[str, str]
    direct: str | None = None
    phase: str | None = None


@dataclass(frozen=True)
class WorkloadSpec:
    name: str
    seed: int
    duration_s: float
    tenants: Mapping[str, TenantSpec]
    classes: tuple[ClassSpec, ...]
    max_requests: int | None = None
    model: str = "tokengate-sim"
    endpoint: str = "chat"  # or "completions"
    request_timeout_s: float = 300.0
    drain_timeout_s: float = 120.0
    # Tokens the chat template adds around one user message (3 per message + 3 priming, the gateway's
    # and the reference backend's convention); subtracted so the rendered prompt has the planned size.
    chat_overhead_tokens: int = 7
    send_max_tokens: SendMaxTokens = "planned"
    phases: tuple[Phase, ...] = ()
    fairness: FairnessSpec | None = None
    isolation: IsolationSpec | None = None
    description: str = ""

    @property
    def groups(self) -> list[str]:
        return list(dict.fromkeys(c.group for c in self.classes))

    def phase(self, name: str) -> Phase:
        for p in self.phases:
            if p.name == name:
                return p
        raise SpecError(f"unknown phase {name!r}; phases: {[p.name for p in self.phases]}")

    def scaled(self, *, rate_scale: float = 1.0, duration_s: float | None = None) -> WorkloadSpec:
        """A copy with every synthetic rate multiplied (trace classes are thinned) and/or a new duration."""
        classes = []
        for c in self.classes:
            if c.trace is not None:
                window = replace(c.trace.window, sample=min(1.0, c.trace.window.sample * rate_scale))
                fit = c.trace.fit
                if fit is not None and c.trace.records is None:
                    fit = replace(fit, rate_per_s=fit.rate_per_s * rate_scale)
                classes.append(replace(c, trace=replace(c.trace, window=window, fit=fit)))
            else:
                windows = tuple(replace(w, rate=w.rate * rate_scale) for w in c.windows)
                classes.append(replace(c, rate=c.rate * rate_scale, windows=windows))
        return replace(
            self,
            classes=tuple(classes),
            duration_s=self.duration_s if duration_s is None else duration_s,
        )


_WORKLOAD_KEYS = [
    "name",
    "description",
    "seed",
    "duration_s",
    "max_requests",
    "model",
    "endpoint",
    "request_timeout_s",
    "drain_timeout_s",
    "chat_overhead_tokens",
    "send_max_tokens",
    "tenants",
    "classes",
    "phases",
    "fairness",
    "isolation",
]


def _number(raw: Mapping[str, Any], key: str, where: str, default: float | None = None) -> float:
    return number(raw, key, where, default, minimum=0.0)


def _parse_tenant(name: str, raw: Any) -> TenantSpec:
    where = f"tenants.{name}"
    d = mapping(raw, where)
    check_keys(d, ["key", "keys", "weight", "tier", "gateway"], where)
    if "key" in d and "keys" in d:
        raise SpecError(f"{where}: give either 'key' or 'keys', not both")
    keys_raw = [d["key"]] if "key" in d else d.get("keys", [f"sk-{name}"])
    if not isinstance(keys_raw, list) or not keys_raw or not all(isinstance(k, str) and k for k in keys_raw):
        raise SpecError(f"{where}.keys: expected a non-empty list of strings, got {keys_raw!r}")
    weight = _number(d, "weight", where, 1.0)
    if weight <= 0:
        raise SpecError(f"{where}.weight: expected a positive number, got {weight}")
    tier = d.get("tier")
    if tier is not None and not isinstance(tier, str):
        raise SpecError(f"{where}.tier: expected a string, got {tier!r}")
    gateway = mapping(d.get("gateway", {}), f"{where}.gateway")
    return TenantSpec(name, tuple(keys_raw), weight, tier, dict(gateway))


def _parse_windows(raw: Any, where: str) -> tuple[RateWindow, ...]:
    if not isinstance(raw, list):
        raise SpecError(f"{where}: expected a list of {{from_s, to_s, rate}}, got {raw!r}")
    out = []
    for i, item in enumerate(raw):
        w_where = f"{where}[{i}]"
        d = mapping(item, w_where)
        check_keys(d, ["from_s", "to_s", "rate"], w_where)
        from_s, to_s = _number(d, "from_s", w_where), _number(d, "to_s", w_where)
        if to_s <= from_s:
            raise SpecError(f"{w_where}: to_s ({to_s}) must be after from_s ({from_s})")
        out.append(RateWindow(from_s, to_s, _number(d, "rate", w_where)))
    return tuple(out)


def _trace_column(
    raw: Mapping[str, Any], where: str, base_dir: Path | None, synthetic: bool
) -> tuple[list[int] | None, LengthDist | None]:
    """For ``{dist: trace, file, column: prompt|output, size_scale?}``: the column, or a fitted stand-in."""
    check_keys(raw, ["dist", "file", "column", "size_scale"], where)
    name = raw.get("file")
    column = raw.get("column", "prompt")
    if not isinstance(name, str) or column not in ("prompt", "output"):
        raise SpecError(f"{where}: 'dist: trace' needs 'file' and 'column: prompt|output'")
    scale = _number(raw, "size_scale", where, 1.0)
    path = None if synthetic else resolve_trace_path(name, base_dir)
    if path is not None:
        recs = load_trace(path)
        values = [r.prompt_tokens if column == "prompt" else r.output_tokens for r in recs]
        return [max(1, round(v * scale)) for v in values], None
    fit = KNOWN_TRACE_FITS.get(Path(name).name)
    if fit is None:
        raise SpecError(f"{where}: trace file {name!r} not found and no built-in fit for it")
    dist: LogNormal = fit.prompt if column == "prompt" else fit.output
    return None, dist.scaled(scale)


def _parse_dist(raw: Any, where: str, base_dir: Path | None, synthetic: bool) -> LengthDist:
    if isinstance(raw, Mapping) and raw.get("dist") == "trace":
        values, stand_in = _trace_column(raw, where, base_dir, synthetic)
        if stand_in is not None:
            return stand_in
        return Empirical(tuple(values or ()), source=f"trace {raw.get('file')}")
    return parse_length_dist(raw, where)


def _parse_trace(raw: Any, where: str, base_dir: Path | None, synthetic: bool) -> TraceSource:
    d = mapping(raw, where)
    check_keys(
        d,
        ["file", "start_s", "time_scale", "size_scale", "sample", "max_prompt_tokens", "max_output_tokens"],
        where,
    )
    name = d.get("file")
    if not isinstance(name, str):
        raise SpecError(f"{where}.file: expected a trace file name, got {name!r}")
    window = TraceWindow(
        start_s=_number(d, "start_s", where, 0.0),
        time_scale=_number(d, "time_scale", where, 1.0) or 1.0,
        size_scale=_number(d, "size_scale", where, 1.0) or 1.0,
        sample=min(1.0, _number(d, "sample", where, 1.0)),
        max_prompt_tokens=int(d["max_prompt_tokens"]) if "max_prompt_tokens" in d else None,
        max_output_tokens=int(d["max_output_tokens"]) if "max_output_tokens" in d else None,
    )
    path = None if synthetic else resolve_trace_path(name, base_dir)
    fit = KNOWN_TRACE_FITS.get(Path(name).name)
    if path is None and fit is None:
        raise SpecError(f"{where}.file: trace {name!r} not found and no built-in synthetic fit for it")
    records = tuple(load_trace(path)) if path is not None else None
    return TraceSource(name=Path(name).name, window=window, records=records, fit=fit)


def _parse_class(
    name: str, raw: Any, tenants: Mapping[str, TenantSpec], base_dir: Path | None, synthetic: bool
) -> ClassSpec:
    where = f"classes.{name}"
    d = mapping(raw, where)
    check_keys(
        d,
        ["tenant", "group", "rate", "schedule", "process", "prompt_tokens", "output_tokens", "trace"],
        where,
    )
    tenant = d.get("tenant")
    if tenant not in tenants:
        raise SpecError(f"{where}.tenant: {tenant!r} is not a configured tenant ({sorted(tenants)})")
    group = d.get("group", name)
    if not isinstance(group, str):
        raise SpecError(f"{where}.group: expected a string, got {group!r}")
    process = d.get("process", "poisson")
    if process not in ("poisson", "constant"):
        raise SpecError(f"{where}.process: expected poisson or constant, got {process!r}")
    if "trace" in d:
        extra = sorted(set(d) & {"rate", "schedule", "prompt_tokens", "output_tokens", "process"})
        if extra:
            raise SpecError(
                f"{where}: a trace-replayed class takes its arrivals and sizes from the trace; drop {extra}"
            )
        trace = _parse_trace(d["trace"], f"{where}.trace", base_dir, synthetic)
        return ClassSpec(name=name, tenant=str(tenant), group=group, trace=trace)
    for key in ("prompt_tokens", "output_tokens"):
        if key not in d:
            raise SpecError(f"{where}.{key}: required")
    windows = _parse_windows(d["schedule"], f"{where}.schedule") if "schedule" in d else ()
    if "rate" not in d and not windows:
        raise SpecError(f"{where}: give 'rate' and/or 'schedule'")
    return ClassSpec(
        name=name,
        tenant=str(tenant),
        group=group,
        rate=_number(d, "rate", where, 0.0),
        windows=windows,
        process=process,
        prompt=_parse_dist(d["prompt_tokens"], f"{where}.prompt_tokens", base_dir, synthetic),
        output=_parse_dist(d["output_tokens"], f"{where}.output_tokens", base_dir, synthetic),
    )


def _parse_phases(raw: Any) -> tuple[Phase, ...]:
    d = mapping(raw, "phases")
    out = []
    for name, windows in d.items():
        where = f"phases.{name}"
        if not isinstance(windows, list) or not windows:
            raise SpecError(f"{where}: expected a list of [from_s, to_s] pairs")
        pairs = []
        for w in windows:
            if not (isinstance(w, list) and len(w) == 2 and all(isinstance(x, int | float) for x in w)):
                raise SpecError(f"{where}: expected [from_s, to_s], got {w!r}")
            if w[1] <= w[0]:
                raise SpecError(f"{where}: window {w} ends before it starts")
            pairs.append((float(w[0]), float(w[1])))
        out.append(Phase(str(name), tuple(pairs)))
    return tuple(out)


def parse_workload(
    raw: Mapping[str, Any], *, base_dir: Path | None = None, synthetic: bool = False
) -> WorkloadSpec:
    """Validates a workload mapping. ``synthetic`` ignores trace files and uses their fitted stand-ins."""
    check_keys(raw, [*_WORKLOAD_KEYS, "setup", "checks", "summary"], "workload")
    tenants_raw = mapping(raw.get("tenants"), "tenants")
    tenants = {str(name): _parse_tenant(str(name), t) for name, t in tenants_raw.items()}
    if not tenants:
        raise SpecError("tenants: at least one tenant is required")
    classes_raw = mapping(raw.get("classes"), "classes")
    classes = tuple(_parse_class(str(n), c, tenants, base_dir, synthetic) for n, c in classes_raw.items())
    if not classes:
        raise SpecError("classes: at least one request class is required")
    seed = raw.get("seed", 0)
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise SpecError(f"seed: expected an integer, got {seed!r}")
    duration = _number(raw, "duration_s", "workload", None) if "duration_s" in raw else None
    if not duration:
        raise SpecError("duration_s: required, a positive number of seconds")
    max_requests = raw.get("max_requests")
    if max_requests is not None and (not isinstance(max_requests, int) or max_requests < 1):
        raise SpecError(f"max_requests: expected a positive integer, got {max_requests!r}")
    endpoint = raw.get("endpoint", "chat")
    if endpoint not in ("chat", "completions"):
        raise SpecError(f"endpoint: expected chat or completions, got {endpoint!r}")
    phases = _parse_phases(raw["phases"]) if "phases" in raw else ()
    fairness = None
    if "fairness" in raw:
        f = mapping(raw["fairness"], "fairness")
        check_keys(f, ["tenants", "phase"], "fairness")
        names = f.get("tenants", list(tenants))
        if not isinstance(names, list) or any(n not in tenants for n in names) or len(names) < 2:
            raise SpecError(f"fairness.tenants: expected two or more configured tenants, got {names!r}")
        phase = f.get("phase")
        if phase is not None and phase not in {p.name for p in phases}:
            raise SpecError(f"fairness.phase: {phase!r} is not a phase ({[p.name for p in phases]})")
        fairness = FairnessSpec(tuple(names), phase)
    isolation = _parse_isolation(raw["isolation"], classes, phases) if "isolation" in raw else None
    return WorkloadSpec(
        name=str(raw.get("name", "workload")),
        description=str(raw.get("description", "")),
        seed=seed,
        duration_s=duration,
        tenants=tenants,
        classes=classes,
        max_requests=max_requests,
        model=str(raw.get("model", "tokengate-sim")),
        endpoint=endpoint,
        request_timeout_s=_number(raw, "request_timeout_s", "workload", 300.0),
        drain_timeout_s=_number(raw, "drain_timeout_s", "workload", 120.0),
        chat_overhead_tokens=int(_number(raw, "chat_overhead_tokens", "workload", 7)),
        send_max_tokens=parse_send_max_tokens(raw.get("send_max_tokens", "planned")),
        phases=phases,
        fairness=fairness,
        isolation=isolation,
    )


def _parse_isolation(raw: Any, classes: tuple[ClassSpec, ...], phases: tuple[Phase, ...]) -> IsolationSpec:
    d = mapping(raw, "isolation")
    check_keys(d, ["victim", "noisy", "solo", "direct", "phase"], "isolation")
    groups = list(dict.fromkeys(c.group for c in classes))
    for key in ("victim", "noisy"):
        if d.get(key) not in groups:
            raise SpecError(f"isolation.{key}: expected a request group ({groups}), got {d.get(key)!r}")
    solo = mapping(d.get("solo", {}), "isolation.solo")
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in solo.items()):
        raise SpecError("isolation.solo: expected {target: solo target} names")
    phase = d.get("phase")
    if phase is not None and phase not in {p.name for p in phases}:
        raise SpecError(f"isolation.phase: {phase!r} is not a phase ({[p.name for p in phases]})")
    direct = d.get("direct")
    return IsolationSpec(
        victim=str(d["victim"]),
        noisy=str(d["noisy"]),
        solo=dict(solo),
        direct=None if direct is None else str(direct),
        phase=None if phase is None else str(phase),
    )


def class_rng(seed: int, class_name: str) -> random.Random:
    """One generator per class, so adding a class never changes another class's arrivals."""
    return random.Random(f"{seed}:class:{class_name}")

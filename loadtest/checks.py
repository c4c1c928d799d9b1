"""Pass/fail checks a scenario states about its results (e.g. "shared-pool short p99 TTFT <= 1/5 direct").

A ratio check compares one number to a baseline number::

    - name: short p99 TTFT through tokengate vs direct
      metric: ttft_p99_s          # a per-group statistic, or tokens_per_s without a group for the total
      group: short
      target: tokengate-shared
      phase: noisy                # optional; statistics of requests sent in that phase
      baseline: {target: direct}  # defaults to the same target and phase
      max_ratio: 0.2              # and/or min_ratio

A value check bounds one number (``min`` and/or ``max``)::

    - {name: preemptions on at most 1 % of requests, kind: value, metric: preemptions_per_request,
       target: learned, max: 0.01}
    - {name: noisy queue wait, kind: value, metric: queue_p99_ms, group: noisy, target: all, max: 10000}
    - {name: every request completed, kind: value, metric: failed, target: all, max: 0}

A fairness check compares each fairness tenant's share of served tokens with its weight's share::

    - {name: fair shares, kind: fairness, target: tokengate, tolerance: 0.10}
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from loadtest.distributions import SpecError, check_keys
from loadtest.records import RunResult
from loadtest.spec import WorkloadSpec
from loadtest.stats import GroupStats, fair_shares, group_stats, totals

_GROUP_METRICS = {f for f in GroupStats.__dataclass_fields__ if f not in ("group", "errors")}
_TOTAL_METRICS = {
    "tokens_per_s",
    "completion_tokens",
    "ok",
    "requests",
    "failed",
    "preemptions",
    "preemptions_per_request",
    "reserved_output_ratio",
}


@dataclass(frozen=True)
class CheckSpec:
    name: str
    kind: str  # "ratio", "value" or "fairness"
    target: str
    metric: str = ""
    group: str | None = None
    phase: str | None = None
    baseline_target: str | None = None
    baseline_phase: str | None = None
    min_ratio: float | None = None
    max_ratio: float | None = None
    tolerance: float = 0.10
    min_value: float | None = None  # kind value
    max_value: float | None = None


@dataclass(frozen=True)
class CheckResult:
    name: str
    met: bool | None  # None: could not be evaluated (missing target or no samples)
    summary: str  # the numbers, for humans

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "met": self.met, "summary": self.summary}

    def line(self) -> str:
        verdict = {True: "met", False: "NOT met", None: "n/a"}[self.met]
        return f"[{verdict:>7}] {self.name}: {self.summary}"


def parse_checks(raw: Any, spec: WorkloadSpec) -> tuple[CheckSpec, ...]:
    if raw is None:
        return ()
    if not isinstance(raw, list):
        raise SpecError("checks: expected a list")
    phases = {p.name for p in spec.phases}
    out = []
    for i, item in enumerate(raw):
        where = f"checks[{i}]"
        if not isinstance(item, Mapping):
            raise SpecError(f"{where}: expected a mapping")
        kind = item.get("kind", "ratio")
        if kind == "fairness":
            check_keys(item, ["name", "kind", "target", "tolerance"], where)
            if spec.fairness is None:
                raise SpecError(f"{where}: a fairness check needs a 'fairness' section")
            out.append(
                CheckSpec(
                    name=str(item.get("name", "fair shares")),
                    kind="fairness",
                    target=str(item.get("target", "")),
                    tolerance=float(item.get("tolerance", 0.10)),
                )
            )
            continue
        if kind == "value":
            out.append(_parse_value_check(item, where, spec))
            continue
        if kind != "ratio":
            raise SpecError(f"{where}.kind: expected ratio, value or fairness, got {kind!r}")
        check_keys(
            item,
            ["name", "kind", "metric", "group", "target", "phase", "baseline", "min_ratio", "max_ratio"],
            where,
        )
        metric, group = parse_metric(item, where, spec)
        baseline = item.get("baseline", {}) or {}
        if not isinstance(baseline, Mapping):
            raise SpecError(f"{where}.baseline: expected a mapping with target and/or phase")
        check_keys(baseline, ["target", "phase"], f"{where}.baseline")
        for ph in (item.get("phase"), baseline.get("phase")):
            if ph is not None and ph not in phases:
                raise SpecError(f"{where}: unknown phase {ph!r} ({sorted(phases)})")
        if item.get("min_ratio") is None and item.get("max_ratio") is None:
            raise SpecError(f"{where}: give min_ratio and/or max_ratio")
        out.append(
            CheckSpec(
                name=str(item.get("name", f"{metric} {group or 'total'}")),
                kind="ratio",
                target=str(item.get("target", "")),
                metric=str(metric),
                group=group,
                phase=item.get("phase"),
                baseline_target=baseline.get("target"),
                baseline_phase=baseline.get("phase"),
                min_ratio=None if item.get("min_ratio") is None else float(item["min_ratio"]),
                max_ratio=None if item.get("max_ratio") is None else float(item["max_ratio"]),
            )
        )
    return tuple(out)


def parse_metric(item: Mapping[str, Any], where: str, spec: WorkloadSpec) -> tuple[str, str | None]:
    metric, group = item.get("metric"), item.get("group")
    allowed = _GROUP_METRICS if group is not None else _TOTAL_METRICS
    if metric not in allowed:
        raise SpecError(f"{where}.metric: expected one of {sorted(allowed)}, got {metric!r}")
    if group is not None and group not in spec.groups:
        raise SpecError(f"{where}.group: {group!r} is not a request group ({spec.groups})")
    return str(metric), group


def _parse_value_check(item: Mapping[str, Any], where: str, spec: WorkloadSpec) -> CheckSpec:
    check_keys(item, ["name", "kind", "metric", "group", "target", "phase", "min", "max"], where)
    metric, group = parse_metric(item, where, spec)
    phase = item.get("phase")
    if phase is not None and phase not in {p.name for p in spec.phases}:
        raise SpecError(f"{where}: unknown phase {phase!r}")
    bounds = {}
    for key in ("min", "max"):
        v = item.get(key)
        if v is not None and (not isinstance(v, int | float) or isinstance(v, bool)):
            raise SpecError(f"{where}.{key}: expected a number, got {v!r}")
        bounds[key] = None if v is None else float(v)
    if bounds["min"] is None and bounds["max"] is None:
        raise SpecError(f"{where}: give min and/or max")
    return CheckSpec(
        name=str(item.get("name", f"{metric} {group or 'total'}")),
        kind="value",
        target=str(item.get("target", "")),
        metric=metric,
        group=group,
        phase=phase,
        min_value=bounds["min"],
        max_value=bounds["max"],
    )


def metric_value(
    run: RunResult, spec: WorkloadSpec, metric: str, group: str | None, phase: str | None
) -> float | None:
    if group is None:
        total = getattr(totals(run), metric)
        return None if total is None else float(total)
    stats = group_stats(run, [group], spec.phase(phase) if phase else None)[group]
    value = getattr(stats, metric)
    return None if value is None else float(value)


def format_metric(metric: str, value: float) -> str:
    if metric.endswith("_ms"):
        return f"{value / 1000:.1f} s" if value >= 10_000 else f"{value:,.0f} ms"
    if metric.endswith("_s") and not metric.endswith("per_s"):
        return f"{value * 1000:.0f} ms" if value < 10 else f"{value:.1f} s"
    if metric.endswith("per_request"):
        return f"{value:.2%}"
    return f"{value:,.1f}"


def _where(target: str, phase: str | None) -> str:
    return f"{target}" + (f" ({phase})" if phase else "")


def evaluate(check: CheckSpec, runs: Sequence[RunResult], spec: WorkloadSpec) -> CheckResult:
    by_name = {r.target: r for r in runs}
    run = by_name.get(check.target)
    if run is None:
        return CheckResult(check.name, None, f"target {check.target!r} was not run")
    if check.kind == "fairness":
        shares = fair_shares(run, spec)
        if not shares or sum(s.served_tokens for s in shares) == 0:
            return CheckResult(check.name, None, "no tokens served to the fairness tenants")
        met = all(s.relative_error <= check.tolerance for s in shares)
        parts = [
            f"{s.tenant} {s.share:.1%} vs weight {s.weight_share:.1%} (off {s.relative_error:.1%})"
            for s in shares
        ]
        return CheckResult(check.name, met, "; ".join(parts) + f"; tolerance {check.tolerance:.0%}")
    if check.kind == "value":
        value = metric_value(run, spec, check.metric, check.group, check.phase)
        if value is None:
            return CheckResult(check.name, None, f"no value for {check.metric}")
        met = (check.min_value is None or value >= check.min_value) and (
            check.max_value is None or value <= check.max_value
        )
        want = []
        if check.min_value is not None:
            want.append(f">= {format_metric(check.metric, check.min_value)}")
        if check.max_value is not None:
            want.append(f"<= {format_metric(check.metric, check.max_value)}")
        where = _where(check.target, check.phase)
        return CheckResult(
            check.name, met, f"{format_metric(check.metric, value)} [{where}] (want {' and '.join(want)})"
        )
    base_target = check.baseline_target or check.target
    base_phase = check.baseline_phase if check.baseline_phase is not None else check.phase
    base_run = by_name.get(base_target)
    if base_run is None:
        return CheckResult(check.name, None, f"baseline target {base_target!r} was not run")
    value = metric_value(run, spec, check.metric, check.group, check.phase)
    base = metric_value(base_run, spec, check.metric, check.group, base_phase)
    if value is None or base is None or base == 0:
        return CheckResult(check.name, None, f"no samples (value {value}, baseline {base})")
    ratio = value / base
    met = (check.min_ratio is None or ratio >= check.min_ratio) and (
        check.max_ratio is None or ratio <= check.max_ratio
    )
    bounds = []
    if check.min_ratio is not None:
        bounds.append(f">= {check.min_ratio:g}")
    if check.max_ratio is not None:
        bounds.append(f"<= {check.max_ratio:g}")
    summary = (
        f"{format_metric(check.metric, value)} [{_where(check.target, check.phase)}] vs "
        f"{format_metric(check.metric, base)} [{_where(base_target, base_phase)}] = {ratio:.2f}x (want {' and '.join(bounds)})"
    )
    return CheckResult(check.name, met, summary)


def evaluate_all(
    checks: Sequence[CheckSpec], runs: Sequence[RunResult], spec: WorkloadSpec
) -> list[CheckResult]:
    return [evaluate(c, runs, spec) for c in checks]

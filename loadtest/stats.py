"""Summary statistics of a run: per-group latency percentiles, throughput, time series and fair shares."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from gateway.observe.percentile import percentile
from loadtest.records import RequestRecord, RunResult
from loadtest.spec import Phase, WorkloadSpec


@dataclass(frozen=True)
class GroupStats:
    group: str
    requests: int
    ok: int
    errors: dict[str, int]
    ttft_p50_s: float | None
    ttft_p90_s: float | None
    ttft_p99_s: float | None
    e2e_p50_s: float | None
    e2e_p99_s: float | None
    e2e_mean_s: float | None
    itl_p50_s: float | None
    itl_p99_s: float | None
    queue_p99_ms: float | None  # the gateway's x-tokengate-queue-ms, when it sent one
    completion_tokens: int
    tokens_per_s: float  # completion tokens ÷ the run's elapsed time

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def _group_stats(group: str, records: Sequence[RequestRecord], elapsed_s: float) -> GroupStats:
    ok = [r for r in records if r.ok]
    ttft = [r.ttft_s for r in ok if r.ttft_s is not None]
    e2e = [r.e2e_s for r in ok if r.e2e_s is not None]
    gaps = [g for r in ok for g in r.inter_token_gaps()]
    queue = [r.gateway_queue_ms for r in records if r.gateway_queue_ms is not None]
    errors = Counter(r.error for r in records if r.error is not None)
    tokens = sum(r.completion_tokens for r in ok)
    return GroupStats(
        group=group,
        requests=len(records),
        ok=len(ok),
        errors=dict(sorted((str(k), v) for k, v in errors.items())),
        ttft_p50_s=percentile(ttft, 50),
        ttft_p90_s=percentile(ttft, 90),
        ttft_p99_s=percentile(ttft, 99),
        e2e_p50_s=percentile(e2e, 50),
        e2e_p99_s=percentile(e2e, 99),
        e2e_mean_s=sum(e2e) / len(e2e) if e2e else None,
        itl_p50_s=percentile(gaps, 50),
        itl_p99_s=percentile(gaps, 99),
        queue_p99_ms=percentile(queue, 99),
        completion_tokens=tokens,
        tokens_per_s=tokens / elapsed_s if elapsed_s > 0 else 0.0,
    )


def group_stats(run: RunResult, groups: Iterable[str], phase: Phase | None = None) -> dict[str, GroupStats]:
    """Per-group statistics; with a phase, only requests scheduled inside its windows count."""
    records = [r for r in run.records if phase is None or phase.contains(r.scheduled_s)]
    return {g: _group_stats(g, [r for r in records if r.group == g], run.elapsed_s) for g in groups}


@dataclass(frozen=True)
class Totals:
    requests: int
    ok: int
    failed: int  # requests - ok: errors, timeouts, requests cut off at the drain deadline
    errors: dict[str, int]
    completion_tokens: int
    tokens_per_s: float
    elapsed_s: float
    max_send_lateness_s: float  # how far behind schedule the generator fell (should stay small)
    preemptions: float | None  # counted by the backends during the run (None: not measured)
    preemptions_per_request: float | None  # preemptions / requests: >= the share of requests preempted
    # Output tokens a gateway reserved at admission (x-tokengate-cost less the prompt's tokens) per
    # token generated, over the successful requests that say both; None without a gateway.
    reserved_output_ratio: float | None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def totals(run: RunResult) -> Totals:
    ok = [r for r in run.records if r.ok]
    tokens = sum(r.completion_tokens for r in ok)
    lateness = max((r.sent_s - r.scheduled_s for r in run.records), default=0.0)
    preempted = run.backend_preemptions
    return Totals(
        requests=len(run.records),
        ok=len(ok),
        failed=len(run.records) - len(ok),
        errors=dict(sorted(Counter(str(r.error) for r in run.records if r.error is not None).items())),
        completion_tokens=tokens,
        tokens_per_s=tokens / run.elapsed_s if run.elapsed_s > 0 else 0.0,
        elapsed_s=run.elapsed_s,
        max_send_lateness_s=lateness,
        preemptions=preempted,
        preemptions_per_request=preempted / len(run.records)
        if preempted is not None and run.records
        else None,
        reserved_output_ratio=_reserved_output_ratio(ok),
    )


def _reserved_output_ratio(ok: Sequence[RequestRecord]) -> float | None:
    reserved = generated = 0
    for r in ok:
        if r.gateway_cost is not None and r.prompt_tokens is not None:
            reserved += max(0, r.gateway_cost - r.prompt_tokens)
            generated += r.completion_tokens
    return reserved / generated if generated else None


def fingerprint_window(horizon_s: float) -> tuple[float, float]:
    """(window, step) for the p99-over-time series: about 10 windows per run, between 0.25 s and 4 s."""
    window = max(0.25, min(4.0, horizon_s / 10))
    return window, window / 4


def p99_over_time(
    run: RunResult,
    group: str,
    *,
    window_s: float | None = None,
    step_s: float | None = None,
    min_samples: int = 3,
) -> list[tuple[float, float]]:
    """(time, p99 TTFT) over a sliding window of send times: the head-of-line fingerprint series."""
    points = sorted(
        (r.sent_s, r.ttft_s) for r in run.records if r.group == group and r.ok and r.ttft_s is not None
    )
    if not points:
        return []
    if window_s is None or step_s is None:
        auto_window, auto_step = fingerprint_window(max(r.scheduled_s for r in run.records))
        window_s = auto_window if window_s is None else window_s
        step_s = auto_step if step_s is None else step_s
    out: list[tuple[float, float]] = []
    end = points[-1][0]
    t = window_s
    while t <= end + step_s:
        inside = [ttft for sent, ttft in points if t - window_s <= sent < t]
        if len(inside) >= min_samples:
            value = percentile(inside, 99)
            assert value is not None
            out.append((t - window_s / 2, value))
        t += step_s
    return out


@dataclass(frozen=True)
class TenantShare:
    tenant: str
    weight: float
    served_tokens: float
    share: float
    weight_share: float

    @property
    def relative_error(self) -> float:
        return abs(self.share - self.weight_share) / self.weight_share if self.weight_share else 0.0

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "relative_error": self.relative_error}


def _served_in(rec: RequestRecord, windows: Sequence[tuple[float, float]] | None) -> float:
    """Tokens served to a request inside the windows: its prompt at first token, each output chunk as it arrives."""
    if not rec.token_times:
        return 0.0

    def inside(t: float) -> bool:
        return windows is None or any(a <= t < b for a, b in windows)

    prompt = rec.prompt_tokens if rec.prompt_tokens is not None else rec.planned_prompt_tokens
    per_chunk = rec.completion_tokens / len(rec.token_times) if rec.completion_tokens else 1.0
    served = float(prompt) if inside(rec.token_times[0]) else 0.0
    return served + per_chunk * sum(1 for t in rec.token_times if inside(t))


def fair_shares(run: RunResult, spec: WorkloadSpec) -> list[TenantShare]:
    """Each fairness tenant's share of served tokens (prompt + output) next to its weight's share.

    Counted by when tokens were delivered, inside the fairness phase (when the tenants are backlogged),
    so requests still queued at the end do not distort it.
    """
    if spec.fairness is None:
        return []
    names = spec.fairness.tenants
    windows = spec.phase(spec.fairness.phase).windows if spec.fairness.phase else None
    served = dict.fromkeys(names, 0.0)
    for rec in run.records:
        if rec.tenant in served:
            served[rec.tenant] += _served_in(rec, windows)
    total = sum(served.values())
    weight_total = sum(spec.tenants[n].weight for n in names)
    return [
        TenantShare(
            tenant=n,
            weight=spec.tenants[n].weight,
            served_tokens=served[n],
            share=served[n] / total if total else 0.0,
            weight_share=spec.tenants[n].weight / weight_total,
        )
        for n in names
    ]

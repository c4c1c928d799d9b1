"""The isolation table: per target, the victim's latency against the victim alone on the same engine
settings, and what the noisy tenant got (completed requests, TTFT, gateway queue wait).

Driven by a scenario's ``isolation`` section (see :class:`loadtest.spec.IsolationSpec`); a report
section, it changes nothing about the load.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from loadtest.records import RunResult
from loadtest.spec import IsolationSpec, WorkloadSpec
from loadtest.stats import GroupStats, group_stats, totals


@dataclass(frozen=True)
class IsolationRow:
    target: str
    solo: str | None
    victim_requests: int
    victim_ok: int
    victim_ttft_p50_s: float | None
    victim_ttft_p99_s: float | None
    victim_ttft_p99_vs_solo: float | None
    victim_itl_p99_s: float | None
    victim_itl_p99_vs_solo: float | None
    noisy_requests: int
    noisy_ok: int
    noisy_ttft_p50_s: float | None
    noisy_ttft_p99_s: float | None
    noisy_queue_p99_s: float | None  # None when the target sent no x-tokengate-queue-ms (direct)
    tokens_per_s: float
    tokens_per_s_vs_direct: float | None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or b == 0 else a / b


def isolation_rows(spec: WorkloadSpec, runs: Sequence[RunResult]) -> list[IsolationRow]:
    iso: IsolationSpec | None = spec.isolation
    if iso is None:
        return []
    phase = spec.phase(iso.phase) if iso.phase else None
    by_name = {r.target: r for r in runs}

    def victim(run: RunResult) -> GroupStats:
        return group_stats(run, [iso.victim], phase)[iso.victim]

    direct = by_name.get(iso.direct) if iso.direct else None
    direct_tps = totals(direct).tokens_per_s if direct is not None else None
    out = []
    for run in runs:
        v = victim(run)
        n = group_stats(run, [iso.noisy])[iso.noisy]
        solo_name = iso.solo.get(run.target)
        solo_run = by_name.get(solo_name) if solo_name else None
        solo = victim(solo_run) if solo_run is not None else None
        tps = totals(run).tokens_per_s
        out.append(
            IsolationRow(
                target=run.target,
                solo=solo_name,
                victim_requests=v.requests,
                victim_ok=v.ok,
                victim_ttft_p50_s=v.ttft_p50_s,
                victim_ttft_p99_s=v.ttft_p99_s,
                victim_ttft_p99_vs_solo=_ratio(v.ttft_p99_s, solo.ttft_p99_s if solo else None),
                victim_itl_p99_s=v.itl_p99_s,
                victim_itl_p99_vs_solo=_ratio(v.itl_p99_s, solo.itl_p99_s if solo else None),
                noisy_requests=n.requests,
                noisy_ok=n.ok,
                noisy_ttft_p50_s=n.ttft_p50_s,
                noisy_ttft_p99_s=n.ttft_p99_s,
                noisy_queue_p99_s=None if n.queue_p99_ms is None else n.queue_p99_ms / 1000.0,
                tokens_per_s=tps,
                tokens_per_s_vs_direct=_ratio(tps, direct_tps) if n.requests else None,
            )
        )
    return out


def _ms(v: float | None) -> str:
    return "–" if v is None else f"{v * 1000:,.0f}"


def _s(v: float | None) -> str:
    return "–" if v is None else f"{v:,.1f}"


def _x(v: float | None) -> str:
    return "–" if v is None else f"{v:.2f}×"


def isolation_markdown(spec: WorkloadSpec, runs: Sequence[RunResult]) -> str:
    rows = isolation_rows(spec, runs)
    iso = spec.isolation
    if not rows or iso is None:
        return ""
    where = f" (victim requests sent in phase `{iso.phase}`)" if iso.phase else ""
    out = [
        f"## Isolation: `{iso.victim}` beside `{iso.noisy}`{where}\n\n",
        "Victim latency against the victim alone on the same engine settings (the `solo` run); the noisy "
        "tenant's completed requests, TTFT and gateway queue wait; generated tokens/s against "
        f"`{iso.direct or '–'}`.\n\n",
        "| target | solo run | victim TTFT p50 / p99 (ms) | p99 ÷ solo | victim ITL p99 (ms) | ÷ solo "
        "| noisy done | noisy TTFT p50 / p99 (s) | noisy queue p99 (s) | tokens/s | ÷ direct |\n",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n",
    ]
    for r in rows:
        noisy = f"{r.noisy_ok}/{r.noisy_requests}" if r.noisy_requests else "–"
        noisy_ttft = f"{_s(r.noisy_ttft_p50_s)} / {_s(r.noisy_ttft_p99_s)}" if r.noisy_requests else "–"
        out.append(
            f"| {r.target} | {r.solo or '–'} | {_ms(r.victim_ttft_p50_s)} / {_ms(r.victim_ttft_p99_s)} | "
            f"{_x(r.victim_ttft_p99_vs_solo)} | {_ms(r.victim_itl_p99_s)} | {_x(r.victim_itl_p99_vs_solo)} | "
            f"{noisy} | {noisy_ttft} | {_s(r.noisy_queue_p99_s)} | {r.tokens_per_s:,.0f} | "
            f"{_x(r.tokens_per_s_vs_direct)} |\n"
        )
    return "".join(out)

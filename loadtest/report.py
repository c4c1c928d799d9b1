"""Results of one or more runs as a JSON document and a markdown report."""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import orjson

from loadtest.checks import CheckResult
from loadtest.isolation import isolation_markdown, isolation_rows
from loadtest.records import RunResult
from loadtest.spec import WorkloadSpec
from loadtest.stats import GroupStats, fair_shares, group_stats, p99_over_time, totals
from loadtest.summary import SummaryColumn, summary_markdown, summary_rows


def results_json(
    spec: WorkloadSpec,
    runs: Sequence[RunResult],
    checks: Sequence[CheckResult],
    summary: Sequence[SummaryColumn] = (),
) -> dict[str, Any]:
    groups = spec.groups
    targets = []
    for run in runs:
        targets.append(
            {
                "name": run.target,
                "base_urls": list(run.base_urls),
                "started_unix": run.started_unix,
                "planned": run.planned,
                "totals": totals(run).to_json(),
                "groups": {g: s.to_json() for g, s in group_stats(run, groups).items()},
                "phases": {
                    p.name: {g: s.to_json() for g, s in group_stats(run, groups, p).items()}
                    for p in spec.phases
                },
                "fairness": [s.to_json() for s in fair_shares(run, spec)],
                "p99_ttft_over_time": {g: p99_over_time(run, g) for g in groups},
                "requests": [r.to_json() for r in run.records],
            }
        )
    return {
        "scenario": spec.name,
        "description": spec.description,
        "seed": spec.seed,
        "duration_s": spec.duration_s,
        "created_unix": time.time(),
        "groups": groups,
        "phases": {p.name: [list(w) for w in p.windows] for p in spec.phases},
        "targets": targets,
        "isolation": [r.to_json() for r in isolation_rows(spec, runs)],
        "summary": summary_rows(spec, runs, summary),
        "checks": [c.to_json() for c in checks],
    }


def _ms(value: float | None) -> str:
    return "–" if value is None else f"{value * 1000:,.0f}"


def _s(value: float | None) -> str:
    return "–" if value is None else f"{value:,.2f}"


def _errors(stats: GroupStats) -> str:
    if not stats.errors:
        return "0"
    return ", ".join(f"{k}: {v}" for k, v in stats.errors.items())


_HEADER = (
    "| target | class | requests | TTFT p50 (ms) | TTFT p99 (ms) | E2E p50 (s) | E2E p99 (s) | E2E mean (s) "
    "| tokens/s | errors |\n"
    "|---|---|---:|---:|---:|---:|---:|---:|---:|---|\n"
)


def _row(target: str, stats: GroupStats) -> str:
    return (
        f"| {target} | {stats.group} | {stats.requests} | {_ms(stats.ttft_p50_s)} | {_ms(stats.ttft_p99_s)} | "
        f"{_s(stats.e2e_p50_s)} | {_s(stats.e2e_p99_s)} | {_s(stats.e2e_mean_s)} | {stats.tokens_per_s:,.0f} | "
        f"{_errors(stats)} |\n"
    )


def _sent(spec: WorkloadSpec) -> str:
    limit = spec.send_max_tokens
    if limit == "planned":
        return "max_tokens = the planned output"
    sent = "no max_tokens" if limit == "none" else f"max_tokens {limit}"
    return f"{sent}, the planned output as tokengate_stop_after"


def markdown(
    spec: WorkloadSpec,
    runs: Sequence[RunResult],
    checks: Sequence[CheckResult],
    summary: Sequence[SummaryColumn] = (),
) -> str:
    groups = spec.groups
    out = [f"# {spec.name}\n\n"]
    if spec.description:
        out.append(spec.description.strip() + "\n\n")
    out.append(
        f"Seed {spec.seed}, {spec.duration_s:g} s of arrivals, the same requests against every target "
        f"({_sent(spec)}).\n\n"
    )
    if summary:
        out.append("## Summary\n\n" + summary_markdown(spec, runs, summary) + "\n")
    out.append("## Per class\n\n" + _HEADER)
    for run in runs:
        for stats in group_stats(run, groups).values():
            out.append(_row(run.target, stats))
    out.append(
        "\n| target | requests | ok | generated tokens | elapsed (s) | tokens/s | max send lag (ms) "
        "| backend preemptions | reserved ÷ generated output |\n"
    )
    out.append("|---|---:|---:|---:|---:|---:|---:|---:|---:|\n")
    for run in runs:
        t = totals(run)
        preempted = "–" if t.preemptions is None else f"{t.preemptions:,.0f}"
        reserved = "–" if t.reserved_output_ratio is None else f"{t.reserved_output_ratio:.2f}"
        out.append(
            f"| {run.target} | {t.requests} | {t.ok} | {t.completion_tokens:,} | {t.elapsed_s:.1f} | "
            f"{t.tokens_per_s:,.0f} | {t.max_send_lateness_s * 1000:.0f} | {preempted} | {reserved} |\n"
        )
    for phase in spec.phases:
        windows = ", ".join(f"{a:g}–{b:g} s" for a, b in phase.windows)
        out.append(f"\n## Phase `{phase.name}` (requests sent {windows})\n\n" + _HEADER)
        for run in runs:
            for stats in group_stats(run, groups, phase).values():
                out.append(_row(run.target, stats))
    if spec.fairness is not None:
        out.append("\n## Fair shares of served tokens\n\n")
        out.append("| target | tenant | weight | served tokens | share | weight's share | off by |\n")
        out.append("|---|---|---:|---:|---:|---:|---:|\n")
        for run in runs:
            for s in fair_shares(run, spec):
                out.append(
                    f"| {run.target} | {s.tenant} | {s.weight:g} | {s.served_tokens:,.0f} | {s.share:.1%} | "
                    f"{s.weight_share:.1%} | {s.relative_error:.1%} |\n"
                )
    table = isolation_markdown(spec, runs)
    if table:
        out.append("\n" + table)
    if checks:
        out.append("\n## Checks\n\n")
        for c in checks:
            out.append(f"- {c.line()}\n")
    return "".join(out)


def write_reports(
    out_dir: Path,
    spec: WorkloadSpec,
    runs: Sequence[RunResult],
    checks: Sequence[CheckResult],
    summary: Sequence[SummaryColumn] = (),
) -> tuple[Path, Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    json_path = out_dir / "results.json"
    md_path = out_dir / "results.md"
    data = results_json(spec, runs, checks, summary)
    json_path.write_bytes(orjson.dumps(data, option=orjson.OPT_INDENT_2))
    md_path.write_text(markdown(spec, runs, checks, summary))
    return json_path, md_path

"""A scenario's summary table: one row per target, the columns the scenario names.

It is printed first in ``results.md`` (and kept in ``results.json``), so a comparison of arms reads
as one table::

    summary:
      - tokens_per_s                                      # a run total
      - {metric: tokens_per_s, relative_to: max_tokens}   # as a multiple of that target's value
      - preemptions_per_request
      - {metric: ttft_p99_s, group: chat}                 # a per-group statistic

Metrics are the ones checks take (``loadtest.checks``): run totals without a group, per-group
statistics with one.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from loadtest.checks import format_metric, metric_value, parse_metric
from loadtest.distributions import SpecError, check_keys
from loadtest.records import RunResult
from loadtest.spec import WorkloadSpec

_LABELS = {
    "tokens_per_s": "generated tokens/s",
    "preemptions_per_request": "backend preemptions / request",
    "reserved_output_ratio": "reserved ÷ generated output",
    "ttft_p50_s": "TTFT p50",
    "ttft_p90_s": "TTFT p90",
    "ttft_p99_s": "TTFT p99",
    "e2e_p50_s": "E2E p50",
    "e2e_p99_s": "E2E p99",
    "e2e_mean_s": "E2E mean",
    "queue_p99_ms": "queue p99 (ms)",
}


@dataclass(frozen=True)
class SummaryColumn:
    metric: str
    group: str | None = None
    relative_to: str | None = None  # a target: show value ÷ that target's value

    @property
    def header(self) -> str:
        label = _LABELS.get(self.metric, self.metric)
        if self.group is not None:
            label = f"{self.group} {label}"
        return label if self.relative_to is None else f"{label} ÷ {self.relative_to}"


def parse_summary(raw: Any, spec: WorkloadSpec) -> tuple[SummaryColumn, ...]:
    if raw is None:
        return ()
    if not isinstance(raw, list):
        raise SpecError("summary: expected a list of metrics or {metric, group, relative_to}")
    out = []
    for i, item in enumerate(raw):
        where = f"summary[{i}]"
        entry: Mapping[str, Any] = {"metric": item} if isinstance(item, str) else item
        if not isinstance(entry, Mapping):
            raise SpecError(f"{where}: expected a metric name or a mapping")
        check_keys(entry, ["metric", "group", "relative_to"], where)
        metric, group = parse_metric(entry, where, spec)
        relative_to = entry.get("relative_to")
        if relative_to is not None and not isinstance(relative_to, str):
            raise SpecError(f"{where}.relative_to: expected a target name, got {relative_to!r}")
        out.append(SummaryColumn(metric, group, relative_to))
    return tuple(out)


def _same_requests(a: RunResult, b: RunResult) -> bool:
    return [r.index for r in a.records] == [r.index for r in b.records]


def _cell(
    column: SummaryColumn, run: RunResult, by_name: Mapping[str, RunResult], spec: WorkloadSpec
) -> tuple[float | None, str]:
    value = metric_value(run, spec, column.metric, column.group, None)
    if value is None:
        return None, "–"
    if column.relative_to is None:
        return value, format_metric(column.metric, value)
    base_run = by_name.get(column.relative_to)
    if base_run is None or not _same_requests(run, base_run):
        return None, "–"  # a ratio only between runs of the same requests (not a warm-up, say)
    base = metric_value(base_run, spec, column.metric, column.group, None)
    if not base:
        return None, "–"
    return value / base, f"{value / base:.2f}×"


def summary_rows(
    spec: WorkloadSpec, runs: Sequence[RunResult], columns: Sequence[SummaryColumn]
) -> list[dict[str, Any]]:
    """For results.json: per target, each column's header and value (ratios as plain numbers)."""
    by_name = {r.target: r for r in runs}
    return [
        {"target": run.target, "values": {c.header: _cell(c, run, by_name, spec)[0] for c in columns}}
        for run in runs
    ]


def summary_markdown(spec: WorkloadSpec, runs: Sequence[RunResult], columns: Sequence[SummaryColumn]) -> str:
    if not columns:
        return ""
    by_name = {r.target: r for r in runs}
    out = ["| target | " + " | ".join(c.header for c in columns) + " |\n"]
    out.append("|---|" + "---:|" * len(columns) + "\n")
    for run in runs:
        cells = [_cell(c, run, by_name, spec)[1] for c in columns]
        out.append(f"| {run.target} | " + " | ".join(cells) + " |\n")
    return "".join(out)

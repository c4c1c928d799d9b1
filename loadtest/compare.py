"""Compare mode: the same seeded workload against several targets, one after another, then the reports."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from loadtest.checks import CheckResult, CheckSpec, evaluate_all
from loadtest.plots import write_plots
from loadtest.prompts import PromptFactory
from loadtest.records import RunResult
from loadtest.report import write_reports
from loadtest.runner import RunOptions, Target, run_plan
from loadtest.schedule import build_schedule
from loadtest.spec import WorkloadSpec


def run_options(spec: WorkloadSpec, *, progress: bool = False, stream: bool = True) -> RunOptions:
    return RunOptions(
        model=spec.model,
        endpoint=spec.endpoint,
        stream=stream,
        duration_s=spec.duration_s,
        max_requests=spec.max_requests,
        request_timeout_s=spec.request_timeout_s,
        drain_timeout_s=spec.drain_timeout_s,
        chat_overhead_tokens=spec.chat_overhead_tokens if spec.endpoint == "chat" else 0,
        send_max_tokens=spec.send_max_tokens,
        progress=progress,
    )


async def compare(
    spec: WorkloadSpec,
    targets: Sequence[Target],
    *,
    options: RunOptions | None = None,
    pause_s: float = 1.0,
) -> list[RunResult]:
    """Runs the identical plan against each target in turn; ``pause_s`` lets backends go idle in between."""
    plan = build_schedule(spec)
    prompts = PromptFactory(seed=spec.seed)
    opts = options if options is not None else run_options(spec)
    runs: list[RunResult] = []
    for i, target in enumerate(targets):
        if i and pause_s > 0:
            await asyncio.sleep(pause_s)
        runs.append(await run_plan(plan, target, prompts, opts))
    return runs


@dataclass(frozen=True)
class Outputs:
    json_path: Path
    markdown_path: Path
    plots: list[Path]
    checks: list[CheckResult]
    markdown: str


def write_outputs(
    out_dir: Path,
    spec: WorkloadSpec,
    runs: Sequence[RunResult],
    checks: Sequence[CheckSpec] = (),
    *,
    plots: bool = True,
) -> Outputs:
    """results.json, results.md and the PNGs in ``out_dir``; checks evaluated against the runs."""
    results = evaluate_all(checks, runs, spec)
    json_path, md_path = write_reports(out_dir, spec, runs, results)
    pngs = write_plots(out_dir, spec, runs) if plots else []
    return Outputs(json_path, md_path, pngs, results, md_path.read_text())

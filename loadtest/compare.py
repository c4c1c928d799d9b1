"""Compare mode: the same seeded workload against several targets, one after another, then the reports."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import aiohttp

from gateway.observe.scrape import parse_engine_metrics
from loadtest.checks import CheckResult, CheckSpec, evaluate_all
from loadtest.plots import write_plots
from loadtest.prompts import PromptFactory
from loadtest.records import RunResult
from loadtest.report import write_reports
from loadtest.runner import RunOptions, Target, run_plan
from loadtest.schedule import build_schedule
from loadtest.spec import WorkloadSpec
from loadtest.summary import SummaryColumn


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


async def backend_preemptions(backend_urls: Sequence[str]) -> float | None:
    """The backends' preemption counters summed (vLLM's vllm:num_preemptions_total, SGLang's
    retractions), read from their /metrics; None when one does not answer or exports none."""
    total = 0.0
    timeout = aiohttp.ClientTimeout(total=10)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        for url in backend_urls:
            try:
                async with session.get(url.rstrip("/") + "/metrics") as resp:
                    if resp.status != 200:
                        return None
                    sample = parse_engine_metrics(await resp.text())
            except (aiohttp.ClientError, TimeoutError):
                return None
            if sample.preemptions_total is None:
                return None
            total += sample.preemptions_total
    return total


async def compare(
    spec: WorkloadSpec,
    targets: Sequence[Target],
    *,
    options: RunOptions | None = None,
    pause_s: float = 1.0,
    backend_urls: Sequence[str] = (),
) -> list[RunResult]:
    """Runs the identical plan against each target in turn; ``pause_s`` lets backends go idle in between.

    With ``backend_urls`` (a spawned stack's backends, shared by every target), each run also
    records how many preemptions the backends counted while it went."""
    plan = build_schedule(spec)
    prompts = PromptFactory(seed=spec.seed)
    opts = options if options is not None else run_options(spec)
    runs: list[RunResult] = []
    for i, target in enumerate(targets):
        if i and pause_s > 0:
            await asyncio.sleep(pause_s)
        before = await backend_preemptions(backend_urls) if backend_urls else None
        run = await run_plan(plan, target, prompts, opts)
        after = await backend_preemptions(backend_urls) if before is not None else None
        if before is not None and after is not None:
            run.backend_preemptions = after - before
        runs.append(run)
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
    summary: Sequence[SummaryColumn] = (),
) -> Outputs:
    """results.json, results.md and the PNGs in ``out_dir``; checks evaluated against the runs."""
    results = evaluate_all(checks, runs, spec)
    json_path, md_path = write_reports(out_dir, spec, runs, results, summary)
    pngs = write_plots(out_dir, spec, runs) if plots else []
    return Outputs(json_path, md_path, pngs, results, md_path.read_text())

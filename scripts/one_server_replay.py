"""The one_server scenario's engine side on a virtual clock: deterministic, no CPU noise, ~1 minute.

Replays the same workload as ``loadtest/scenarios/one_server.yaml`` — the Azure conversation trace
from t = 600 s (real arrival times and sizes) plus a 28,000-token prompt every 4 s from 2 s to 50 s —
straight into the reference engine (simulated executor, default cost model, no HTTP, no gateway), once
with and once without the 28k prompts, for each engine setting; prints victim TTFT p50/p99 and ITL p99
against the victim alone on the same setting. It measures what the engine settings do by themselves;
the gateway's budgets and prefill gate need the real stack (``tokengate loadtest one_server --spawn``).

    .venv/bin/python scripts/one_server_replay.py [--duration 60] [--traces DIR]
"""

from __future__ import annotations

import argparse
import itertools
import random
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from backends.engine.clock import VirtualClock
from backends.engine.engine import Engine
from backends.engine.kv_cache import BlockManager
from backends.engine.request import EngineRequest
from backends.engine.scheduler import Scheduler, SchedulerConfig
from backends.engine.sim_executor import SimExecutor
from loadtest.traces import default_traces_dir, load_trace

SETTINGS: dict[str, dict[str, Any]] = {
    "vLLM defaults (fcfs, no cap)": {},
    "priority, vLLM's scope (waiting queue)": {"policy": "priority", "priority_scope": "queue"},
    "priority in every step": {"policy": "priority"},
    "chunk cap 512": {"long_prefill_token_threshold": 512},
    "cap 512 + priority, vLLM's scope": {
        "long_prefill_token_threshold": 512,
        "policy": "priority",
        "priority_scope": "queue",
    },
    "cap 512 + priority in every step": {"long_prefill_token_threshold": 512, "policy": "priority"},
}


def _prompt(n: int, salt: int) -> list[int]:
    return [(1000 + salt * 7919 + i * 31) % 90000 + 100 for i in range(n)]


def _percentile(xs: Sequence[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))] if s else float("nan")


def replay(
    settings: dict[str, Any], victims: list[tuple[float, int, int]], noisy: list[tuple[float, int, int]]
) -> dict[str, float]:
    config = SchedulerConfig(max_model_len=32768, max_num_batched_tokens=8192, **settings)
    executor = SimExecutor(block_size=16, num_blocks=450_000 // 16)
    scheduler = Scheduler(config, BlockManager(executor.num_blocks, 16), executor.eos_token_id)
    clock = VirtualClock()
    engine = Engine(scheduler, executor, clock)
    prio = config.policy == "priority"
    arrivals: list[tuple[float, EngineRequest]] = []
    for i, (t, p, o) in enumerate(victims):
        req = EngineRequest(f"v{i}", _prompt(p, i), o, priority=1 if prio else 0, ignore_eos=True)
        arrivals.append((t, req))
    for i, (t, p, o) in enumerate(noisy):
        req = EngineRequest(f"n{i}", _prompt(p, 10_000 + i), o, priority=2 if prio else 0, ignore_eos=True)
        arrivals.append((t, req))
    arrivals.sort(key=lambda a: a[0])
    requests = [r for _, r in arrivals]
    times: dict[str, list[float]] = {}
    pending = list(arrivals)
    while pending or engine.has_unfinished():
        while pending and pending[0][0] <= clock.now():
            t, req = pending.pop(0)
            engine.add_request(req, arrival_time=t)
        if engine.has_unfinished():
            for out in engine.step():
                times.setdefault(out.request_id, []).extend(out.token_times)
        else:
            clock.advance_to(pending[0][0])
    ttft = [
        r.first_token_time - r.arrival_time for r in requests if r.request_id[0] == "v" and r.first_token_time
    ]
    itl = [b - a for rid, ts in times.items() if rid[0] == "v" for a, b in itertools.pairwise(ts)]
    noisy_ttft = [
        r.first_token_time - r.arrival_time for r in requests if r.request_id[0] == "n" and r.first_token_time
    ]
    return {
        "p50": _percentile(ttft, 0.5),
        "p99": _percentile(ttft, 0.99),
        "itl99": _percentile(itl, 0.99),
        "noisy_ttft_p50": _percentile(noisy_ttft, 0.5) if noisy_ttft else float("nan"),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--duration", type=float, default=60.0, help="seconds of the trace (default 60)")
    ap.add_argument("--traces", type=Path, default=None, help="folder of the Azure traces")
    args = ap.parse_args(argv)
    path = (args.traces or default_traces_dir()) / "azure_llm_2023_conv.csv"
    if not path.is_file():
        print(f"trace not found: {path}", file=sys.stderr)
        return 2
    records = load_trace(path)
    victims = [
        (r.at_s - 600, r.prompt_tokens, min(r.output_tokens, 32768 - r.prompt_tokens))
        for r in records
        if 600 <= r.at_s < 600 + args.duration
    ]
    rng = random.Random(1)
    last = min(args.duration, 50.0)
    noisy = [(2.0 + 4 * k, 28_000, rng.randint(400, 700)) for k in range(int((last - 2.0) / 4) + 1)]
    print(f"{len(victims)} chat requests over {args.duration:g} s, {len(noisy)} prompts of 28,000 tokens")
    print()
    print("| engine setting | victim TTFT p50 / p99 alone (ms) | beside 28k (ms) | p99 ÷ alone | ITL p99 ÷ alone "
          "| 28k TTFT p50 (s) |")  # fmt: skip
    print("|---|---:|---:|---:|---:|---:|")
    for name, settings in SETTINGS.items():
        alone = replay(settings, victims, [])
        mixed = replay(settings, victims, noisy)
        print(
            f"| {name} | {alone['p50'] * 1000:.0f} / {alone['p99'] * 1000:.0f} | "
            f"{mixed['p50'] * 1000:.0f} / {mixed['p99'] * 1000:.0f} | {mixed['p99'] / alone['p99']:.2f}× | "
            f"{mixed['itl99'] / alone['itl99']:.2f}× | {mixed['noisy_ttft_p50']:.2f} |",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""The one_server scenario's engine side on a virtual clock: deterministic, no CPU noise, ~1 minute.

Replays the same seeded plan as ``tokengate loadtest one_server`` — the Azure conversation trace from
t = 600 s (real arrival times and sizes) plus the agent's 28,000-token prompts — straight into the
reference engine (simulated executor, default cost model, no HTTP, no gateway), once
with and once without the 28k prompts, for each engine setting; prints victim TTFT p50/p99 and ITL p99
against the victim alone on the same setting. It measures what the engine settings do by themselves;
the gateway's budgets and prefill gate need the real stack (``tokengate loadtest one_server --spawn``).

    .venv/bin/python scripts/one_server_replay.py [--duration 60] [--synthetic]
"""

from __future__ import annotations

import argparse
import itertools
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from backends.engine.clock import VirtualClock
from backends.engine.engine import Engine
from backends.engine.kv_cache import BlockManager
from backends.engine.request import EngineRequest
from backends.engine.scheduler import Scheduler, SchedulerConfig
from backends.engine.sim_executor import SimExecutor
from loadtest.scenario import load_scenario
from loadtest.schedule import build_schedule

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
    ap.add_argument(
        "--duration", type=float, default=None, help="seconds of arrivals (default: the scenario's)"
    )
    ap.add_argument(
        "--synthetic", action="store_true", help="the trace's fitted stand-in instead of the file"
    )
    args = ap.parse_args(argv)
    scenario = load_scenario("one_server", synthetic=args.synthetic)
    spec = scenario.workload
    if args.duration is not None:
        spec = replace(spec, duration_s=args.duration)
    plan = [r for r in build_schedule(spec) if r.at_s < spec.duration_s]
    victims = [(r.at_s, r.prompt_tokens, r.output_tokens) for r in plan if r.group == "victim"]
    noisy = [(r.at_s, r.prompt_tokens, r.output_tokens) for r in plan if r.group == "noisy"]
    print(f"{len(victims)} chat requests over {spec.duration_s:g} s, {len(noisy)} prompts of ~28,000 tokens")
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

"""The one_server_sustained scenario on a virtual clock, gateway included: the trade-off curve.

Replays the seeded plan of ``tokengate loadtest one_server_sustained`` (the Azure conversation trace
from t = 600 s at its real pace, tier critical, beside 28,000-token prompts with 200 output tokens,
Poisson at 0.08/s, tier batch) straight into the reference engine (simulated executor at the
scenario's ``--time-scale``, no HTTP), with the gateway's admission modelled in front of it:

- the agent tenant's token budget (each request holds prompt + output tokens from admission to its
  last token; requests over it wait in arrival order);
- the prefill gate itself (``gateway.upstream.gate.PrefillGate`` on the virtual clock: a request
  enters it when admitted and leaves it at its first token), at each size and reserve swept;
- the tier forwarded as the engine's priority (critical before batch).

Every arm is measured against the victim alone on the same engine setting. It prints one table row
per (engine scope, gate, reserve, budget): victim TTFT p99 and its ratio to alone, the chat
requests' wait at the gate (p99), the agent's wait at the gateway (budget + gate, p99), generated
tokens/s against direct (defaults, no gateway). Deterministic: the same plan gives the same table.

    .venv/bin/python scripts/one_server_sweep.py --traces /path/to/traces [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, fields, replace
from typing import Any

from backends.engine.clock import VirtualClock
from backends.engine.engine import Engine
from backends.engine.kv_cache import BlockManager
from backends.engine.request import EngineRequest
from backends.engine.scheduler import Scheduler, SchedulerConfig
from backends.engine.sim_executor import CostModel, SimExecutor
from gateway.upstream.gate import PrefillGate, _Waiter
from loadtest.scenario import load_scenario
from loadtest.schedule import build_schedule
from loadtest.traces import use_traces_dir

TIME_SCALE = 2.5  # the scenario's backends: --time-scale 2.5
KV_TOKENS = 450_000
ENGINES: dict[str, dict[str, Any]] = {
    "defaults": {},
    "queue": {"policy": "priority", "priority_scope": "queue", "long_prefill_token_threshold": 512},
    "step": {"policy": "priority", "priority_scope": "step", "long_prefill_token_threshold": 512},
}


@dataclass(frozen=True)
class Arm:
    engine: str  # a key of ENGINES
    gate: int | None = None  # prefill_gate_tokens (None: no gate)
    reserve: int | None = None  # prefill_gate_reserve_tokens (None: the gate's default, a quarter)
    budget: int | None = None  # the agent's budget_tokens (None: no gateway budget)
    noisy: bool = True


@dataclass
class _Req:
    rid: str
    at: float
    prompt: int
    output: int
    victim: bool
    seen: float | None = None  # at the gateway (the first engine step boundary after it was sent)
    admitted: float | None = None  # past the budget
    sent: float | None = None  # past the gate, into the engine
    engine_req: EngineRequest | None = None
    gate_in: bool = False


def _pct(xs: Sequence[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))] if s else float("nan")


def _prompt(n: int, salt: int) -> list[int]:
    return [(1000 + salt * 7919 + i * 31) % 90000 + 100 for i in range(n)]


def replay(arm: Arm, plan: list[tuple[float, int, int, bool]]) -> dict[str, float]:
    """One arm: the plan through the modelled gateway into the engine; the statistics of the run."""
    config = SchedulerConfig(max_model_len=32768, max_num_batched_tokens=8192, **ENGINES[arm.engine])
    base = CostModel()
    cost = CostModel(**{f.name: getattr(base, f.name) * TIME_SCALE for f in fields(CostModel)})
    cost = replace(cost, knee_tokens=base.knee_tokens)
    executor = SimExecutor(cost, block_size=16, num_blocks=KV_TOKENS // 16)
    scheduler = Scheduler(config, BlockManager(executor.num_blocks, 16), executor.eos_token_id)
    clock = VirtualClock()
    engine = Engine(scheduler, executor, clock)
    loop = asyncio.new_event_loop()  # only to make the gate's futures; never run
    gate = PrefillGate(arm.gate, reserve=arm.reserve, clock=clock.now) if arm.gate else None
    prio = config.policy == "priority"
    reqs = [
        _Req(f"{'v' if v else 'n'}{i}", t, p, o, v) for i, (t, p, o, v) in enumerate(plan) if v or arm.noisy
    ]
    pending = deque(sorted(reqs, key=lambda r: r.at))
    budget_line: deque[_Req] = deque()
    gate_waiting: dict[int, _Req] = {}  # id(future) -> request
    waiters: dict[int, _Waiter] = {}
    held = 0
    live: dict[str, _Req] = {}

    def send(r: _Req) -> None:
        r.sent = clock.now()
        priority = (1 if r.victim else 2) if prio else 0
        salt = int(r.rid[1:]) + (0 if r.victim else 100_000)
        r.engine_req = EngineRequest(
            r.rid, _prompt(r.prompt, salt), r.output, priority=priority, ignore_eos=True
        )
        engine.add_request(r.engine_req, arrival_time=r.sent)
        live[r.rid] = r

    def to_gate(r: _Req) -> None:
        if gate is None:
            send(r)
            return
        long, now = gate.is_long(r.prompt), clock.now()
        line = gate._longs if long else gate._shorts
        fits = gate._long_fits(r.prompt) if long else gate._short_fits(r.prompt, now)
        if not line and fits:
            gate._take(r.prompt, long)
            r.gate_in = True
            send(r)
            return
        gate._seq += 1
        w = _Waiter(r.prompt, long, gate._seq, now, loop.create_future())
        line.append(w)
        gate_waiting[id(w.future)] = r
        waiters[id(w.future)] = w

    def let_in_from_gate() -> None:
        assert gate is not None
        gate._wake()  # (leave has woken them already)
        for key, w in list(waiters.items()):
            if w.future.done():
                del waiters[key]
                r = gate_waiting.pop(key)
                r.gate_in = True
                send(r)

    def admit_noisy() -> None:
        nonlocal held
        while budget_line:
            r = budget_line[0]
            c = r.prompt + r.output
            if arm.budget is not None and held + c > arm.budget and held > 0:
                break
            budget_line.popleft()
            held += c
            r.admitted = clock.now()
            to_gate(r)

    while pending or budget_line or gate_waiting or engine.has_unfinished():
        while pending and pending[0].at <= clock.now():
            r = pending.popleft()
            r.seen = clock.now()
            if r.victim or arm.budget is None:
                r.admitted = clock.now()
                to_gate(r)
            else:
                budget_line.append(r)
                admit_noisy()
        if engine.has_unfinished():
            outs = engine.step()
            now = clock.now()
            for out in outs:
                r = live[out.request_id]
                er = r.engine_req
                assert er is not None
                if r.gate_in and er.first_token_time is not None:
                    r.gate_in = False
                    assert gate is not None
                    gate.leave(r.prompt, gate.is_long(r.prompt))
                    let_in_from_gate()
                if out.finished:
                    del live[r.rid]
                    if not r.victim and arm.budget is not None:
                        held -= r.prompt + r.output
                        admit_noisy()
            del now
        elif pending:
            clock.advance_to(pending[0].at)
        else:
            raise RuntimeError("requests wait at the gateway with nothing running")
    loop.close()

    def ttft(r: _Req) -> float:
        assert r.engine_req is not None and r.engine_req.first_token_time is not None
        return r.engine_req.first_token_time - r.at

    victims = [r for r in reqs if r.victim]
    noisy = [r for r in reqs if not r.victim]
    end = max(r.engine_req.finish_time or 0.0 for r in reqs if r.engine_req is not None)
    tokens = sum(r.output for r in reqs)
    return {
        "victim_p50": _pct([ttft(r) for r in victims], 0.5),
        "victim_p99": _pct([ttft(r) for r in victims], 0.99),
        "victim_gate_p99": _pct([(r.sent or 0) - (r.admitted or 0) for r in victims], 0.99),
        "noisy_wait_p99": _pct([(r.sent or 0) - (r.seen or 0) for r in noisy], 0.99)
        if noisy
        else float("nan"),
        "noisy_ttft_p50": _pct([ttft(r) for r in noisy], 0.5) if noisy else float("nan"),
        "tokens_per_s": tokens / end,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--traces", default=None, help="the folder holding azure_llm_2023_conv.csv")
    ap.add_argument(
        "--duration", type=float, default=None, help="seconds of arrivals (default: the scenario's)"
    )
    ap.add_argument("--quick", action="store_true", help="the scenario's arms only, no sweep")
    args = ap.parse_args(argv)
    if args.traces:
        from pathlib import Path

        use_traces_dir(Path(args.traces))
    scenario = load_scenario("one_server_sustained")
    spec = scenario.workload
    if args.duration is not None:
        spec = replace(spec, duration_s=args.duration)
    plan = [
        (r.at_s, r.prompt_tokens, r.output_tokens, r.group == "victim")
        for r in build_schedule(spec)
        if r.at_s < spec.duration_s
    ]
    nv = sum(1 for p in plan if p[3])
    print(f"{nv} chat requests over {spec.duration_s:g} s, {len(plan) - nv} prompts of 28,000 tokens")
    solo = {e: replay(Arm(e, noisy=False), plan) for e in ENGINES}
    direct = replay(Arm("defaults"), plan)
    if args.quick:
        arms = [
            Arm("defaults"),
            Arm("defaults", budget=120_000),
            Arm("queue", 40_000, 12_000, 120_000),
            Arm("queue", 40_000, 12_000, 30_000),
            Arm("step", 40_000, 12_000, 120_000),
        ]
    else:
        arms = [Arm("defaults"), Arm("defaults", budget=120_000)]
        for engine in ("queue", "step"):
            for gate, reserve, budget in itertools.product(
                (None, 32_000, 40_000, 48_000, 72_000), (None, 12_000), (30_000, 60_000, 120_000, None)
            ):
                if gate is None and reserve is not None:
                    continue
                arms.append(Arm(engine, gate, reserve, budget))
    print()
    print("| engine | gate / reserve | agent budget | victim TTFT p50 / p99 (ms) | p99 ÷ alone "
          "| chat gate wait p99 (ms) | agent wait p99 (s) | 28k TTFT p50 (s) | tokens/s ÷ direct |")  # fmt: skip
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
    for arm in arms:
        m = replay(arm, plan)
        alone = solo[arm.engine]
        gate_text = "-" if arm.gate is None else f"{arm.gate:,} / {arm.reserve or arm.gate // 4:,}"
        budget_text = "-" if arm.budget is None else f"{arm.budget:,}"
        print(
            f"| {arm.engine} | {gate_text} | {budget_text} | {m['victim_p50'] * 1000:.0f} / {m['victim_p99'] * 1000:.0f} | "
            f"{m['victim_p99'] / alone['victim_p99']:.2f}× | {m['victim_gate_p99'] * 1000:.0f} | "
            f"{m['noisy_wait_p99']:.1f} | {m['noisy_ttft_p50']:.1f} | "
            f"{m['tokens_per_s'] / direct['tokens_per_s']:.2f} |",
            flush=True,
        )
    print()
    for e, m in solo.items():
        print(
            f"victim alone on {e}: TTFT p50 / p99 {m['victim_p50'] * 1000:.0f} / {m['victim_p99'] * 1000:.0f} ms"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

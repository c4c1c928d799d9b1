"""The worst single step of admission in a round of service: what one saturated pool costs at its worst moment.

Run: ``python -m research.rounds`` (``--tenants 10000,100000``; ``--json FILE``). Results
and commands: docs/benchmarks.md, "Every step bounded: the worst step of a round".

The scale benchmark (``loadtest.bench.scale``) reports averages and a p99: a step that costs
O(tenants) once per round hides in both. This one runs the round itself, on ``budgets.policy``
alone (no store, no event loop, a virtual clock): the scale benchmark's saturated pool (``IN_FLIGHT``
leases of 10 tokens, full), ``--tickets-per-tenant`` waiting tickets for each of ``tenants``
tenants, all queued at one instant, then release→grant cycles until every tenant has been served
(fair share serves each once, but for the tenants the full pool was granted to before the round,
charged already: at most ``IN_FLIGHT`` cycles more than tenants), so that every counter rises twice (the prompt at the grant, the output at
the release). The clock moves ``--clock-step`` seconds per cycle, so that the heads age past
``backfill_limit_s`` part way through and are promoted in the passes after. Timed: every grant pass
(the worst, the cycle it came in, p50 and p99), and, after the round, the enqueue of a tenant that
was idle all along (its lift: the lowest counter among the backlogged tenants, every one of which
rose during the round). The garbage collector is off during the round: its pauses, which depend on
the process rather than on these structures, are ``research.gcheap``'s subject.

A lazy structure (an entry left behind at each change and dropped when it surfaces) is cheap on
average and pays here: after such a round every backlogged tenant's outdated entry surfaces in one
call.
"""

from __future__ import annotations

import argparse
import gc
import json
import time
from collections import deque
from typing import Any

from budgets import policy
from budgets.types import Demand
from loadtest.bench.scale import DECODE, IN_FLIGHT, demand, scale_layout, summary


def one_round(tenants: int, tickets_per_tenant: int, clock_step: float) -> dict[str, Any]:
    """Serve every tenant once (see the module docstring); the passes' times and the newcomer's."""
    state = policy.PolicyState(scale_layout(tenants + 1))  # tenant ``tenants``: idle until the end
    held: deque[Demand] = deque()
    for i in range(IN_FLIGHT):
        d = demand(i % tenants)
        assert policy.grant_immediately(state, d)
        held.append(d)
    now = 1000.0
    for _ in range(tickets_per_tenant):
        for i in range(tenants):
            policy.enqueue(state, demand(i), now)
    passes: list[float] = []
    served: set[str] = set()
    gc.collect()
    gc.disable()  # its pauses are research.gcheap's subject, not this one's
    try:
        while len(served) < tenants and len(passes) < 2 * tenants + IN_FLIGHT:
            now += clock_step
            policy.release(state, held.popleft(), DECODE, now)
            t0 = time.perf_counter()
            granted = policy.grant_pass(state, now)
            passes.append(time.perf_counter() - t0)
            held.extend(ticket.demand for ticket in granted)
            served.update(ticket.demand.tenant for ticket in granted)
        t0 = time.perf_counter()
        policy.enqueue(state, demand(tenants), now)
        newcomer = time.perf_counter() - t0
    finally:
        gc.enable()
    worst = max(range(len(passes)), key=passes.__getitem__)
    return {
        "tenants": tenants,
        "tickets": tenants * tickets_per_tenant,
        "grant_pass": summary(passes),
        "worst_pass_cycle": worst,
        "cycles": len(passes),
        "tenants_served": len(served),
        "newcomer_enqueue_ms": newcomer * 1e3,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--tenants", default="10000,100000", help="comma-separated waiting tenants")
    parser.add_argument("--tickets-per-tenant", type=int, default=3)
    parser.add_argument("--clock-step", type=float, default=1e-4, help="virtual seconds per cycle")
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args(argv)
    rows = []
    for n in (int(x) for x in args.tenants.split(",")):
        row = one_round(n, args.tickets_per_tenant, args.clock_step)
        rows.append(row)
        p = row["grant_pass"]
        print(
            f"{n:>7} tenants {row['tickets']:>8} tickets: grant pass p50 {p['p50_ms']:.3f} p99 "
            f"{p['p99_ms']:.3f} max {p['max_ms']:.3f} ms (cycle {row['worst_pass_cycle']}); "
            f"a newcomer's enqueue after the round {row['newcomer_enqueue_ms']:.3f} ms",
            flush=True,
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rounds": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

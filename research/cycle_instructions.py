"""Instructions per release→grant cycle of the memory store: a deterministic figure for admission at scale.

Run: ``python -m research.cycle_instructions`` (needs ``valgrind``; one to three minutes per
point on 2 cores). ``--tree DIR`` measures another checkout (a ``git worktree`` of an older commit)
with this harness, so two versions of the policy are compared on the same footing.

The scale benchmark's cycles/s (``loadtest.bench.scale``) moves by a third between hours on a shared
VM, more than any one change to the policy. Counting instructions does not: the scale benchmark's
memory cycle (one full pool, ``tickets`` waiting ``acquire`` tasks over ``tenants`` tenants; each
granted task releases at once, which grants the next ticket, and queues again) runs in a Python
process under ``valgrind --tool=callgrind`` (on uvloop, as ``tokengate serve`` runs, unless
``--loop asyncio``), for a fixed number of cycles, twice: ``--cycles`` and
twice that, and exits at once after the last cycle. The difference of the two totals divided by
``--cycles`` is one cycle, with start-up and the filling of the queue cancelled out. The collector is off once the queue is full
(with the thresholds ``tokengate serve`` sets it costs ~1 µs per cycle, measured by
``research.gcheap``; its full collections would land in one run and not the other).

The store runs on a virtual clock that moves ``--clock-step`` seconds each time the store reads it
(twice per waiting acquire and twice per cycle), so that a head's age counts operations, not wall
time: under valgrind, fifty times slower, real seconds aged every waiting head long before the
first cycle, and how many of them a run then promoted depended on how long each run took (two
runs of one tree differed by a third at 100,000 tenants). With the default step, filling 100,000
tickets takes ``backfill_limit_s`` (2 s) of that clock and a cycle as long as an enqueue did: with
one ticket per tenant, heads age past it one per cycle from the first cycle on, as they do in a
steady state. ``--clock real`` uses the monotonic clock as before.

Instructions are not time: with 100,000 waiting tasks a cycle touches a different task and frame
each time, and what those cache misses cost shows in the scale benchmark's wall clock, which this
VM's spread hides. ``--cache-sim`` counts them too, deterministically: callgrind's simulated caches
(first level and last level, sized as this machine's), reported as misses per cycle. A second-level
cache is not simulated, so a first-level miss may be cheap (an L2 hit) or not.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

CLOCK_STEP = 1e-5  # seconds per clock read (module docstring)


class ReadClock:
    """A clock that moves ``step`` seconds each time it is read (``step`` None: time.monotonic)."""

    def __init__(self, step: float | None) -> None:
        self.step = step
        self.now = 1_000_000.0  # (a positive instant far from 0, as monotonic readings are)

    def __call__(self) -> float:
        if self.step is None:
            self.now = time.monotonic()
        else:
            self.now += self.step
        return self.now


async def _cycles(
    tenants: int,
    tickets: int,
    cycles: int,
    at_end: Callable[[], object] | None = None,
    clock_step: float | None = CLOCK_STEP,
) -> tuple[int, float]:
    """The scale benchmark's memory cycle, ``cycles`` of them after the queue is full, on a
    ``ReadClock``; ``at_end()`` runs right after the last one (the harness exits there: tearing
    down a hundred thousand waiters costs more than the cycles, and not the same in both runs).
    Returns the cycles run and the clock's last reading."""
    import gc

    from budgets.memory import MemoryStore
    from loadtest.bench.scale import COST, DECODE, demand, scale_layout

    # scale.memory_cycles with a count instead of a clock, written out here so that it runs on the
    # budgets package of an older tree too (--tree), whose scale.py may lack any new helper.
    clock = ReadClock(clock_step)
    store = MemoryStore(scale_layout(tenants, pool_tokens=COST), clock=clock, reap_interval_s=3600.0)
    await store.start()
    granted = 0
    done = asyncio.Event()

    async def waiter(tenant: int) -> None:
        nonlocal granted
        d = demand(tenant)
        while True:
            lease = await store.acquire(d, 3600.0)
            granted += 1
            if granted >= cycles:
                done.set()
                return  # holds the pool: the chain of grants stops here
            await store.release(lease.id, DECODE)

    first = await store.acquire(demand(0), 1.0)
    tasks = [asyncio.ensure_future(waiter(i % tenants)) for i in range(tickets + 1)]
    await asyncio.sleep(0)  # all queued
    gc.collect()
    gc.disable()
    await store.release(first.id, DECODE)
    await done.wait()
    n = granted
    if at_end is not None:
        at_end()
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    await store.close()
    return n, clock.now


def callgrind_events(out: Path) -> dict[str, int]:
    """Every event's total in a callgrind output file (``Ir``; with a cache simulation also
    ``D1mr``, ``D1mw``, ``DLmr``, ``DLmw`` and the instruction cache's)."""
    names: list[str] = []
    totals: list[int] = []
    for line in out.read_text(errors="replace").splitlines():
        if line.startswith("events:"):
            names = line.split()[1:]
        elif line.startswith(("summary:", "totals:")):
            totals = [int(x) for x in line.split()[1:]]
    return dict(zip(names, totals + [0] * (len(names) - len(totals)), strict=True))


@dataclass(frozen=True)
class Setup:
    """One point to measure: a tree, a size, and how to run it (``main``'s options)."""

    tree: Path
    tenants: int
    tickets: int
    keep: Path  # where callgrind writes
    loop: str
    clock_step: float | None
    cache_sim: bool = False


def _run(setup: Setup, cycles: int) -> dict[str, int]:
    """The event totals of one process running ``cycles`` cycles under callgrind."""
    tree, tenants, tickets, loop, clock_step = (
        setup.tree,
        setup.tenants,
        setup.tickets,
        setup.loop,
        setup.clock_step,
    )
    out = setup.keep / f"callgrind.{tenants}.{tickets}.{cycles}.out"
    env = dict(os.environ)
    here = Path(__file__).resolve().parents[1]
    env["PYTHONPATH"] = os.pathsep.join([str(tree), str(here), env.get("PYTHONPATH", "")])
    # The process ends with os._exit right after the last cycle (callgrind still writes its counts),
    # so both runs are start-up + filling the queue + their cycles, and nothing after.
    code = (
        f"import os, runpy, {loop}; "
        f"m = runpy.run_path({__file__!r}); "
        f"{loop}.run(m['_cycles']({tenants}, {tickets}, {cycles}, lambda: os._exit(0), {clock_step!r})); "
        "os._exit(3)"
    )
    cmd = ["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}"]
    if setup.cache_sim:
        cmd.append("--cache-sim=yes")
    cmd += [sys.executable, "-c", code]
    done = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True, timeout=3600)
    if done.returncode != 0:
        raise RuntimeError(f"{tree}: {done.stderr[-2000:]}")
    return callgrind_events(out)


def point(setup: Setup, cycles: int) -> dict[str, Any]:
    one = _run(setup, cycles)
    two = _run(setup, 2 * cycles)
    per = {name: (two[name] - one[name]) / cycles for name in two}
    row: dict[str, Any] = {
        "tree": str(setup.tree),
        "tenants": setup.tenants,
        "tickets": setup.tickets,
        "cycles": cycles,
        "loop": setup.loop,
        "clock_step": setup.clock_step,
        "per_cycle": per["Ir"],
    }
    if setup.cache_sim:
        row["d1_misses_per_cycle"] = per["D1mr"] + per["D1mw"]
        row["ll_misses_per_cycle"] = per["DLmr"] + per["DLmw"]
    return row


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m research.cycle_instructions",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--tree", type=Path, action="append", help="checkout to measure (repeatable; default: this one)"
    )
    p.add_argument("--sizes", default="10:100,10000:100000", help="tenants:tickets,... (default %(default)s)")
    p.add_argument("--cycles", type=int, default=2000, help="cycles of the shorter run (default %(default)s)")
    p.add_argument(
        "--loop",
        default="uvloop",
        choices=("uvloop", "asyncio"),
        help="event loop (default %(default)s, the gateway's)",
    )
    p.add_argument(
        "--clock",
        default="virtual",
        choices=("virtual", "real"),
        help="the store's clock: virtual (--clock-step per read, the default) or real (monotonic)",
    )
    p.add_argument(
        "--clock-step",
        type=float,
        default=CLOCK_STEP,
        help="seconds the virtual clock moves per read (default %(default)s)",
    )
    p.add_argument(
        "--cache-sim",
        action="store_true",
        help="also count first- and last-level data cache misses per cycle (about twice as slow)",
    )
    p.add_argument("--keep", help="keep the callgrind output here")
    args = p.parse_args(argv)
    step = None if args.clock == "real" else args.clock_step
    if shutil.which("valgrind") is None:
        print("valgrind not found: install valgrind (apt-get install -y valgrind)", file=sys.stderr)
        return 2
    trees = [t.resolve() for t in args.tree] if args.tree else [Path(__file__).resolve().parents[1]]
    keep = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="tg-cycle-cg-"))
    keep.mkdir(parents=True, exist_ok=True)
    try:
        for size in args.sizes.split(","):
            tenants, tickets = (int(x) for x in size.split(":"))
            for tree in trees:
                setup = Setup(tree, tenants, tickets, keep, args.loop, step, args.cache_sim)
                row = point(setup, args.cycles)
                misses = ""
                if args.cache_sim:
                    misses = (
                        f", {row['d1_misses_per_cycle']:,.0f} first-level and "
                        f"{row['ll_misses_per_cycle']:,.1f} last-level data cache misses"
                    )
                print(
                    f"{row['tenants']:>7} tenants {row['tickets']:>8} tickets  {tree}: "
                    f"{row['per_cycle']:,.0f} instructions per cycle{misses}",
                    flush=True,
                )
                print(json.dumps(row), flush=True)
    finally:
        if not args.keep:
            shutil.rmtree(keep, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

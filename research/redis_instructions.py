"""Redis instructions per script call: a deterministic figure for what the Lua code costs Redis.

Run: ``python -m research.redis_instructions`` (needs ``valgrind``; about a minute per point
on 2 cores). ``--tree DIR`` measures another checkout (a ``git worktree`` of an older commit that
has ``loadtest/bench/scale.py`` with ``--lua``) with this harness, so two versions of the Lua code
are compared on the same footing.

Redis CPU per cycle (``loadtest.bench.scale``) moves by ±25 % between runs on a shared VM, which
hides changes of 5 or 10 %. Counting instructions does not: ``redis-server`` runs under
``valgrind --tool=callgrind`` with instrumentation off while the scale benchmark fills the domain
(``tenants`` tenants, ``tickets`` waiting tickets on one full pool), on for the measured window,
and the driver (not under valgrind) runs the benchmark's cycles: a release that grants one ticket
and the granted tenant's new acquire, one script call each (``single``), 32 cycles per ``batch``
call (``batch``), or acquire + release with nothing queued (``fast``). Redis' own ``INFO
commandstats`` counts the calls in the window; the figure is the instructions Redis executed in
the window (everything: the Lua VM, the commands, the network) per script call.

The cycles run on a virtual clock (``--clock virtual``, the default): the scripts' clock override,
moving 200 us per cycle, about a cycle's time at full speed. On Redis' own clock (``--clock
server``, as before 2026-12-01) the 50-times-slower Redis under valgrind aged every head within a
few cycles, and what the window measured drifted by a few per cent from run to run with how fast
valgrind happened to run; on the virtual clock two runs of one tree hold the same state after N
cycles. An older tree measured with ``--clock virtual`` needs this harness's
``loadtest/bench/scale.py`` copied into it (its ``Driver`` runs the virtual clock).

``--redis-option NAME=VALUE`` starts the measured Redis with a setting of its own (e.g.
``zset-max-listpack-entries=0``: every sorted set a skiplist), to price a Redis-side tuning the
same way.

The counts are repeatable to about 1 %. A cost-centre list of the window is written next to the
callgrind output (``--keep DIR``): libc's number formatting (``__printf_fp_l``) and parsing
(``strtod``) show up there by name; Redis' own functions only with a redis-server that has
symbols.
"""

from __future__ import annotations

import argparse
import asyncio
import inspect
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

MODES = ("single", "batch", "fast")
# Seconds per cycle of the virtual clock (``--clock virtual``): about what a cycle takes at full
# speed on the development VM, so heads age as they do there.
CLOCK_STEP = 0.0002


def callgrind_total(out: Path) -> int:
    """The instruction total of a callgrind run written to ``out`` (and its numbered dumps)."""
    total = 0
    for f in out.parent.glob(out.name + "*"):
        for line in f.read_text(errors="replace").splitlines():
            m = re.match(r"(?:summary|totals): (\d+)", line)
            if m:
                total = max(total, int(m.group(1)))
    return total


async def _control(*args: str) -> None:
    proc = await asyncio.create_subprocess_exec(
        "callgrind_control", *args, stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL
    )
    if await proc.wait() != 0:
        raise RuntimeError(f"callgrind_control {' '.join(args)} failed")


async def _measure(
    url: str, pid: int, tenants: int, tickets: int, mode: str, seconds: float, clock_step: float | None
) -> dict[str, Any]:
    """One point, in this process: the tree's scale benchmark against the Redis under callgrind."""
    from redis.asyncio import Redis

    from loadtest.bench import scale  # the measured tree's (PYTHONPATH)

    window: dict[str, int] = {}
    measure_cpu = scale.redis_cpu

    async def switched(client: Redis) -> float:
        # The benchmark reads Redis' CPU just before and just after its measured window.
        cpu = await measure_cpu(client)
        if not window:
            await client.config_resetstat()
            await _control("-i", "on", str(pid))
            window["on"] = 1
        elif "calls" not in window:
            await _control("-i", "off", str(pid))
            stats = await client.info("commandstats")
            window["calls"] = sum(
                int(v["calls"]) for k, v in stats.items() if k in ("cmdstat_fcall", "cmdstat_evalsha")
            )
        return cpu

    scale.redis_cpu = switched  # type: ignore[assignment]
    if mode == "fast":
        row = await scale.redis_fast_path(url, tenants, seconds, 32, "functions")
    else:
        clock: dict[str, Any] = {}
        if clock_step is not None:
            if "clock_step" not in inspect.signature(scale.redis_cycles).parameters:
                raise RuntimeError(
                    "this tree's loadtest/bench/scale.py has no virtual clock: use --clock server"
                )
            clock = {"clock_step": clock_step}
        row = await scale.redis_cycles(
            url, tenants, tickets, seconds, 32, mode == "batch", "functions", **clock
        )
    return {"calls": window.get("calls", 0), "row": {k: v for k, v in row.items() if not isinstance(v, dict)}}


def _child(args: argparse.Namespace) -> int:
    """Start Redis under callgrind, measure one point, print one JSON line."""
    import json

    from loadtest.processes import free_port

    keep = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="tg-redis-cg-"))
    keep.mkdir(parents=True, exist_ok=True)
    port = free_port()
    out = keep / f"callgrind.{args.mode}.{args.tenants}.{args.tickets}.{port}.out"
    server = shutil.which("redis-server") or "/usr/bin/redis-server"
    proc = subprocess.Popen(
        ["valgrind", "--tool=callgrind", "--instr-atstart=no", f"--callgrind-out-file={out}",
         server, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
         "--dir", str(keep), *json.loads(args.server_args)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        from loadtest.redis_server import ping

        for _ in range(600):
            if ping(port) or proc.poll() is not None:
                break
            time.sleep(0.1)
        if not ping(port):
            raise RuntimeError("redis-server under valgrind did not start")
        url = f"redis://127.0.0.1:{port}/0"
        step = None if args.clock == "server" else CLOCK_STEP
        got = asyncio.run(_measure(url, proc.pid, args.tenants, args.tickets, args.mode, args.seconds, step))
        subprocess.run(["callgrind_control", "-d", str(proc.pid)], check=True, capture_output=True)
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    total = callgrind_total(out)
    calls = max(1, got["calls"])
    annotate = shutil.which("callgrind_annotate")
    if annotate:
        dumps = sorted(keep.glob(out.name + ".*")) or [out]
        text = subprocess.run([annotate, str(dumps[-1])], capture_output=True, text=True).stdout
        (keep / (out.name + ".txt")).write_text(text)
    print(json.dumps({"instructions": total, "calls": got["calls"], "per_call": total / calls, **got["row"]}))
    if not args.keep:
        shutil.rmtree(keep, ignore_errors=True)
    return 0


def _point(
    tree: Path,
    mode: str,
    tenants: int,
    tickets: int,
    seconds: float,
    keep: str | None,
    clock: str,
    server_args: list[str] | None = None,
) -> dict[str, Any]:
    import json

    env = dict(os.environ)
    here = Path(__file__).resolve().parents[1]
    # The measured tree's packages first; this harness's own helpers (loadtest.processes, ...)
    # exist in every tree it supports.
    env["PYTHONPATH"] = os.pathsep.join([str(tree), str(here), env.get("PYTHONPATH", "")])
    child = [
        "--child",
        "--mode",
        mode,
        "--tenants",
        str(tenants),
        "--tickets",
        str(tickets),
        "--seconds",
        str(seconds),
        "--clock",
        clock,
    ]
    if keep:
        child += ["--keep", keep]
    if server_args:
        child += ["--server-args", json.dumps(server_args)]
    # Run as a file: the trees it compares with may lack this module.
    run = f"import runpy, sys; sys.argv = {[__file__, *child]!r}; runpy.run_path({__file__!r}, run_name='__main__')"
    cmd = [sys.executable, "-c", run]
    done = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True, timeout=3600)
    if done.returncode != 0:
        raise RuntimeError(f"{tree} {mode}: {done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m research.redis_instructions",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--tree", type=Path, action="append", help="checkout to measure (repeatable; default: this one)"
    )
    p.add_argument("--sizes", default="1000:10000", help="tenants:tickets,... (default %(default)s)")
    p.add_argument("--modes", default="single,batch", help=f"of {','.join(MODES)} (default %(default)s)")
    p.add_argument("--seconds", type=float, default=6.0, help="measured window per point (under valgrind)")
    p.add_argument("--keep", help="keep the callgrind output and its annotation here")
    p.add_argument(
        "--clock",
        default="virtual",
        choices=("virtual", "server"),
        help="cycles: the scripts' clock override moving 200 us per cycle (default; the same state "
        "after N cycles whatever the speed) or Redis' own TIME (as older trees' benchmarks ran)",
    )
    p.add_argument(
        "--redis-option",
        action="append",
        metavar="NAME=VALUE",
        help="a redis-server setting for the measured Redis, e.g. zset-max-listpack-entries=0 "
        "(repeatable; default: Redis' defaults, as the gateway finds them)",
    )
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    # The child gets redis-server's own arguments: an older tree's loadtest has no config_args.
    p.add_argument("--server-args", default="[]", help=argparse.SUPPRESS)
    p.add_argument("--mode", default="single", choices=MODES, help=argparse.SUPPRESS)
    p.add_argument("--tenants", type=int, default=1000, help=argparse.SUPPRESS)
    p.add_argument("--tickets", type=int, default=10000, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        return _child(args)
    from loadtest.redis_server import config_args  # this harness's tree (a parent process)

    try:
        server_args = config_args(args.redis_option)
    except ValueError as e:
        p.error(str(e))
    for tool in ("valgrind", "callgrind_control"):
        if shutil.which(tool) is None:
            print(f"{tool} not found: install valgrind (apt-get install -y valgrind)", file=sys.stderr)
            return 2
    trees = [t.resolve() for t in args.tree] if args.tree else [Path(__file__).resolve().parents[1]]
    modes = [m for m in args.modes.split(",") if m]
    for m in modes:
        if m not in MODES:
            p.error(f"--modes: unknown mode {m!r}")
    for size in args.sizes.split(","):
        tenants, tickets = (int(x) for x in size.split(":"))
        for mode in modes:
            for tree in trees:
                r = _point(tree, mode, tenants, tickets, args.seconds, args.keep, args.clock, server_args)
                if r.get("cycles"):  # the driver's count of the window's cycles
                    per_cycle = f"{r['instructions'] / r['cycles']:,.0f} per cycle ({r['cycles']} cycles)"
                else:  # older trees' scale.py: from the calls (2 per cycle, or 32 cycles per batch)
                    per_cycle = (
                        f"~{r['per_call'] * (2 if mode in ('single', 'fast') else 1 / 32):,.0f} per cycle"
                    )
                print(
                    f"{mode:6s} {tenants:>7} tenants {tickets:>8} tickets  {tree}: "
                    f"{r['per_call']:>12,.0f} instructions per script call ({r['calls']} calls), {per_cycle}"
                )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

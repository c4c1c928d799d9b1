"""Redis budget store benchmark: grant+release cycles per second, and added latency vs memory.

Run: ``python -m loadtest.bench.redis`` (starts a private redis-server on a free port; ``--url``
uses an existing one, on a fresh key prefix). ``--help`` for knobs.

Measured:

* **latency**: one caller, acquire then release, one at a time (no contention, every grant on
  the fast path): p50/p99 of acquire, release and the cycle for the memory store and the Redis
  store, in interleaved rounds so machine drift hits both alike; the Redis store's *added*
  latency is the difference of the p50s;
* **throughput**: N concurrent callers per process cycling acquire+release for a fixed time,
  from one process and then from two processes at once (each its own RedisStore, i.e. its own
  replica), all on one Redis; cycles/s summed over processes, Redis CPU per cycle (INFO cpu),
  and how many operations the store packed into one script call on average.

Pools are large enough that nothing queues: this measures the grant path itself.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import statistics
import time
import uuid
from pathlib import Path
from typing import Any

from budgets.memory import MemoryStore
from budgets.redis import RedisOptions, RedisStore
from budgets.redis.options import LuaMode
from budgets.types import BudgetLayout, BudgetStore, Demand, PolicySpec, PoolSpec, TenantSpec, TierSpec
from loadtest.bench import percentile_ms
from loadtest.redis_server import RedisServer, used_cpu_seconds

BIG = 10**12
TENANTS = 8


def bench_layout() -> BudgetLayout:
    pools = {"backend:main": PoolSpec("backend:main", BIG)}
    pools.update({f"tenant:t{i}": PoolSpec(f"tenant:t{i}", BIG, shared=False) for i in range(TENANTS)})
    return BudgetLayout(
        pools=pools,
        tiers={"standard": TierSpec("standard", 1, 0.9, 60.0)},
        tenants={f"t{i}": TenantSpec(f"t{i}", 1.0) for i in range(TENANTS)},
        policy=PolicySpec(lease_ttl_s=30.0),
    )


def demand(i: int) -> Demand:
    t = f"t{i % TENANTS}"
    return Demand(t, "standard", ("backend:main", f"tenant:{t}"), prefill=200, decode=100)


def redis_store(url: str, prefix: str, lua: LuaMode) -> RedisStore:
    return RedisStore(bench_layout(), RedisOptions(url=url, key_prefix=prefix, lua=lua))


# ---- latency ----


async def cycle_latencies(store: BudgetStore, n: int) -> tuple[list[float], list[float]]:
    acq, rel = [], []
    for i in range(n):
        t0 = time.perf_counter()
        lease = await store.acquire(demand(i), 10.0)
        t1 = time.perf_counter()
        await store.release(lease.id, actual_decode=50)
        t2 = time.perf_counter()
        acq.append(t1 - t0)
        rel.append(t2 - t1)
    return acq, rel


async def latency(url: str, n: int, rounds: int, lua: LuaMode) -> dict[str, Any]:
    mem = MemoryStore(bench_layout())
    red = redis_store(url, f"bench-{uuid.uuid4().hex[:8]}", lua)
    await mem.start()
    await red.start()
    samples: dict[str, dict[str, list[float]]] = {
        k: {"acquire": [], "release": []} for k in ("memory", "redis")
    }
    try:
        await cycle_latencies(mem, 200)  # warm-up
        await cycle_latencies(red, 200)
        for _ in range(rounds):
            for name, store in (("memory", mem), ("redis", red)):
                acq, rel = await cycle_latencies(store, n)
                samples[name]["acquire"] += acq
                samples[name]["release"] += rel
    finally:
        await mem.close()
        await red.close()
    out: dict[str, Any] = {}
    for name, s in samples.items():
        cycle = [a + r for a, r in zip(s["acquire"], s["release"], strict=True)]
        out[name] = {
            "acquire_p50_ms": percentile_ms(s["acquire"], 50),
            "acquire_p99_ms": percentile_ms(s["acquire"], 99),
            "release_p50_ms": percentile_ms(s["release"], 50),
            "cycle_p50_ms": percentile_ms(cycle, 50),
            "cycle_p99_ms": percentile_ms(cycle, 99),
        }
    out["added_cycle_p50_ms"] = out["redis"]["cycle_p50_ms"] - out["memory"]["cycle_p50_ms"]
    out["added_acquire_p50_ms"] = out["redis"]["acquire_p50_ms"] - out["memory"]["acquire_p50_ms"]
    return out


# ---- throughput ----


async def run_workers(
    url: str, prefix: str, concurrency: int, duration: float, lua: LuaMode
) -> dict[str, float]:
    store = redis_store(url, prefix, lua)
    await store.start()
    cycles = 0
    stop_at = 0.0

    async def worker(w: int) -> None:
        nonlocal cycles
        i = w
        while time.perf_counter() < stop_at:
            lease = await store.acquire(demand(i), 10.0)
            await store.release(lease.id, actual_decode=50)
            cycles += 1
            i += concurrency

    try:
        for _ in range(50):  # warm-up (scripts loaded, connections open)
            lease = await store.acquire(demand(0), 10.0)
            await store.release(lease.id)
        started = time.perf_counter()
        stop_at = started + duration
        await asyncio.gather(*(worker(w) for w in range(concurrency)))
        elapsed = time.perf_counter() - started
        return {"cycles": cycles, "seconds": elapsed, "ops_per_call": store.ops_per_batch}
    finally:
        await store.close()


def _worker_main(
    url: str, prefix: str, concurrency: int, duration: float, lua: LuaMode, start_at: float, out: Any
) -> None:
    time.sleep(max(0.0, start_at - time.time()))
    cpu0 = time.process_time()
    result = asyncio.run(run_workers(url, prefix, concurrency, duration, lua))
    out.put({**result, "cpu_s": time.process_time() - cpu0})  # the driving process's own CPU


def redis_cpu(url: str) -> float:
    import redis

    return used_cpu_seconds(redis.Redis.from_url(url))


def throughput(url: str, processes: int, concurrency: int, duration: float, lua: LuaMode) -> dict[str, float]:
    prefix = f"bench-{uuid.uuid4().hex[:8]}"
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    start_at = time.time() + 3.0  # all processes imported and connected before the clock starts
    procs = [
        ctx.Process(target=_worker_main, args=(url, prefix, concurrency, duration, lua, start_at, out))
        for _ in range(processes)
    ]
    for p in procs:
        p.start()
    time.sleep(max(0.0, start_at - time.time()))
    cpu0 = redis_cpu(url)
    results = [out.get(timeout=duration + 60) for _ in procs]
    cpu1 = redis_cpu(url)
    for p in procs:
        p.join()
    cycles = sum(r["cycles"] for r in results)
    rate = sum(r["cycles"] / r["seconds"] for r in results)
    return {
        "processes": processes,
        "concurrency_per_process": concurrency,
        "cycles_per_s": rate,
        "redis_cpu_us_per_cycle": (cpu1 - cpu0) / max(1, cycles) * 1e6,
        "ops_per_script_call": statistics.mean(r["ops_per_call"] for r in results),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m loadtest.bench.redis",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--url", help="an existing Redis (default: start a private redis-server)")
    parser.add_argument("--cycles", type=int, default=2000, help="latency: cycles per store per round")
    parser.add_argument("--rounds", type=int, default=3, help="latency: interleaved rounds")
    parser.add_argument("--concurrency", type=int, default=32, help="throughput: callers per process")
    parser.add_argument("--duration", type=float, default=5.0, help="throughput: seconds per run")
    parser.add_argument(
        "--lua", default="functions", choices=("functions", "scripts"), help="the store's store.lua"
    )
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args(argv)
    lua: LuaMode = "scripts" if args.lua == "scripts" else "functions"
    private = None if args.url else RedisServer().start()
    url = args.url or private.url  # type: ignore[union-attr]
    try:
        results: dict[str, Any] = {"latency": asyncio.run(latency(url, args.cycles, args.rounds, lua))}
        results["throughput"] = [throughput(url, n, args.concurrency, args.duration, lua) for n in (1, 2)]
    finally:
        if private is not None:
            private.stop()
    lat = results["latency"]
    print("latency (one caller, ms)        acquire p50   release p50   cycle p50   cycle p99")
    for name in ("memory", "redis"):
        r = lat[name]
        print(
            f"  {name:<28} {r['acquire_p50_ms']:>11.3f} {r['release_p50_ms']:>13.3f} "
            f"{r['cycle_p50_ms']:>11.3f} {r['cycle_p99_ms']:>11.3f}"
        )
    print(
        f"  added by redis (p50): acquire {lat['added_acquire_p50_ms']:.3f} ms, cycle {lat['added_cycle_p50_ms']:.3f} ms"
    )
    print("throughput (grant+release cycles/s against one Redis)")
    for t in results["throughput"]:
        print(
            f"  {t['processes']} process(es) x {t['concurrency_per_process']} callers: "
            f"{t['cycles_per_s']:,.0f} cycles/s, Redis CPU {t['redis_cpu_us_per_cycle']:.0f} us/cycle, "
            f"{t['ops_per_script_call']:.1f} ops per script call"
        )
    print(f"load average: {os.getloadavg()[0]:.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Budget domains on Redis Cluster: aggregate grant+release cycles/s, one shard against several.

Run: ``python -m loadtest.bench.cluster`` (starts its own clusters on loopback ports).

One budget domain is one slot, so one primary serves it whatever the cluster's size; a cluster
scales by domains (one ``key_prefix`` per region, fleet or pool group). This runs ``--domains``
independent domains, each driven by its own process of ``--concurrency`` callers cycling
acquire+release (``loadtest.bench.redis``'s throughput worker), on a one-primary cluster and then
on a ``--shards``-primary cluster with the domains chosen to land one per shard, and reports the
aggregate cycles/s of each and their ratio. The ratio can only show what the machine's cores
allow: every Redis primary and every driving process needs a core of its own.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import sys
import time
import uuid
from typing import Any

from budgets.redis.cluster import slot_of
from loadtest.bench.redis import _worker_main, redis_cpu
from loadtest.redis_server import RedisCluster


def spread_prefixes(cluster: RedisCluster, domains: int) -> list[str]:
    """``domains`` key prefixes whose slots land on the cluster's primaries in turn."""
    wanted = [cluster.nodes[i % len(cluster.nodes)].port for i in range(domains)]
    out: list[str] = []
    while len(out) < domains:
        prefix = f"bench-{uuid.uuid4().hex[:8]}"
        if cluster.owner(slot_of("{tg:" + prefix + "}")).port == wanted[len(out)]:
            out.append(prefix)
    return out


def run(shards: int, domains: int, concurrency: int, duration: float) -> dict[str, Any]:
    cluster = RedisCluster(masters=shards).start()
    try:
        prefixes = spread_prefixes(cluster, domains)
        ctx = multiprocessing.get_context("spawn")
        out = ctx.Queue()
        start_at = time.time() + 3.0  # every process imported and connected before the clock starts
        procs = [
            ctx.Process(
                target=_worker_main,
                args=(cluster.url, prefix, concurrency, duration, "functions", start_at, out),
            )
            for prefix in prefixes
        ]
        for p in procs:
            p.start()
        time.sleep(max(0.0, start_at - time.time()))
        cpu0 = [redis_cpu(n.url) for n in cluster.nodes]
        results = [out.get(timeout=duration + 60) for _ in procs]
        cpu1 = [redis_cpu(n.url) for n in cluster.nodes]
        for p in procs:
            p.join()
        per_domain = [r["cycles"] / r["seconds"] for r in results]
        cycles = max(1, sum(r["cycles"] for r in results))
        return {
            "shards": shards,
            "domains": domains,
            "cycles_per_s": sum(per_domain),
            "per_domain": per_domain,
            # CPU per cycle: every primary's own (INFO cpu) and the driving processes' (a gateway's
            # share of the work), what the cost model below divides the machine's cores by.
            "redis_us_per_cycle": (sum(cpu1) - sum(cpu0)) / cycles * 1e6,
            "client_us_per_cycle": sum(r["cpu_s"] for r in results) / cycles * 1e6,
            "busiest_primary_cpu": max(b - a for a, b in zip(cpu0, cpu1, strict=True)) / duration,
        }
    finally:
        cluster.stop()


def cost_model(one: dict[str, Any], shards: int, used: int, cores: int) -> dict[str, float]:
    """What the cores allow, from the one-shard run's CPU per cycle: a primary serves at most
    1/redis_us cycles/s (one core each); the whole machine at most cores/(redis_us + client_us),
    since every cycle also costs its driver (a gateway) CPU. ``used`` shards can give at most
    ``used`` x one primary's ceiling; the ratio a machine can show is capped by its cores, and the
    cores a ratio needs are ratio x (redis_us + client_us) / redis_us."""
    r, c = one["redis_us_per_cycle"], one["client_us_per_cycle"]
    one_ceiling = 1e6 / r
    machine = cores * 1e6 / (r + c)
    return {
        "redis_us": r,
        "client_us": c,
        "one_shard_ceiling": one_ceiling,
        "machine_ceiling": machine,
        "shards_used": float(used),
        "ratio_ceiling_here": min(float(used), machine / min(one_ceiling, machine)),
        "cores_for_2_5x": 2.5 * (r + c) / r,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m loadtest.bench.cluster",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--shards", type=int, default=3, help="primaries of the larger cluster")
    parser.add_argument("--domains", type=int, default=3, help="independent budget domains, one process each")
    parser.add_argument("--concurrency", type=int, default=32, help="callers per domain")
    parser.add_argument("--duration", type=float, default=5.0, help="seconds per run")
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args(argv)
    one = run(1, args.domains, args.concurrency, args.duration)
    many = run(args.shards, args.domains, args.concurrency, args.duration)
    ratio = many["cycles_per_s"] / one["cycles_per_s"]
    cores = os.cpu_count()
    print("command: python -m loadtest.bench.cluster " + " ".join(sys.argv[1:] if argv is None else argv))
    print(f"{args.domains} domains x {args.concurrency} callers, {args.duration:g} s, {cores} CPU cores")
    for r in (one, many):
        print(
            f"- {r['shards']} shard(s): **{r['cycles_per_s']:,.0f}** cycles/s "
            f"(per domain {', '.join(f'{c:,.0f}' for c in r['per_domain'])})"
        )
    print(f"- {args.shards} shards / 1 shard: **{ratio:.2f}x**")
    model = cost_model(one, args.shards, min(args.shards, args.domains), cores or 1)
    print(
        f"- cost model: Redis {model['redis_us']:.0f} us + drivers {model['client_us']:.0f} us CPU per "
        f"cycle; one primary saturates at {model['one_shard_ceiling']:,.0f} cycles/s, "
        f"{cores} cores at {model['machine_ceiling']:,.0f}; {args.shards} shards could reach "
        f"{model['ratio_ceiling_here']:.2f}x here, 2.5x needs >= {model['cores_for_2_5x']:.1f} cores "
        f"({model['shards_used']:.0f} shards used at most)"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {"one": one, "many": many, "ratio": ratio, "cpu_cores": cores, "model": model}, f, indent=2
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

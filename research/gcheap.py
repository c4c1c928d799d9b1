"""What Python's garbage collector costs the gateway: the start-up heap a full collection walks,
and how often full collections come under load, with that heap frozen and without.

Run: ``python -m research.gcheap`` (``--requests``, ``--concurrency``; ``--help``). It builds
the gateway as ``tokengate serve`` does with no config (two embedded simulated backends, real
sockets to them, instant answers), runs its start-up, then:

* **heap**: container objects the collector tracks, and the median time of a full collection
  (``gc.collect()``, five times), before and after ``gateway.process.serve.freeze_startup_heap``;
* **under load**: ``--requests`` chat requests at ``--concurrency`` through the ASGI app (httpx's
  ASGI transport, the upstream over real sockets), first with nothing frozen on Python's default
  thresholds, then frozen, then frozen on the config's ``gc`` thresholds
  (``gateway.process.serve.tune_collector``: what ``tokengate serve`` runs), each phase counting
  collections per generation and their time (``gc.callbacks``).

Results and the command: docs/benchmarks.md, "Garbage collection".
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import statistics
import time
from pathlib import Path
from typing import Any

import httpx

from gateway.app import build_app
from gateway.config.loader import parse_config
from gateway.process.embedded import start_embedded, with_embedded_pool
from gateway.process.serve import freeze_startup_heap, tune_collector


def full_collection_ms(times: int = 5) -> float:
    spent = []
    for _ in range(times):
        started = time.perf_counter()
        gc.collect()
        spent.append(time.perf_counter() - started)
    return statistics.median(spent) * 1e3


class Pauses:
    """Collections per generation and the time they took, while installed."""

    def __init__(self) -> None:
        self.count = [0, 0, 0]
        self.seconds = [0.0, 0.0, 0.0]
        self.longest = [0.0, 0.0, 0.0]
        self._started = 0.0

    def __call__(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._started = time.perf_counter()
            return
        g, spent = info["generation"], time.perf_counter() - self._started
        self.count[g] += 1
        self.seconds[g] += spent
        self.longest[g] = max(self.longest[g], spent)

    def summary(self, requests: int) -> dict[str, Any]:
        return {
            f"gen{g}": {
                "collections": self.count[g],
                "per_1000_requests": self.count[g] / requests * 1000,
                "total_ms": self.seconds[g] * 1e3,
                "longest_ms": self.longest[g] * 1e3,
            }
            for g in range(3)
        }


async def load(client: httpx.AsyncClient, requests: int, concurrency: int) -> dict[str, Any]:
    body = {"model": "tokengate-sim", "messages": [{"role": "user", "content": "hi there"}], "max_tokens": 8}
    pauses = Pauses()
    gc.callbacks.append(pauses)
    started = time.perf_counter()
    try:
        for _ in range(requests // concurrency):
            replies = await asyncio.gather(
                *(client.post("/v1/chat/completions", json=body) for _ in range(concurrency))
            )
            assert all(r.status_code == 200 for r in replies), [r.text for r in replies][:2]
    finally:
        gc.callbacks.remove(pauses)
    done = requests // concurrency * concurrency
    return {"requests": done, "seconds": time.perf_counter() - started, **pauses.summary(done)}


async def run(requests: int, concurrency: int) -> dict[str, Any]:
    config = parse_config({"embedded_backend": {"port": 0, "time_scale": 0.0}})
    gc.set_threshold(700, 10, 10)  # Python's defaults, whatever the caller set
    embedded = await start_embedded(config)
    app = build_app(with_embedded_pool(config, embedded))
    await app.startup()
    try:
        transport = httpx.ASGITransport(app=app)  # type: ignore[arg-type]
        async with httpx.AsyncClient(transport=transport, base_url="http://gateway", timeout=30) as client:
            await load(client, 200, concurrency)  # warm: connections, caches
            gc.collect()
            out: dict[str, Any] = {
                "tracked_objects": len(gc.get_objects()),
                "full_collection_ms": full_collection_ms(),
            }
            out["unfrozen"] = await load(client, requests, concurrency)
            freeze_startup_heap()
            out["frozen_objects"] = gc.get_freeze_count()
            out["full_collection_ms_frozen"] = full_collection_ms()
            out["frozen"] = await load(client, requests, concurrency)
            defaults = gc.get_threshold()
            tune_collector(config.gc)
            out["thresholds"] = gc.get_threshold()
            out["frozen_tuned"] = await load(client, requests, concurrency)
            gc.set_threshold(*defaults)
            gc.unfreeze()
    finally:
        await app.shutdown()
        await embedded.stop()
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m research.gcheap",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--requests", type=int, default=8000, help="requests per phase")
    parser.add_argument("--concurrency", type=int, default=16, help="requests in flight at once")
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args(argv)
    out = asyncio.run(run(args.requests, args.concurrency))
    print(
        f"start-up heap: {out['tracked_objects']:,} tracked objects; a full collection "
        f"{out['full_collection_ms']:.1f} ms, {out['full_collection_ms_frozen']:.2f} ms with "
        f"{out['frozen_objects']:,} frozen"
    )
    for phase in ("unfrozen", "frozen", "frozen_tuned"):
        p = out[phase]
        gens = ", ".join(
            f"gen{g}: {p[f'gen{g}']['collections']} ({p[f'gen{g}']['total_ms']:.1f} ms, "
            f"longest {p[f'gen{g}']['longest_ms']:.1f} ms)"
            for g in range(3)
        )
        print(f"{phase:>12}: {p['requests']:,} requests in {p['seconds']:.1f} s; collections {gens}")
    print(f"(frozen_tuned: thresholds {out['thresholds']}, config gc)")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""What holding request bodies costs the gateway's memory (run: ``python -m loadtest.bench.held_memory``).

``limits.max_held_body_bytes`` bounds the request bodies a gateway process holds (gateway/
held_bodies.py), counted once each; the process holds more than that per body (the body parsed, and
serialized again to send). This spawns ``tokengate serve`` in front of a stub backend that answers
after ``--hold-s`` seconds, sends ``--tenants`` × ``--per-tenant`` chat bodies of ``--body-bytes``
never-seen prose at once, and reports the gateway's resident memory (``VmRSS``) before and at its
peak against the bytes ``/stats`` says it holds: the factor to size a container by.
``--capacity`` sets the pool's tokens (default: all the bodies fit, so all are forwarded at once);
about one body's tokens makes the rest wait in the admission queue, held there instead.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import orjson

from loadtest.bench.overhead import spawn_gateway, wait_ready
from loadtest.processes import free_port
from loadtest.stub_backend import StubBackend, StubConfig

MODEL = "tokengate-sim"
_WORDS = "the model token budget queue tenant prefill decode cache batch stream gateway latency".split()


def rss_mib(pid: int) -> float:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(status.split("VmRSS:")[1].split()[0]) / 1024


def chat_body(rng: random.Random, size: int) -> bytes:
    empty = {"model": MODEL, "max_tokens": 1, "messages": [{"role": "user", "content": ""}]}
    pad = size - len(orjson.dumps(empty))
    text = " ".join(rng.choice(_WORDS) for _ in range(pad // 6 + 1))[:pad]
    return orjson.dumps({**empty, "messages": [{"role": "user", "content": text}]})


async def measure(
    tenants: int, per_tenant: int, body_bytes: int, hold_s: float, capacity: int = 10**9
) -> dict[str, Any]:
    stub = await StubBackend(StubConfig(first_token_delay_s=hold_s, model=MODEL)).start()
    with tempfile.TemporaryDirectory() as tmp:
        names = [f"t{i}" for i in range(tenants)]
        cfg = Path(tmp) / "gw.yaml"
        cfg.write_text(
            orjson.dumps(
                {
                    "ops": {"port": free_port()},
                    "pools": {
                        "default": {
                            "backends": [{"url": stub.url, "capacity_tokens": capacity, "models": [MODEL]}]
                        }
                    },
                    "models": {MODEL: {"context_length": 10**8}},
                    "tenants": {n: {"keys": [f"key-{n}"]} for n in names},
                    "limits": {"max_held_body_bytes": 2**40, "max_held_body_bytes_per_tenant": 2**40},
                    "drain_timeout_s": 1,  # (at the end, queued requests are dropped, not waited for)
                }
            ).decode()
        )
        ops = "http://127.0.0.1:" + str(orjson.loads(cfg.read_text())["ops"]["port"])
        port = free_port()
        gw = spawn_gateway(cfg, port, access_log=False)
        try:
            await asyncio.to_thread(wait_ready, f"http://127.0.0.1:{port}/readyz")
            rng = random.Random(1)
            bodies = [(n, chat_body(rng, body_bytes)) for n in names for _ in range(per_tenant)]
            before = rss_mib(gw.pid)
            limits = httpx.Limits(max_connections=len(bodies) + 8)
            async with httpx.AsyncClient(timeout=hold_s * 4 + 60, limits=limits) as c:
                sends = [
                    asyncio.create_task(
                        c.post(
                            f"http://127.0.0.1:{port}/v1/chat/completions",
                            content=raw,
                            headers={"authorization": f"Bearer key-{n}", "content-type": "application/json"},
                        )
                    )
                    for n, raw in bodies
                ]
                peak, held = before, 0
                deadline = time.monotonic() + hold_s
                while time.monotonic() < deadline and not all(s.done() for s in sends):
                    await asyncio.sleep(0.2)
                    peak = max(peak, rss_mib(gw.pid))
                    held = max(held, (await c.get(ops + "/stats")).json()["held_bodies"]["bytes"])
                finished, waiting = await asyncio.wait(sends, timeout=hold_s + 10)
                for s in waiting:
                    s.cancel()  # (still queued behind the others: not part of the measurement)
                statuses = sorted({s.result().status_code for s in finished if s.exception() is None})
        finally:
            gw.terminate()
            gw.wait(10)
            await stub.close()
    held_mib = held / 2**20
    return {
        "bodies": len(bodies),
        "body_bytes": body_bytes,
        "held_mib": held_mib,
        "rss_before_mib": before,
        "rss_peak_mib": peak,
        "factor": (peak - before) / held_mib if held_mib else float("nan"),
        "statuses": statuses,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m loadtest.bench.held_memory", description=__doc__)
    parser.add_argument("--tenants", type=int, default=4)
    parser.add_argument("--per-tenant", type=int, default=15)
    parser.add_argument("--body-bytes", type=int, default=4_000_000)
    parser.add_argument("--hold-s", type=float, default=20.0, help="how long the backend takes to answer")
    parser.add_argument("--capacity", type=int, default=10**9, help="the pool's capacity_tokens")
    args = parser.parse_args(argv)
    if min(args.tenants, args.per_tenant, args.body_bytes) < 1 or args.hold_s <= 0:
        parser.error("--tenants, --per-tenant, --body-bytes and --hold-s must be positive")
    r = asyncio.run(measure(args.tenants, args.per_tenant, args.body_bytes, args.hold_s, args.capacity))
    print(
        f"{r['bodies']} bodies of {r['body_bytes']:,} bytes: {r['held_mib']:.0f} MiB held at most; gateway RSS "
        f"{r['rss_before_mib']:.0f} MiB before, {r['rss_peak_mib']:.0f} MiB at its peak: "
        f"{r['factor']:.2f}x the bytes held (answered so far: {r['statuses'] or 'none'})"
    )


if __name__ == "__main__":
    main()

"""Instructions per request in the gateway process: a deterministic figure for the gateway's overhead.

Run: ``python -m research.instructions`` (needs ``valgrind``; about three minutes on 2 cores).
``--tree DIR`` measures another checkout (e.g. a ``git worktree`` of an older commit) with this
harness, so two commits are compared on the same footing.

CPU time per request (``loadtest.bench.overhead``) moves by ±15 % between runs on a shared VM, which
hides changes of a few percent. Counting instructions does not: ``tokengate serve`` runs under
``valgrind --tool=callgrind`` (≈50× slower, so the load is small), in front of the benchmark's stub
backend (``loadtest.bench.servers``, not under valgrind), and a client sends a fixed number of
non-streaming chat completions (``--concurrency`` at a time, keep-alive). Two gateways are run, one
with ``--base`` requests and one with ``--base + --requests``; the difference of their instruction
totals divided by ``--requests`` is the cost of one request with start-up, imports and shutdown
cancelled out. What runs on timers (health probes, window rolls) is counted too, a few thousand
instructions per request at most: the runs differ in length.

The figure covers everything the gateway process does for a request: parsing HTTP, the app's seven
steps, aiohttp's upstream call, relaying, the access line (on, to /dev/null) and metrics.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from loadtest.bench.servers import MODEL
from loadtest.processes import child_env, free_port
from loadtest.traces import repo_root

PROMPT = "Say something short about the weather in a sentence or two."


async def _send(url: str, n: int, concurrency: int) -> int:
    """``n`` non-streaming chat completions, ``concurrency`` at a time; returns how many were not 200."""
    import aiohttp
    import orjson

    body = orjson.dumps(
        {"model": MODEL, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 16, "stream": False}
    )
    headers = {"content-type": "application/json", "authorization": "Bearer bench"}
    left, bad = n, 0
    async with aiohttp.ClientSession() as s:

        async def worker() -> None:
            nonlocal left, bad
            while left > 0:
                left -= 1
                async with s.post(url, data=body, headers=headers) as r:
                    await r.read()
                    bad += r.status != 200

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return bad


def _wait_ready(url: str, proc: subprocess.Popen[bytes], timeout_s: float) -> None:
    import urllib.request

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the gateway exited during start-up (rc {proc.returncode})")
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise SystemExit(f"the gateway under valgrind was not ready within {timeout_s:.0f} s")


def run_once(tree: Path, stub_url: str, requests: int, concurrency: int, tmp: Path) -> int:
    """Total instructions of one gateway process that served ``requests`` requests."""
    cfg = tmp / f"gw-{requests}.yaml"
    ops = "ops: {port: 0}\n" if (tree / "gateway" / "admin").is_dir() else ""  # older trees lack it
    cfg.write_text(
        ops + f"pools:\n  default:\n    backends:\n"
        f"      - {{url: {stub_url}, capacity_tokens: 100000000, models: [{MODEL}]}}\n"
    )
    port = free_port()
    out = tmp / f"callgrind-{requests}.out"
    log = tmp / f"valgrind-{requests}.log"
    env = child_env()
    env["PYTHONPATH"] = f"{tree}{os.pathsep}{env['PYTHONPATH']}"  # this tree's packages first
    with open(log, "wb") as err, open(os.devnull, "wb") as devnull:
        proc = subprocess.Popen(
            ["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}", sys.executable,
             "-m", "gateway.cli", "serve", "--config", str(cfg), "--port", str(port),
             "--log-level", "warning", "--access-log"],
            cwd=tree, env=env, stdout=devnull, stderr=err,
        )  # fmt: skip
        try:
            _wait_ready(f"http://127.0.0.1:{port}/readyz", proc, timeout_s=600)
            bad = asyncio.run(_send(f"http://127.0.0.1:{port}/v1/chat/completions", requests, concurrency))
            if bad:
                raise SystemExit(f"{bad} of {requests} requests were not answered 200")
        finally:
            proc.send_signal(signal.SIGINT)
            proc.wait(timeout=300)
    m = re.search(r"Collected : (\d+)", log.read_text(errors="replace"))
    if m is None:
        raise SystemExit(f"no instruction total in {log}")
    return int(m.group(1))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m research.instructions",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--tree", type=Path, default=repo_root(), help="checkout whose gateway is measured")
    p.add_argument("--base", type=int, default=100, help="requests in the shorter run")
    p.add_argument("--requests", type=int, default=1000, help="extra requests in the longer run")
    p.add_argument("--concurrency", type=int, default=4)
    args = p.parse_args(argv)
    if shutil.which("valgrind") is None:
        print("valgrind is not installed (apt-get install -y valgrind)", file=sys.stderr)
        return 2
    stub_port = free_port()
    stub = subprocess.Popen(
        [sys.executable, "-m", "loadtest.bench.servers", "stub", "--port", str(stub_port)],
        cwd=repo_root(), env=child_env(), stdout=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        with tempfile.TemporaryDirectory() as d:
            tmp = Path(d)
            stub_url = f"http://127.0.0.1:{stub_port}"
            short = run_once(args.tree.resolve(), stub_url, args.base, args.concurrency, tmp)
            long = run_once(args.tree.resolve(), stub_url, args.base + args.requests, args.concurrency, tmp)
    finally:
        stub.terminate()
        stub.wait()
    per = (long - short) / args.requests
    print(f"{args.tree}: {per:,.0f} instructions per request ({short:,} and {long:,} in all)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

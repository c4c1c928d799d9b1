"""Head-of-line probe: short requests' TTFT alone, then beside one long prompt, against one URL.

    python -m loadtest.hol_probe --url http://127.0.0.1:8000 --long-tokens 28000 --out hol.json

A small, self-contained measurement for a real backend (e.g. the torch executor on a GPU), where the
full loadtest scenarios would take too long: ``--shorts`` streamed chat requests of
``--short-tokens`` prompt tokens are sent at ``--rate`` per second, first alone, then again with one
``--long-tokens`` prompt sent just before them. Reports TTFT p50/p99 of the short requests in both
runs, their ratio, and the long request's TTFT. Prompts come from ``loadtest.prompts`` (exact cl100k
token counts, a varied prefix per request so prefix caches cannot help).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import httpx

from gateway.observe.percentile import percentile
from loadtest.prompts import PromptFactory


@dataclass(frozen=True, slots=True)
class Shot:
    ttft_s: float | None
    e2e_s: float
    tokens: int
    status: int


async def one(client: httpx.AsyncClient, url: str, model: str, prompt: str, max_tokens: int) -> Shot:
    body = {
        "model": model,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "stream": True,
        "ignore_eos": True,
    }
    t0 = time.perf_counter()
    ttft: float | None = None
    tokens = 0
    async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as resp:
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            for choice in chunk.get("choices") or []:
                if (choice.get("delta") or {}).get("content"):
                    if ttft is None:
                        ttft = time.perf_counter() - t0
                    tokens += 1
        status = resp.status_code
    return Shot(ttft, time.perf_counter() - t0, tokens, status)


@dataclass(frozen=True, slots=True)
class Summary:
    label: str
    shorts: int
    ok: int
    ttft_p50_ms: float
    ttft_p99_ms: float
    long_ttft_ms: float | None


def _pct(values: list[float], q: float) -> float:
    p = percentile(values, q)
    return float("nan") if p is None else p


def summarize(label: str, shots: list[Shot], long_shot: Shot | None) -> Summary:
    ttfts = sorted(s.ttft_s * 1e3 for s in shots if s.ttft_s is not None)
    return Summary(
        label=label,
        shorts=len(shots),
        ok=sum(1 for s in shots if s.status == 200 and s.ttft_s is not None),
        ttft_p50_ms=_pct(ttfts, 50),
        ttft_p99_ms=_pct(ttfts, 99),
        long_ttft_ms=None if long_shot is None or long_shot.ttft_s is None else long_shot.ttft_s * 1e3,
    )


async def run_arm(args: argparse.Namespace, factory: PromptFactory, with_long: bool) -> Summary:
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), headers=_headers(args)) as client:
        # Warm the path (connection, kernels for this batch shape) before timing anything.
        await one(client, args.url, args.model, factory.text(args.short_tokens, 10_000), 4)
        long_task = None
        if with_long:
            long_prompt = factory.text(args.long_tokens, 20_000)
            long_task = asyncio.create_task(one(client, args.url, args.model, long_prompt, args.long_output))
            await asyncio.sleep(args.long_lead_s)
        tasks = []
        for i in range(args.shorts):
            prompt = factory.text(args.short_tokens, i + (1000 if with_long else 0))
            tasks.append(asyncio.create_task(one(client, args.url, args.model, prompt, args.short_output)))
            await asyncio.sleep(1.0 / args.rate)
        shots = list(await asyncio.gather(*tasks))
        long_shot = await long_task if long_task is not None else None
    return summarize("beside long" if with_long else "alone", shots, long_shot)


def _headers(args: argparse.Namespace) -> dict[str, str]:
    return {"authorization": f"Bearer {args.api_key}"} if args.api_key else {}


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m loadtest.hol_probe", description=__doc__.split("\n")[0])
    p.add_argument("--url", required=True, help="base URL (without /v1)")
    p.add_argument("--model", default="tokengate-sim")
    p.add_argument("--api-key", default=None)
    p.add_argument("--shorts", type=int, default=24)
    p.add_argument("--rate", type=float, default=8.0, help="short requests per second")
    p.add_argument("--short-tokens", type=int, default=200)
    p.add_argument("--short-output", type=int, default=16)
    p.add_argument("--long-tokens", type=int, default=28000)
    p.add_argument("--long-output", type=int, default=8)
    p.add_argument("--long-lead-s", type=float, default=0.05, help="the long prompt goes first by this much")
    p.add_argument("--label", default="")
    p.add_argument("--out", default=None)
    return p.parse_args(argv)


async def amain(args: argparse.Namespace) -> dict[str, object]:
    factory = PromptFactory(seed=3)
    alone = await run_arm(args, factory, with_long=False)
    beside = await run_arm(args, factory, with_long=True)
    ratio = beside.ttft_p99_ms / alone.ttft_p99_ms if alone.ttft_p99_ms else float("nan")
    return {"label": args.label, "alone": asdict(alone), "beside_long": asdict(beside), "p99_ratio": ratio}


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    result = asyncio.run(amain(args))
    a, b = result["alone"], result["beside_long"]
    assert isinstance(a, dict) and isinstance(b, dict)
    print(
        f"{args.label or args.url}: short TTFT p50/p99 alone {a['ttft_p50_ms']:.1f}/{a['ttft_p99_ms']:.1f} ms, "
        f"beside a {args.long_tokens}-token prompt {b['ttft_p50_ms']:.1f}/{b['ttft_p99_ms']:.1f} ms "
        f"(p99 x{result['p99_ratio']:.2f}); long TTFT {b['long_ttft_ms'] or float('nan'):.0f} ms; "
        f"ok {a['ok']}/{a['shorts']} + {b['ok']}/{b['shorts']}"
    )
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=2)
    return 0 if a["ok"] == a["shorts"] and b["ok"] == b["shorts"] else 1


if __name__ == "__main__":
    sys.exit(main())

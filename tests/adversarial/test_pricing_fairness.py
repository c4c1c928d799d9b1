"""A tenant cannot make another tenant's pricing wait behind its own.

A long prompt is tokenized in a small pool of threads before it is priced. With a first-in-first-out
queue, a tenant sending a flood of multi-megabyte prompts — each refused for its length once counted,
so the flood costs it no budget at all — put every other tenant's long prompt behind the whole flood
(2.4 s instead of 10 ms, docs/benchmarks.md). The pool now takes the next job from the tenant it has
served least. Over real sockets: the victim's answer comes back while the flood is still being
counted, and the flood's requests are all refused, none forwarded.
"""

from __future__ import annotations

import asyncio
import random

import httpx
import orjson
import pytest

from tests.adversarial.support import PROSE_WORDS
from tests.conftest import GatewayFactory, StubBackend, eventually, stub_pools

FLOOD = 12


def prompt(seed: int, chars: int) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(PROSE_WORDS) for _ in range(chars // 6))[:chars]


def chat(text: str) -> bytes:
    return orjson.dumps(
        {"model": "stub-model", "max_tokens": 1, "messages": [{"role": "user", "content": text}]}
    )


@pytest.mark.soak
async def test_a_flood_of_huge_prompts_does_not_delay_another_tenants_long_prompt(
    stub_backend: tuple[StubBackend, str], gateway_factory: GatewayFactory
) -> None:
    stub, url = stub_backend
    gw = await gateway_factory(
        {
            "pools": stub_pools(url, capacity=1_000_000),
            "tenants": {"hostile": {"keys": ["kh"]}, "victim": {"keys": ["kv"]}},
            "models": {"stub-model": {"context_length": 32_768}},
        }
    )
    pool = gw.app._proxy.pricer._encoder.executor()
    finished: list[str] = []
    async with httpx.AsyncClient(base_url=gw.url, timeout=60) as c:

        async def send(key: str, raw: bytes, label: str) -> httpx.Response:
            r = await c.post("/v1/chat/completions", content=raw, headers={"authorization": f"Bearer {key}"})
            finished.append(label)
            return r

        flood = [
            asyncio.create_task(send("kh", chat(prompt(i, 3_500_000)), f"flood{i}")) for i in range(FLOOD)
        ]
        # most of the flood waits in the encode pool before the victim comes
        await eventually(
            lambda: sum(pool.backlog().values()) > 20_000_000, timeout_s=30, message="flood not queued"
        )
        # what an operator sees meanwhile: who the tokenizer threads are busy for
        async with httpx.AsyncClient() as ops:
            stats = (await ops.get(gw.ops_url + "/stats")).json()["encode_backlog"]
            metrics = (await ops.get(gw.ops_url + "/metrics")).text
        assert stats["chars"] > 10_000_000 and stats["top_tenants"][0]["tenant"] == "hostile", stats
        [gauge] = [
            line for line in metrics.splitlines() if line.startswith("tokengate_encode_backlog_chars ")
        ]
        assert float(gauge.split()[1]) > 0
        victim = await send("kv", chat(prompt(99, 100_000)), "victim")
        assert victim.status_code == 200, victim.text
        refused = await asyncio.gather(*flood)
    assert finished.index("victim") < FLOOD // 2, finished  # FIFO: after the whole flood
    assert {r.status_code for r in refused} == {400}
    assert {r.json()["error"]["code"] for r in refused} == {"context_length_exceeded"}
    assert len([r for r in stub.requests if r.path == "/v1/chat/completions"]) == 1  # the victim's only
    assert pool.backlog() == {}
    assert await gw.wait_idle() == {name: 0 for name in await gw.in_flight()}

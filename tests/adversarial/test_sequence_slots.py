"""A tenant's many tiny requests cannot fill the engine's sequence slots.

An engine runs at most ``max_num_seqs`` sequences at once (vLLM ``--max-num-seqs``, SGLang
``--max-running-requests``); the rest wait in its own queue, first come first served, where the
gateway's fair queue cannot reach them. Priced in tokens alone, 16-token requests fit a pool by the
thousand: one chatty tenant fills every slot and the others' requests wait inside the engine behind
its backlog. With ``max_num_seqs`` on a pool's backends each sequence holds at least the pool's
tokens per sequence, so the engine's slots fill no further than the gateway's queue lets them.
Counted at the backend, over real sockets."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import pytest

from gateway.config.loader import ConfigError, parse_config
from tests.conftest import GatewayFactory, StubBackend, stub_pools

CAPACITY, SLOTS = 10_000, 4  # 2,500 tokens per sequence


def config(url: str, **backend: Any) -> dict[str, object]:
    return {
        "pools": stub_pools(url, capacity=CAPACITY, **backend),
        "tenants": {"chatty": {"keys": ["kc"]}, "victim": {"keys": ["kv"]}},
    }


def tiny(**extra: Any) -> dict[str, Any]:
    return {"model": "stub-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, **extra}


async def run_burst(gw_url: str, stub: StubBackend) -> tuple[int, int]:
    """12 slow tiny requests from one tenant, then one from another: (most at the backend at once,
    how many of the first tenant's the backend had received before the other's)."""
    slow = {"x-stub-delay": "0.4"}
    async with (
        httpx.AsyncClient(base_url=gw_url, headers={"authorization": "Bearer kc"}, timeout=30) as chatty,
        httpx.AsyncClient(base_url=gw_url, headers={"authorization": "Bearer kv"}, timeout=30) as victim,
    ):
        burst = [
            asyncio.create_task(chatty.post("/v1/chat/completions", json=tiny(), headers=slow))
            for _ in range(12)
        ]
        await asyncio.sleep(0.15)
        mine = asyncio.create_task(
            victim.post(
                "/v1/chat/completions",
                json=tiny(messages=[{"role": "user", "content": "victim"}]),
                headers=slow,
            )
        )
        most = 0
        while not all(t.done() for t in [*burst, mine]):
            most = max(most, sum(1 for r in stub.requests if not r.completed and r.cancelled_at is None))
            await asyncio.sleep(0.01)
        assert all(t.result().status_code == 200 for t in [*burst, mine])
    order = [r.body["messages"][0]["content"] for r in stub.requests]
    return most, order.index("victim")


async def test_each_sequence_holds_its_share_of_the_slots_and_the_queue_stays_fair(
    stub_backend: tuple[StubBackend, str], gateway_factory: GatewayFactory
) -> None:
    stub, url = stub_backend
    gw = await gateway_factory(config(url, max_num_seqs=SLOTS))
    async with httpx.AsyncClient(base_url=gw.url, headers={"authorization": "Bearer kv"}) as c:
        r = await c.post("/v1/chat/completions", json=tiny())
        assert int(r.headers["x-tokengate-cost"]) == CAPACITY // SLOTS  # 2,500, not ~16
        r = await c.post("/v1/chat/completions", json=tiny(n=2))
        assert int(r.headers["x-tokengate-cost"]) == 2 * CAPACITY // SLOTS  # two sequences
        big = await c.post("/v1/chat/completions", json=tiny(max_tokens=3000))
        assert 3000 < int(big.headers["x-tokengate-cost"]) < 3100  # above its share: as priced
    stub.requests.clear()
    most, before_victim = await run_burst(gw.url, stub)
    assert most <= SLOTS
    assert before_victim <= SLOTS + 1  # granted at the next free slot, not after the whole burst
    assert await gw.wait_idle() == {name: 0 for name in await gw.in_flight()}


async def test_without_it_the_burst_fills_the_engine(
    stub_backend: tuple[StubBackend, str], gateway_factory: GatewayFactory
) -> None:
    stub, url = stub_backend
    gw = await gateway_factory(config(url))
    most, before_victim = await run_burst(gw.url, stub)
    assert most >= 12 and before_victim == 12  # every tiny request ran at once, the victim's last
    assert await gw.wait_idle() == {name: 0 for name in await gw.in_flight()}


def test_a_pool_with_a_backend_of_unknown_slots_holds_tokens_only() -> None:
    from gateway.upstream.pools import BackendPool, Router

    cfg = parse_config(
        {
            "pools": {
                "p": {
                    "backends": [
                        {"url": "http://127.0.0.1:1", "capacity_tokens": 1000, "max_num_seqs": 4},
                        {"url": "http://127.0.0.1:2", "capacity_tokens": 1000},
                    ]
                }
            }
        }
    )
    pool: BackendPool = Router(cfg.pools).pools["p"]
    assert pool.sequence_tokens == 0


@pytest.mark.parametrize("value", [0, -1, "many"])
def test_a_bad_max_num_seqs_names_the_field(value: object) -> None:
    with pytest.raises(ConfigError, match=r"pools\.default\.backends\[0\]\.max_num_seqs"):
        parse_config({"pools": stub_pools("http://127.0.0.1:9", max_num_seqs=value)})

"""The sequence-slot floor said plainly: a warning at config load when it makes a tier or a tenant
impossible on a pool, and a 413 that names it (and does not advise a lower max_tokens)."""

from __future__ import annotations

import logging
from typing import Any

import httpx
import orjson
import pytest

from gateway.config.loader import parse_config
from gateway.request.slots import load_warnings, sequence_tokens
from tests.conftest import GatewayFactory, StubBackend, stub_pools
from tests.gateway.gw_support import chat


def one_at_a_time(url: str, capacity: int = 2048) -> dict[str, Any]:
    """A pool of one engine that runs one sequence at a time (llama.cpp's server)."""
    return stub_pools(url, capacity=capacity, max_num_seqs=1)


def test_a_tier_and_a_tenant_the_floor_makes_impossible_are_named_at_load() -> None:
    config = parse_config(
        {
            "pools": one_at_a_time("http://127.0.0.1:9"),
            "tenants": {"acme": {"keys": ["k1"], "budget_tokens": 1000}, "big": {"keys": ["k2"]}},
        }
    )
    assert sequence_tokens(config.pools[0]) == 2048
    warnings = load_warnings(config)
    # standard (0.9 of 2048 = 1843) and batch (0.7: 1433) cannot hold one sequence; critical can.
    assert [w.split(", more than ")[1].split(" ")[:2] for w in warnings] == [
        ["tier", "standard"],
        ["tier", "batch"],
        ["tenant", "acme's"],
    ]
    assert all("max_num_seqs 1" in w and "2048" in w for w in warnings)
    roomy = parse_config({"pools": stub_pools("http://127.0.0.1:9", capacity=2048, max_num_seqs=4)})
    assert load_warnings(roomy) == []
    unknown = parse_config({"pools": stub_pools("http://127.0.0.1:9", capacity=2048)})
    assert sequence_tokens(unknown.pools[0]) == 0 and load_warnings(unknown) == []


async def test_a_request_only_the_floor_makes_too_big_is_refused_naming_the_floor(
    stub_backend: tuple[StubBackend, str], gateway_factory: GatewayFactory, caplog: pytest.LogCaptureFixture
) -> None:
    stub, url = stub_backend
    caplog.set_level(logging.INFO)
    gw = await gateway_factory({"pools": one_at_a_time(url)})
    assert any(
        "tier standard may hold" in r.getMessage() for r in caplog.records if r.levelno == logging.WARNING
    )
    async with httpx.AsyncClient(base_url=gw.url) as c:
        r = await c.post("/v1/chat/completions", json=chat(max_tokens=32))
    assert r.status_code == 413
    message = r.json()["error"]["message"]
    assert "holds at least 2048 tokens (capacity_tokens 2048 / max_num_seqs 1)" in message
    assert "A lower max_tokens does not help" in message and "reserved output 2032" not in message
    assert r.json()["error"]["code"] == "cost_exceeds_capacity"
    [line] = [orjson.loads(m.getMessage()) for m in caplog.records if m.name == "tokengate.access"][-1:]
    assert line["slot_tokens"] == 2048 - line["prefill"] - 32 and line["reason"] == "cost_exceeds_capacity"
    assert stub.requests == []


async def test_a_request_too_big_by_itself_keeps_the_usual_advice(
    stub_backend: tuple[StubBackend, str], gateway_factory: GatewayFactory
) -> None:
    _, url = stub_backend
    gw = await gateway_factory({"pools": one_at_a_time(url)})
    async with httpx.AsyncClient(base_url=gw.url) as c:
        r = await c.post("/v1/chat/completions", json=chat(max_tokens=1900))
    assert r.status_code == 413
    assert "lower max_tokens" in r.json()["error"]["message"]


async def test_each_sequence_is_priced_in_whole_kv_blocks_as_the_engine_holds_it(
    stub_backend: tuple[StubBackend, str], gateway_factory: GatewayFactory, caplog: pytest.LogCaptureFixture
) -> None:
    """vLLM allocates a sequence's KV cache in blocks: a request of 45 tokens holds 64 of a cache of
    32-token blocks. Priced as held, the requests the gateway lets through fit in the whole cache."""
    _, url = stub_backend
    caplog.set_level(logging.INFO, logger="tokengate.access")
    blocks = await gateway_factory({"pools": stub_pools(url, capacity=4096, block_size=32)})
    plain = await gateway_factory({"pools": stub_pools(url, capacity=4096)})
    async with httpx.AsyncClient() as c:
        for gw in (blocks, plain):
            for body in (chat(max_tokens=13), chat(max_tokens=64), chat(max_tokens=13, n=2)):
                r = await c.post(f"{gw.url}/v1/chat/completions", json=body)
                assert r.status_code == 200, r.text
    lines = [orjson.loads(m.getMessage()) for m in caplog.records if m.name == "tokengate.access"]
    held, asked = [line["cost"] for line in lines[:3]], [line["cost"] for line in lines[3:]]
    prompt = lines[3]["prefill"]
    assert asked == [prompt + 13, prompt + 64, prompt + 26]  # block_size 1 (the default): as priced
    # Rounded up to whole blocks per sequence: n=2 holds two sequences' blocks.
    assert held == [-(-a // b) * b for a, b in zip(asked, (32, 32, 64), strict=True)]
    assert all(line["prefill"] == prompt for line in lines)  # the padding is held as output room


def test_block_size_is_validated_naming_the_field() -> None:
    from gateway.config.fields import ConfigError

    with pytest.raises(ConfigError, match=r"pools\.default\.backends\[0\]\.block_size"):
        parse_config({"pools": stub_pools("http://127.0.0.1:9", block_size=0)})

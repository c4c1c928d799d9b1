"""The admin API across replicas on one Redis: a change made on one gateway applies on every other
within a second, and survives restarting all of them."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import httpx

from tests.budgets.redis_fixtures import RedisServer
from tests.conftest import GatewayFactory, RunningGateway, StubBackend, stub_pools
from tests.gateway.gw_support import chat

ADMIN = {"authorization": "Bearer admin-secret"}


def replica_config(url: str, redis: RedisServer, tokens_file: str) -> dict[str, Any]:
    return {
        "store": {"kind": "redis", "url": redis.url, "key_prefix": "admin-e2e", "replicas": 3},
        "pools": stub_pools(url),
        "tenants": {"acme": {"keys": ["sk-acme"], "budget_tokens": 1000}},
        "admin": {"tokens_file": tokens_file},
    }


async def until(predicate: Any, within_s: float) -> float:
    """Seconds until ``predicate()`` (async) holds; fails after ``within_s``."""
    t0 = time.monotonic()
    while not await predicate():
        assert time.monotonic() - t0 < within_s, "not applied in time"
        await asyncio.sleep(0.01)
    return time.monotonic() - t0


async def accepts(gw: RunningGateway, key: str) -> bool:
    async with httpx.AsyncClient(base_url=gw.url) as c:
        r = await c.post(
            "/v1/chat/completions", json=chat(max_tokens=2), headers={"authorization": f"Bearer {key}"}
        )
    return r.status_code == 200


async def test_a_change_on_one_replica_applies_on_every_replica_within_a_second_and_survives_restarts(
    stub_backend: tuple[StubBackend, str],
    gateway_factory: GatewayFactory,
    fresh_redis: RedisServer,
    tmp_path: Path,
) -> None:
    _, url = stub_backend
    tokens = tmp_path / "tokens"
    tokens.write_text("admin admin-secret\n")
    config = replica_config(url, fresh_redis, str(tokens))
    replicas = [await gateway_factory(config) for _ in range(3)]
    a, b, c = replicas
    async with httpx.AsyncClient(base_url=a.ops_url, headers=ADMIN) as admin:
        r = await admin.post("/admin/v1/tenants", json={"name": "newco", "budget_tokens": 7000})
        assert r.status_code == 201
        key = (await admin.post("/admin/v1/tenants/newco/keys", json={})).json()["key"]

    async def everywhere() -> bool:
        return all([await accepts(g, key) for g in (b, c)])

    took = await until(everywhere, within_s=3.0)
    print(f"new tenant + key usable on every other replica after {took * 1000:.0f} ms")
    assert took < 1.0, f"the other replicas applied the change after {took:.2f} s"
    async with httpx.AsyncClient(
        base_url=c.ops_url, headers=ADMIN
    ) as admin:  # any replica can change it back
        await admin.patch("/admin/v1/tenants/acme", json={"budget_tokens": 1500})

    async def budget_seen() -> bool:
        return all(
            any(t.name == "acme" and t.budget_tokens == 1500 for t in g.app.config.tenants) for g in replicas
        )

    assert await until(budget_seen, within_s=3.0) < 1.0

    for g in replicas:
        await g.served.stop()
    restarted = [await gateway_factory(config) for _ in range(2)]
    for g in restarted:
        assert await accepts(g, key)
        assert any(t.name == "acme" and t.budget_tokens == 1500 for t in g.app.config.tenants)


async def test_a_gateway_starts_while_redis_is_down_and_takes_the_shared_state_when_it_answers(
    stub_backend: tuple[StubBackend, str],
    gateway_factory: GatewayFactory,
    fresh_redis: RedisServer,
    tmp_path: Path,
) -> None:
    _, url = stub_backend
    tokens = tmp_path / "tokens"
    tokens.write_text("admin admin-secret\n")
    config = replica_config(url, fresh_redis, str(tokens))
    first = await gateway_factory(config)
    async with httpx.AsyncClient(base_url=first.ops_url, headers=ADMIN) as admin:
        await admin.patch("/admin/v1/tenants/acme", json={"budget_tokens": 4321})
    fresh_redis.kill()
    late = await gateway_factory(config)  # starts on the file's config; no crash
    assert any(t.name == "acme" and t.budget_tokens == 1000 for t in late.app.config.tenants)
    fresh_redis.restart()

    async def caught_up() -> bool:
        return any(t.name == "acme" and t.budget_tokens == 4321 for t in late.app.config.tenants)

    await until(caught_up, within_s=10.0)

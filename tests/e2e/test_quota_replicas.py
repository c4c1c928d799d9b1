"""A daily token quota shared by two gateway replicas on one Redis: 50 concurrent requests spread
over both, and the usage settled in the window never passes the quota; every reservation settles."""

from __future__ import annotations

import asyncio
import time

import httpx

from tests.budgets.redis_fixtures import RedisServer
from tests.conftest import GatewayFactory, RunningGateway, StubBackend, stub_pools
from tests.gateway.gw_support import chat
from tests.support import eventually

KEY = "sk-acme"


async def test_two_replicas_share_one_daily_quota(
    stub_backend: tuple[StubBackend, str], gateway_factory: GatewayFactory, fresh_redis: RedisServer
) -> None:
    _, url = stub_backend
    config = {
        "store": {"kind": "redis", "url": fresh_redis.url, "key_prefix": "quota-e2e", "replicas": 2},
        "pools": stub_pools(url),
        "tenants": {"acme": {"keys": [KEY], "quotas": [{"tokens": 10_000, "window": "day"}]}},
        "drain_timeout_s": 1,
    }
    a, b = await gateway_factory(config), await gateway_factory(config)

    async def one(i: int) -> int:
        gw = (a, b)[i % 2]
        async with httpx.AsyncClient(base_url=gw.url) as c:
            r = await c.post(
                "/v1/chat/completions",
                json=chat(max_tokens=400),  # reserves prompt + 400; the stub uses 11 + 3
                headers={"authorization": f"Bearer {KEY}", "x-stub-delay": "0.5", "x-stub-chunks": "3"},
            )
        assert r.status_code in (200, 429), r.text
        return r.status_code

    statuses = await asyncio.gather(*(one(i) for i in range(50)))
    ok = statuses.count(200)
    # ~24 reservations of ~410 fit in 10,000 at once; the rest arrive while those are held (each
    # takes half a second upstream) and are refused
    assert 0 < ok < 50 and statuses.count(429) == 50 - ok
    quota = a.app.config.tenants[0].quotas[0]
    window = [(quota.key, quota.window.oldest(time.time()))]

    async def all_settled() -> bool:
        return (await a.app.quotas.ledger.usage(window))[0][1] == 0

    await eventually(all_settled)
    used, reserved = (await b.app.quotas.ledger.usage(window))[0]
    assert reserved == 0 and used == ok * 14 <= 10_000
    assert not any((await a.in_flight()).values())


async def test_with_learned_reservations_the_overdraft_stays_within_its_bound(
    stub_backend: tuple[StubBackend, str], gateway_factory: GatewayFactory, fresh_redis: RedisServer
) -> None:
    """Learned reservations reserve what similar requests used, so requests that then use more
    overdraw the window: by at most, per request admitted, its output limit less its reservation
    (docs/quotas.md). Trained on 3-token answers, 50 requests that each produce 200 of their 400."""
    _, url = stub_backend
    config = {
        "store": {"kind": "redis", "url": fresh_redis.url, "key_prefix": "quota-learned", "replicas": 2},
        "pools": stub_pools(url),
        "reservation": {"mode": "learned", "min_samples": 3, "grow": False},
        "tenants": {"acme": {"keys": [KEY], "quotas": [{"tokens": 10_000, "window": "day"}]}},
        "drain_timeout_s": 1,
    }
    a, b = await gateway_factory(config), await gateway_factory(config)
    quota = a.app.config.tenants[0].quotas[0]
    window = [(quota.key, quota.window.oldest(time.time()))]

    async def one(gw: RunningGateway, chunks: int, delay: float = 0.0) -> int:
        async with httpx.AsyncClient(base_url=gw.url, timeout=30) as c:
            r = await c.post(
                "/v1/chat/completions",
                json=chat(max_tokens=400),
                headers={
                    "authorization": f"Bearer {KEY}",
                    "x-stub-chunks": str(chunks),
                    "x-stub-delay": str(delay),
                },
            )
        assert r.status_code in (200, 429), r.text
        return r.status_code

    for gw in (a, b):  # each replica learns on its own
        for _ in range(6):
            assert await one(gw, 3) == 200
    trained = (await a.app.quotas.ledger.usage(window))[0][0]
    assert trained == 12 * 14
    statuses = await asyncio.gather(*(one((a, b)[i % 2], 200, 0.3) for i in range(50)))
    ok = statuses.count(200)

    async def all_settled() -> bool:
        return (await a.app.quotas.ledger.usage(window))[0][1] == 0

    await eventually(all_settled)
    used, _ = (await b.app.quotas.ledger.usage(window))[0]
    assert used == trained + ok * (11 + 200)
    assert used > 10_000  # the learned estimates let the window overdraw ...
    assert used <= 10_000 + ok * 400  # ... by at most each admitted request's limit less its reservation
    assert not any((await a.in_flight()).values())

"""One gateway serving two budget domains on a real three-primary Redis Cluster (``store.domains``):
each pool's requests are granted in its own domain, on its own shard; a tenant's budget holds per
domain; ``/stats`` and the admin API show each domain; every pool of every domain is back at zero
afterwards; an admin change, saved on the Cluster, reaches every domain."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.budgets.redis_fixtures import prefixes_on_distinct_shards, session_cluster
from tests.conftest import GatewayFactory, RunningGateway, StubBackend, serve_asgi
from tests.support import eventually

ADMIN = {"authorization": "Bearer admin-secret"}
ACME = {"authorization": "Bearer sk-acme"}


@pytest.fixture
async def two_backends() -> AsyncIterator[tuple[str, str]]:
    """A chat backend and an eu backend, each streaming 20 chunks 50 ms apart (a second in flight)."""
    chat = await serve_asgi(StubBackend(models=("chat-model",), default_chunks=20, default_interval=0.05))
    eu = await serve_asgi(StubBackend(models=("eu-model",), default_chunks=20, default_interval=0.05))
    try:
        yield chat.url, eu.url
    finally:
        await chat.stop()
        await eu.stop()


def config(chat_url: str, eu_url: str, tokens_file: str) -> dict[str, Any]:
    home, eu = prefixes_on_distinct_shards(session_cluster(), 2)
    return {
        "store": {
            "kind": "redis",
            "url": session_cluster().url,
            "key_prefix": home,
            "domains": {"eu": {"pools": ["eu"], "key_prefix": eu}},
        },
        "pools": {
            "chat": {"backends": [{"url": chat_url, "capacity_tokens": 10_000, "models": ["chat-model"]}]},
            "eu": {"backends": [{"url": eu_url, "capacity_tokens": 10_000, "models": ["eu-model"]}]},
        },
        "tenants": {"acme": {"keys": ["sk-acme"], "budget_tokens": 1000}},
        "tiers": {"standard": {"rank": 0, "max_queue_wait_s": 0.3}},
        "admin": {"tokens_file": tokens_file},
    }


async def stream(gw: RunningGateway, model: str, max_tokens: int) -> int:
    body = {
        "model": model,
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": max_tokens,
        "stream": True,
    }
    async with httpx.AsyncClient(base_url=gw.url, timeout=10) as c:
        async with c.stream("POST", "/v1/chat/completions", json=body, headers=ACME) as r:
            await r.aread()
            return r.status_code


async def test_one_gateway_two_domains_on_two_shards_budgets_per_domain_and_views_per_domain(
    two_backends: tuple[str, str], gateway_factory: GatewayFactory, tmp_path: Path
) -> None:
    tokens = tmp_path / "tokens"
    tokens.write_text("admin admin-secret\n")
    cfg = config(*two_backends, str(tokens))
    gw = await gateway_factory(cfg)
    ops = httpx.AsyncClient(base_url=gw.ops_url, headers=ADMIN)
    try:
        # ~800 of acme's 1000 in each domain at once: the budget holds per domain.
        first = [asyncio.ensure_future(stream(gw, m, 790)) for m in ("chat-model", "eu-model")]

        async def both_in_flight() -> bool:
            r = await ops.get("/admin/v1/state")
            return r.json()["tenants"]["acme"]["in_flight"] >= 2 * 790

        await eventually(both_in_flight, timeout_s=5)
        # A third to chat finds acme's default-domain budget full and times out in the queue.
        assert await stream(gw, "chat-model", 790) == 429

        stats = (await ops.get("/stats")).json()
        assert stats["store"]["kind"] == "domains"
        assert [d["name"] for d in stats["domains"]] == ["default", "eu"]
        eu_stats = (await ops.get("/stats", params={"domain": "eu"})).json()
        assert eu_stats["store"]["domain"] == cfg["store"]["domains"]["eu"]["key_prefix"]
        pools = {p["name"]: p["in_flight"] for p in eu_stats["pools"]}
        assert pools["eu"] >= 790 and "chat" not in pools
        assert {t["name"]: t["capacity"] for t in eu_stats["tenants"]}["acme"] == 1000
        home = (await ops.get("/stats", params={"domain": "default"})).json()
        assert {p["name"] for p in home["pools"]} == {"chat"}
        state = (await ops.get("/admin/v1/state", params={"domain": "eu"})).json()
        assert (state["domain"], state["domains"]) == ("eu", ["default", "eu"])
        assert "backend:eu" in state["pools"] and "backend:chat" not in state["pools"]
        merged = (await ops.get("/admin/v1/state")).json()
        assert merged["domain"] is None and merged["pools"]["tenant:acme"]["capacity"] == 2000

        missing = await ops.get("/stats", params={"domain": "us"})
        assert missing.status_code == 404
        assert missing.json()["error"]["code"] == "domain_not_found"
        assert "default, eu" in missing.json()["error"]["message"]
        missing = await ops.get("/admin/v1/state", params={"domain": "us"})
        assert missing.status_code == 404 and missing.json()["error"]["param"] == "domain"

        assert await asyncio.gather(*first) == [200, 200]

        async def idle() -> bool:
            snap = await gw.app.store.snapshot()
            return snap.leases == 0 and all(
                p.in_flight == 0 for part in snap.domains.values() for p in part.pools.values()
            )

        await eventually(idle, timeout_s=5)

        # A budget changed through the admin API (its state saved on the Cluster, in the default
        # domain's slot) reaches every domain.
        r = await ops.patch("/admin/v1/tenants/acme", json={"budget_tokens": 3000})
        assert r.status_code == 200, r.text
        for domain in ("default", "eu"):
            state = (await ops.get("/admin/v1/state", params={"domain": domain})).json()
            assert state["pools"]["tenant:acme"]["capacity"] == 3000
        assert await stream(gw, "chat-model", 2500) == 200
        replica = await gateway_factory(cfg)  # a second replica starts on the saved state

        async def saved() -> bool:
            return any(t.name == "acme" and t.budget_tokens == 3000 for t in replica.app.config.tenants)

        await eventually(saved, timeout_s=5)
    finally:
        await ops.aclose()

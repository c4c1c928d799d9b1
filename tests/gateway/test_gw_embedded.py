"""`tokengate serve` with no pools: two simulated backends as pools short and long with a class rule
between them, one open tenant, and start-up lines that say where to try it."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import httpx
import orjson
import pytest

from gateway.app import build_app
from gateway.config.loader import parse_config
from gateway.process.embedded import Embedded, start_embedded, with_embedded_pool
from gateway.process.serve import startup_info
from tests.conftest import Served, serve_asgi

Start = Callable[[dict[str, Any]], Awaitable[tuple[Any, Served, Embedded]]]


@pytest.fixture
async def embedded_gateway() -> AsyncIterator[Start]:
    """The gateway as `tokengate serve` builds it without pools (embedded backends on free ports)."""
    running: list[tuple[Served, Embedded]] = []

    async def start(raw: dict[str, Any]) -> tuple[Any, Served, Embedded]:
        raw = {"embedded_backend": {"port": 0, "time_scale": 0.0}, **raw}
        config = parse_config(raw)
        embedded = await start_embedded(config)
        app = build_app(with_embedded_pool(config, embedded), raw=raw)
        served = await serve_asgi(app)
        running.append((served, embedded))
        return app, served, embedded

    yield start
    for served, embedded in reversed(running):
        await served.stop()
        await embedded.stop()


def _chat(content: str, **extra: Any) -> dict[str, Any]:
    return {"model": "tokengate-sim", "messages": [{"role": "user", "content": content}], **extra}


async def test_no_pools_means_a_short_and_a_long_pool_with_a_class_rule_between_them(
    embedded_gateway: Start, caplog: pytest.LogCaptureFixture
) -> None:
    app, served, embedded = await embedded_gateway({})
    assert [b.pool for b in embedded.backends] == ["short", "long"]
    assert [(c.name, c.pool, c.min_prompt_tokens) for c in app.config.classes] == [
        ("long", "long", 8000),
        ("short", "short", None),
    ]
    caplog.set_level(logging.INFO, logger="tokengate.access")
    async with httpx.AsyncClient(base_url=served.url, timeout=30) as c:
        short = await c.post("/v1/chat/completions", json=_chat("hello", max_tokens=4))
        long = await c.post("/v1/chat/completions", json=_chat("word " * 9000, max_tokens=4))
        keyed = await c.post(
            "/v1/chat/completions",
            json=_chat("hi", max_tokens=1),
            headers={"authorization": "Bearer anything"},
        )
        emb = await c.post("/v1/embeddings", json={"model": "tokengate-sim", "input": "hello"})
    assert [r.status_code for r in (short, long, keyed, emb)] == [200, 200, 200, 200]  # any key or none
    assert (short.headers["x-tokengate-class"], long.headers["x-tokengate-class"]) == ("short", "long")
    lines = [orjson.loads(r.getMessage()) for r in caplog.records if r.name == "tokengate.access"]
    assert [(x["class"], x["pool"], x["backend"]) for x in lines[:2]] == [
        ("short", "short", "embedded-short"),
        ("long", "long", "embedded-long"),
    ]
    assert emb.json()["data"][0]["object"] == "embedding"  # the embedded backend answers embeddings


async def test_the_config_may_keep_its_own_classes_or_one_embedded_pool(embedded_gateway: Start) -> None:
    own, _, _ = await embedded_gateway({"classes": [{"name": "all", "pool": "long"}]})
    assert [c.name for c in own.config.classes] == ["all"]
    single, _, embedded = await embedded_gateway({"embedded_backend": {"port": 0, "split": False}})
    assert [p.name for p in single.config.pools] == ["default"] and single.config.classes == ()
    assert len(embedded.backends) == 1


async def test_the_start_up_lines_say_where_to_try_it(embedded_gateway: Start) -> None:
    app, _, embedded = await embedded_gateway({})
    info = startup_info(app, ("127.0.0.1", 8080), ("127.0.0.1", 9091), embedded)
    text = "\n".join(info.lines)
    assert info.api == "http://127.0.0.1:8080/v1" and info.open_tenant
    assert "one open tenant takes any API key or none" in text
    assert (
        "curl -si http://127.0.0.1:8080/v1/chat/completions" in info.curl and '"tokengate-sim"' in info.curl
    )
    assert "http://127.0.0.1:9091/dashboard" in text and "tokengate doctor http://127.0.0.1:9091" in text
    assert "pool short on http://127.0.0.1:" in text and "long (min_prompt_tokens 8000) -> pool long" in text


def test_with_tenants_and_pools_the_start_up_lines_ask_for_a_key() -> None:
    config = parse_config(
        {
            "pools": {
                "p": {"backends": [{"url": "http://127.0.0.1:1", "capacity_tokens": 1000, "models": ["m"]}]}
            },
            "tenants": {"acme": {"keys": ["k"]}},
        }
    )
    info = startup_info(build_app(config), ("0.0.0.0", 8080), None, None)
    text = "\n".join(info.lines)
    assert "YOUR-KEY" in info.curl and '"m"' in info.curl and not info.open_tenant
    assert "embedded" not in text and "http://127.0.0.1:8080/dashboard" in text

"""A tenant cannot make the engine fetch from inside the serving network.

Engines fetch a media part's URL themselves (vLLM's media connector: any http(s) host, loopback and
link-local included, redirects followed; CVE-2025-6242, vLLM #57157), from beside Redis, the ops
listener and the cloud's metadata service. Over real sockets: a backend that fetches every media URL
it is sent, as such an engine does, and an "internal service" on loopback that counts who reaches it.
Sent straight to the backend, the spellings below reach the internal service; through the gateway
each is a 400 before anything is held or forwarded, on every part and route that carries a URL."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from gateway.config.loader import parse_config
from tests.adversarial.backends import MediaFetching, lifespan
from tests.adversarial.support import AUTH
from tests.conftest import GatewayFactory, Receive, Scope, Send, Served, serve_asgi, stub_pools

PNG = "data:image/png;base64,iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNk+M9QDwADhgGAWjR9awAAAABJRU5ErkJggg=="


class InternalService:
    """Stands for what trusts the serving network (metadata service, Redis, the ops listener)."""

    def __init__(self) -> None:
        self.hits: list[str] = []

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await lifespan(receive, send)
            return
        self.hits.append(scope["path"])
        await send(
            {"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"image/png")]}
        )
        await send({"type": "http.response.body", "body": b"secret"})


def spellings(port: int) -> list[str]:
    """Ways to name the internal service (127.0.0.1:port) that some URL parser or resolver accepts."""
    return [
        f"http://127.0.0.1:{port}/latest/meta-data",
        f"HTTP://127.0.0.1:{port}/upper-case-scheme",
        f"http://localhost:{port}/localhost",
        f"http://LOCALHOST.:{port}/trailing-dot",
        f"http://0x7f000001:{port}/hex",
        f"http://0x7f.0.0.1:{port}/hex-part",
        f"http://127.1:{port}/short",
        f"http://2130706433:{port}/decimal",
        f"http://0177.0.0.1:{port}/octal",
        f"http://0.0.0.0:{port}/unspecified",
        f"http://0:{port}/zero",
        f"http://[::ffff:127.0.0.1]:{port}/v4-mapped",
        f"http://[::1]:{port}/v6-loopback",
        f"http://img.example.com@127.0.0.1:{port}/user-info",
        f"http://127。0。0。1:{port}/full-width-dots",
        f"http://127.0.0.1:{port}/trailing-tab\t",
        f" http://127.0.0.1:{port}/leading-space",
        f"http:/127.0.0.1:{port}/one-slash",
        f"http://127.0.0.1:{port}\\@img.example.com/backslash",
        f"http://%31%32%37.0.0.1:{port}/escaped",
        "http://169.254.169.254/latest/meta-data/iam/",
        "http://metadata.google.internal/computeMetadata/v1/",
        "http://redis:6379/",
        "http://10.0.0.7/",
        "file:///etc/passwd",
        "/var/lib/engine/cat.png",
        "gopher://127.0.0.1:6379/_INFO",
    ]


@pytest.fixture
async def internal() -> AsyncIterator[tuple[InternalService, int]]:
    service = InternalService()
    served: Served = await serve_asgi(service)
    try:
        yield service, int(served.url.rsplit(":", 1)[1])
    finally:
        await served.stop()


@pytest.fixture
async def fetching() -> AsyncIterator[tuple[MediaFetching, str]]:
    backend = MediaFetching()
    served = await serve_asgi(backend)
    try:
        yield backend, served.url
    finally:
        await served.stop()


def config(url: str, **media_urls: Any) -> dict[str, Any]:
    return {
        "pools": stub_pools(url, capacity=200_000),
        "tenants": {"t": {"keys": ["k"], "budget_tokens": 50_000}},
        "passthrough": {"routes": [{"method": "POST", "path": "/v1/rerank", "generates": False}]},
        **({"pricing": {"media_urls": media_urls}} if media_urls else {}),
    }


def chat(part: dict[str, Any]) -> dict[str, Any]:
    content = [{"type": "text", "text": "what is this?"}, part]
    return {"model": "stub-model", "max_tokens": 5, "messages": [{"role": "user", "content": content}]}


def embed(part: dict[str, Any]) -> dict[str, Any]:
    """vLLM's chat-style embeddings request (multimodal embedding models)."""
    return {"messages": chat(part)["messages"]}


def responses(part: dict[str, Any]) -> dict[str, Any]:
    content = [{"type": "input_text", "text": "what is this?"}, part]
    return {"model": "stub-model", "max_output_tokens": 5, "input": [{"role": "user", "content": content}]}


# Every place a request carries a URL the engine fetches: (route, body, the error's param).
def carriers(url: str) -> list[tuple[str, dict[str, Any], str]]:
    return [
        ("/v1/chat/completions", chat({"type": "image_url", "image_url": {"url": url}}), "messages[0].content[1].image_url.url"),
        ("/v1/chat/completions", chat({"type": "image_url", "image_url": url}), "messages[0].content[1].image_url"),
        ("/v1/chat/completions", chat({"type": "audio_url", "audio_url": {"url": url}}), "messages[0].content[1].audio_url.url"),
        ("/v1/chat/completions", chat({"type": "video_url", "video_url": {"url": url}}), "messages[0].content[1].video_url.url"),
        ("/v1/responses", responses({"type": "input_image", "image_url": url}), "input[0].content[1].image_url"),
        ("/v1/responses", responses({"type": "input_file", "file_url": url}), "input[0].content[1].file_url"),
        ("/v1/embeddings", {"model": "stub-model", **embed({"type": "image_url", "image_url": {"url": url}})}, "messages[0].content[1].image_url.url"),
        # A pass-through route's JSON: a multimodal rerank's documents, SGLang's native image_data.
        ("/v1/rerank", {"model": "stub-model", "query": "cat?", "documents": {"content": [{"type": "image_url", "image_url": {"url": url}}]}}, "documents.content[0].image_url.url"),
        ("/v1/rerank", {"model": "stub-model", "query": "cat?", "image_data": ["data:,x", url]}, "image_data[1]"),
    ]  # fmt: skip


async def test_the_attacks_are_real_the_fetching_backend_reaches_the_internal_service_directly(
    internal: tuple[InternalService, int], fetching: tuple[MediaFetching, str]
) -> None:
    service, port = internal
    _, url = fetching
    async with httpx.AsyncClient(timeout=30) as c:
        for spelling in spellings(port):
            r = await c.post(
                url + "/v1/chat/completions", json=chat({"type": "image_url", "image_url": {"url": spelling}})
            )
            assert r.status_code == 200
    # Ten of these spellings reach it through aiohttp alone (full-width dots, a trailing tab, user
    # info, hex, 0.0.0.0 and the v4-mapped address among them); other clients take others.
    assert len(service.hits) >= 10, sorted(service.hits)


async def test_no_spelling_of_an_internal_address_reaches_the_engine_on_any_part_or_route(
    internal: tuple[InternalService, int],
    fetching: tuple[MediaFetching, str],
    gateway_factory: GatewayFactory,
) -> None:
    service, port = internal
    backend, url = fetching
    gw = await gateway_factory(config(url))
    async with httpx.AsyncClient(base_url=gw.url, headers=AUTH, timeout=30) as c:
        for spelling in spellings(port):
            for route, body, param in carriers(spelling):
                r = await c.post(route, json=body)
                assert r.status_code == 400, (spelling, route, r.text)
                error = r.json()["error"]
                assert error["code"] == "media_url_not_allowed" and error["param"] == param, error
                assert "data: URL" in error["message"], error
        # A public host and an inline image still go through.
        for spelling in ("https://img.example.com/cat.png", PNG):
            for route, body, _ in carriers(spelling):
                assert (await c.post(route, json=body)).status_code == 200, (spelling, route)
    assert service.hits == []
    assert all("127.0.0.1" not in fetched for fetched, _ in backend.fetched), backend.fetched
    assert len(backend.bodies) == 18
    assert await gw.wait_idle() == {name: 0 for name in await gw.in_flight()}


async def test_a_pass_through_body_that_names_media_is_walked_within_max_items(
    fetching: tuple[MediaFetching, str], gateway_factory: GatewayFactory
) -> None:
    backend, url = fetching
    gw = await gateway_factory(config(url))
    many = [1] * 20_000  # (the default pricing.max_items is 10,000)
    async with httpx.AsyncClient(base_url=gw.url, headers=AUTH, timeout=30) as c:
        r = await c.post("/v1/rerank", json={"model": "stub-model", "query": "q", "documents": many})
        assert r.status_code == 200  # names no media: not walked, as before
        named = {
            "model": "stub-model",
            "query": "q",
            "documents": many,
            "image_url": "https://img.example.com/a.png",
        }
        r = await c.post("/v1/rerank", json=named)
        assert r.status_code == 400 and "pricing.max_items" in r.json()["error"]["message"], r.text
    assert len(backend.bodies) == 1


async def test_a_media_key_spelled_with_json_escapes_is_still_found(
    internal: tuple[InternalService, int],
    fetching: tuple[MediaFetching, str],
    gateway_factory: GatewayFactory,
) -> None:
    service, port = internal
    backend, url = fetching
    gw = await gateway_factory(config(url))
    raw = (
        '{"model": "stub-model", "query": "q", "documents": [{"content": [{"type": "image\\u005furl", '
        f'"image\\u005furl": {{"url": "http://127.0.0.1:{port}/escaped-key"}}}}]}}]}}'
    )
    assert "image_url" not in raw
    async with httpx.AsyncClient(base_url=gw.url, headers={**AUTH, "content-type": "application/json"}) as c:
        r = await c.post("/v1/rerank", content=raw.encode())
        assert r.status_code == 400 and r.json()["error"]["code"] == "media_url_not_allowed", r.text
    assert service.hits == [] and backend.bodies == []


async def test_a_listed_host_is_fetched_and_nothing_else(
    internal: tuple[InternalService, int],
    fetching: tuple[MediaFetching, str],
    gateway_factory: GatewayFactory,
) -> None:
    service, port = internal
    backend, url = fetching
    gw = await gateway_factory(config(url, hosts=["127.0.0.1", "*.img.example.com"]))
    async with httpx.AsyncClient(base_url=gw.url, headers=AUTH, timeout=30) as c:

        async def image(u: str) -> int:
            return (
                await c.post("/v1/chat/completions", json=chat({"type": "image_url", "image_url": u}))
            ).status_code

        assert await image(f"http://127.0.0.1:{port}/images/cat.png") == 200
        assert service.hits == ["/images/cat.png"]
        assert await image("https://eu.img.example.com/cat.png") == 200
        assert await image(PNG) == 200  # data: URLs fetch nothing
        for other in (
            f"http://localhost:{port}/",
            f"http://127.1:{port}/",
            "https://img.example.com/",
            "https://example.com/",
        ):
            assert await image(other) == 400, other
    assert service.hits == ["/images/cat.png"]
    assert len(backend.bodies) == 3


async def test_data_only_makes_the_engine_fetch_nothing_and_a_reload_applies_it(
    fetching: tuple[MediaFetching, str], gateway_factory: GatewayFactory
) -> None:
    backend, url = fetching
    gw = await gateway_factory(config(url))
    public = chat({"type": "image_url", "image_url": {"url": "https://img.example.com/cat.png"}})
    async with httpx.AsyncClient(base_url=gw.url, headers=AUTH, timeout=30) as c:
        assert (await c.post("/v1/chat/completions", json=public)).status_code == 200
        await gw.app.apply(parse_config(config(url, schemes=["data"])))
        r = await c.post("/v1/chat/completions", json=public)
        assert r.status_code == 400 and "scheme https:" in r.json()["error"]["message"], r.text
        assert (
            await c.post("/v1/chat/completions", json=chat({"type": "image_url", "image_url": PNG}))
        ).status_code == 200
    assert len(backend.bodies) == 2


async def test_private_hosts_can_be_allowed_for_a_trusted_deployment(
    internal: tuple[InternalService, int],
    fetching: tuple[MediaFetching, str],
    gateway_factory: GatewayFactory,
) -> None:
    service, port = internal
    _, url = fetching
    gw = await gateway_factory(config(url, private_hosts=True))
    async with httpx.AsyncClient(base_url=gw.url, headers=AUTH, timeout=30) as c:
        ok = chat({"type": "image_url", "image_url": f"http://localhost:{port}/cat.png"})
        assert (await c.post("/v1/chat/completions", json=ok)).status_code == 200
        # The plain-writing rules and schemes still hold: they are what keeps parsers agreeing.
        for bad in (f"http://x@localhost:{port}/", "file:///etc/passwd", f"http:/localhost:{port}/"):
            r = await c.post("/v1/chat/completions", json=chat({"type": "image_url", "image_url": bad}))
            assert r.status_code == 400, bad
    assert service.hits == ["/cat.png"]

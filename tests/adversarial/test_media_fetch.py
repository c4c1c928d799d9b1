"""With ``pricing.media_urls.fetch`` the gateway fetches media itself and the engine fetches nothing.

What a URL check cannot see — where a name resolves, where a URL redirects — is checked where the
gateway connects: its resolver refuses private addresses and the connection goes to the address it
checked; every redirect is checked as a URL. Over real sockets: an image server and an "internal
service" on loopback; the backend receives data: URLs only; an image is priced by its real size."""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import io
import socket
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from aiohttp.abc import AbstractResolver, ResolveResult
from PIL import Image

from classifiers.media_urls import MediaUrls
from gateway.request.errors import ApiError
from gateway.request.media_fetch import CheckedResolver, MediaFetcher, PrivateAddress
from tests.adversarial.backends import lifespan
from tests.adversarial.support import image_chat as chat
from tests.conftest import (
    GatewayFactory,
    Receive,
    Scope,
    Send,
    StubBackend,
    eventually,
    serve_asgi,
    stub_pools,
)


def png(side: int) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (side, side)).save(out, format="PNG")
    return out.getvalue()


class Images:
    """/cat.png (64 x 64), /big (too large), /slow, /to-internal (a redirect), /secret (internal)."""

    def __init__(self) -> None:
        self.hits: list[str] = []
        self.done: list[str] = []  # paths whose answer was sent, in order
        self.port = 0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await lifespan(receive, send)
            return
        path = scope["path"]
        self.hits.append(path)
        status, headers, data = 200, [(b"content-type", b"image/png")], png(64)
        if path == "/big":
            data = b"\x89PNG" + b"\x00" * 60_000
        elif path == "/slow":
            await asyncio.sleep(3)
        elif path == "/to-internal":
            status, headers, data = 302, [(b"location", f"http://localhost:{self.port}/secret".encode())], b""
        elif path == "/missing":
            status, data = 404, b"no"
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": data})
        self.done.append(path)


@pytest.fixture
async def images() -> AsyncIterator[Images]:
    app = Images()
    served = await serve_asgi(app)
    app.port = int(served.url.rsplit(":", 1)[1])
    try:
        yield app
    finally:
        await served.stop()


def config(url: str, **media: Any) -> dict[str, Any]:
    policy = {"fetch": True, "hosts": ["127.0.0.1"], "fetch_max_bytes": 50_000, "fetch_timeout_s": 1, **media}
    return {
        "pools": stub_pools(url, capacity=200_000),
        "tenants": {"t": {"keys": ["k"], "budget_tokens": 100_000}},
        "models": {"stub-model": {"images": {"patch_pixels": 28, "max_pixels": 12_845_056}}},
        "pricing": {"media_urls": policy},
    }


async def test_the_engine_gets_the_bytes_and_the_image_is_priced_by_its_real_size(
    stub_backend: tuple[StubBackend, str], gateway_factory: GatewayFactory, images: Images
) -> None:
    stub, url = stub_backend
    gw = await gateway_factory(config(url))
    remote = f"http://127.0.0.1:{images.port}/cat.png"
    async with httpx.AsyncClient(base_url=gw.url, headers={"authorization": "Bearer k"}, timeout=30) as c:
        r = await c.post("/v1/chat/completions", json=chat(remote))
        assert r.status_code == 200, r.text
        assert int(r.headers["x-tokengate-cost"]) < 100  # a 64 x 64 image; a URL cost the most (16,386)
        responses = {
            "model": "stub-model",
            "max_output_tokens": 5,
            "input": [{"role": "user", "content": [{"type": "input_image", "image_url": remote}]}],
        }
        assert (await c.post("/v1/responses", json=responses)).status_code == 200
    sent = [
        stub.requests[0].body["messages"][0]["content"][1]["image_url"]["url"],
        stub.requests[1].body["input"][0]["content"][0]["image_url"],
    ]
    for data_url in sent:
        assert data_url.startswith("data:image/png;base64,")
        assert base64.b64decode(data_url.split(",", 1)[1]) == png(64)
    assert images.hits == ["/cat.png", "/cat.png"]
    assert await gw.wait_idle() == {name: 0 for name in await gw.in_flight()}


@pytest.mark.parametrize(
    ("path", "why"),
    [
        ("/to-internal", "redirects to a URL that names the host localhost"),
        ("/missing", "answered HTTP 404"),
        ("/big", "larger than 50,000 bytes"),
        ("/slow", "did not arrive within 1 s"),
    ],
)
async def test_a_fetch_that_fails_is_a_400_naming_why_and_nothing_is_forwarded(
    stub_backend: tuple[StubBackend, str],
    gateway_factory: GatewayFactory,
    images: Images,
    path: str,
    why: str,
) -> None:
    stub, url = stub_backend
    gw = await gateway_factory(config(url))
    async with httpx.AsyncClient(base_url=gw.url, headers={"authorization": "Bearer k"}, timeout=30) as c:
        r = await c.post("/v1/chat/completions", json=chat(f"http://127.0.0.1:{images.port}{path}"))
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["code"] == "media_fetch_failed" and why in error["message"], error
    assert error["param"] == "messages[0].content[1].image_url.url"
    assert "/secret" not in images.hits and stub.requests == []
    assert gw.app._proxy.held.total == 0


async def test_an_unreachable_host_is_a_400_without_the_exception_text(
    stub_backend: tuple[StubBackend, str], gateway_factory: GatewayFactory
) -> None:
    _, url = stub_backend
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        free = s.getsockname()[1]
    gw = await gateway_factory(config(url))
    async with httpx.AsyncClient(base_url=gw.url, headers={"authorization": "Bearer k"}, timeout=30) as c:
        r = await c.post("/v1/chat/completions", json=chat(f"http://127.0.0.1:{free}/cat.png"))
    assert r.status_code == 400 and "could not be reached" in r.json()["error"]["message"]
    assert "Errno" not in r.text and "Connect call failed" not in r.text


class FakeDNS(AbstractResolver):
    """A name's records, which a test cannot create in real DNS."""

    def __init__(self, records: dict[str, str]) -> None:
        self.records = records

    async def resolve(
        self, host: str, port: int = 0, family: socket.AddressFamily = socket.AF_INET
    ) -> list[ResolveResult]:
        ip = self.records[host]
        return [{"hostname": host, "host": ip, "port": port, "family": family, "proto": 0, "flags": 0}]

    async def close(self) -> None:
        pass


async def test_a_public_name_that_resolves_inside_is_refused_where_the_gateway_connects(
    images: Images,
) -> None:
    dns = FakeDNS({"cdn.example.com": "127.0.0.1"})
    url = f"http://cdn.example.com:{images.port}/cat.png"
    body = chat(url)
    fetcher = MediaFetcher(lambda: MediaUrls(fetch=True), dns)
    try:
        with pytest.raises(ApiError) as err:
            await fetcher.inline(body, 1000)
        assert err.value.code == "media_fetch_failed" and "resolves to a private address" in err.value.message
        assert images.hits == []
        # Listed, the same name is fetched: from the address the resolver gave, nothing else.
        listed = MediaFetcher(lambda: MediaUrls(fetch=True, hosts=("cdn.example.com",)), dns)
        try:
            assert await listed.inline(body, 1000) > 0
        finally:
            await listed.close()
        assert body["messages"][0]["content"][1]["image_url"]["url"].startswith("data:image/png;base64,")
        assert images.hits == ["/cat.png"]
    finally:
        await fetcher.close()


async def test_the_checked_resolver_refuses_any_private_answer_unless_allowed() -> None:
    dns = FakeDNS(
        {
            "a.example.com": "93.184.215.14",
            "b.example.com": "::ffff:192.168.0.1",
            "c.example.com": "fd00::1",
            "d.example.com": "64:ff9b::a9fe:a9fe",
        }
    )
    checked = CheckedResolver(lambda: MediaUrls(), dns)
    assert (await checked.resolve("a.example.com", 80))[0]["host"] == "93.184.215.14"
    for name in ("b.example.com", "c.example.com", "d.example.com"):
        with pytest.raises(PrivateAddress):
            await checked.resolve(name, 80)
    allowed = CheckedResolver(lambda: MediaUrls(private_hosts=True), dns)
    assert (await allowed.resolve("b.example.com", 80))[0]["host"] == "::ffff:192.168.0.1"


async def test_what_fetches_may_bring_is_held_before_they_start(
    stub_backend: tuple[StubBackend, str], gateway_factory: GatewayFactory, images: Images
) -> None:
    stub, url = stub_backend
    cfg = config(url)
    cfg["limits"] = {"max_held_body_bytes_per_tenant": 60_000}  # below one fetch's 50,000 as base64
    gw = await gateway_factory(cfg)
    async with httpx.AsyncClient(base_url=gw.url, headers={"authorization": "Bearer k"}, timeout=30) as c:
        r = await c.post("/v1/chat/completions", json=chat(f"http://127.0.0.1:{images.port}/cat.png"))
    assert r.status_code == 429 and r.json()["error"]["code"] == "too_many_body_bytes", r.text
    assert images.hits == [] and stub.requests == []
    assert gw.app._proxy.held.total == 0


async def test_a_tenant_whose_media_server_is_a_tar_pit_holds_only_its_own_share_of_fetches(
    stub_backend: tuple[StubBackend, str], gateway_factory: GatewayFactory, images: Images
) -> None:
    # The fetcher's connection pool is shared and first come, first served: one request with
    # hundreds of URLs on a slow server filled it, and another tenant's image then waited until
    # those were answered or timed out. Now a tenant runs at most fetch_per_tenant fetches.
    stub, url = stub_backend
    cfg = config(url, fetch_timeout_s=5, fetch_per_tenant=4)
    cfg["tenants"] = {"hostile": {"keys": ["kh"]}, "victim": {"keys": ["kv"]}}
    gw = await gateway_factory(cfg)
    slow = f"http://127.0.0.1:{images.port}/slow"
    pit = {
        "model": "stub-model",
        "max_tokens": 5,
        "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": slow}}] * 300}],
    }
    async with httpx.AsyncClient(base_url=gw.url, timeout=30) as c:
        hostile = asyncio.create_task(
            c.post("/v1/chat/completions", json=pit, headers={"authorization": "Bearer kh"})
        )
        await eventually(lambda: images.hits.count("/slow") >= 4, timeout_s=10, message="no tar-pit fetch")
        victim = await c.post(
            "/v1/chat/completions",
            json=chat(f"http://127.0.0.1:{images.port}/cat.png"),
            headers={"authorization": "Bearer kv"},
        )
        assert victim.status_code == 200, victim.text
        # fetched while the tar pit's first fetches were still waiting for their answers
        assert images.done[0] == "/cat.png", images.done
        assert images.hits.count("/slow") == 4
        refused = await hostile
    assert refused.status_code == 400 and refused.json()["error"]["code"] == "media_fetch_failed"
    # two waves of four within its 5 s (a fetch or so more as the timeouts race the slots), never 300
    assert images.hits.count("/slow") < 20
    assert [r.body["model"] for r in stub.requests] == ["stub-model"]  # the victim's only
    assert gw.app._proxy.held.total == 0 and gw.app._proxy.media._slots == {}


async def test_a_fetch_waiting_for_its_tenants_share_says_so_when_it_times_out(images: Images) -> None:
    # The policy is read per request: the tar-pit fetch runs under 5 s (its answer takes 3), the
    # one behind it under 1 s, so that one times out while waiting for the tenant's only slot.
    policy = [MediaUrls(fetch=True, hosts=("127.0.0.1",), fetch_timeout_s=5, fetch_per_tenant=1)]
    fetcher = MediaFetcher(lambda: policy[0])
    slow, cat = (f"http://127.0.0.1:{images.port}{p}" for p in ("/slow", "/cat.png"))
    try:
        holding = asyncio.create_task(fetcher.inline(chat(slow), 1000, tenant="t"))
        await eventually(lambda: "/slow" in images.hits, timeout_s=10, message="no fetch")
        policy[0] = dataclasses.replace(policy[0], fetch_timeout_s=1)
        assert await fetcher.inline(chat(cat), 1000, tenant="u") > 0  # another tenant: at once
        with pytest.raises(ApiError) as err:
            await fetcher.inline(chat(cat), 1000, tenant="t")
        assert "waited 1 s for one of this tenant's 1 concurrent fetches" in err.value.message
        assert "pricing.media_urls.fetch_per_tenant" in err.value.message
        assert await holding > 0
        assert images.hits == ["/slow", "/cat.png"]
        assert fetcher._slots == {}
    finally:
        await fetcher.close()


async def test_in_open_mode_there_is_no_tenant_share_only_the_fetchers_connections(images: Images) -> None:
    # One tenant is everyone in open mode: a share would cap every client's fetches together.
    policy = MediaUrls(fetch=True, hosts=("127.0.0.1",), fetch_timeout_s=5, fetch_per_tenant=1)
    fetcher = MediaFetcher(lambda: policy)
    slow = f"http://127.0.0.1:{images.port}/slow"
    body = chat(slow)
    body["messages"][0]["content"].append({"type": "image_url", "image_url": {"url": slow}})
    try:
        fetching = asyncio.create_task(fetcher.inline(body, 1000, tenant=None))
        await eventually(lambda: images.hits.count("/slow") == 2, timeout_s=2, message="not fetched at once")
        assert images.done == []  # both running, neither answered yet
        assert await fetching > 0 and fetcher._slots == {}
    finally:
        await fetcher.close()

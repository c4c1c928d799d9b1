"""No tenant shares the engine's prefix cache with another, so none can time it to read their prompts.

A cached prefix makes the first token come sooner; a tenant timing its own requests learns whether a
guessed prefix is cached, i.e. what others sent (CVE-2025-46570). vLLM keeps caches apart by
``cache_salt``, which a caller sets as it likes: a hostile tenant sends its victim's. On a backend
with ``cache_salt: tenant`` the gateway sets the salt from the authenticated tenant on every JSON
body (gateway.request.cache_salt). Checked on the salts the backend received, over real sockets."""

from __future__ import annotations

import re
from typing import Any

import httpx
import pytest

from gateway.config.loader import ConfigError, parse_config
from gateway.request.cache_salt import tenant_cache_salt
from tests.conftest import GatewayFactory, StubBackend, stub_pools

CHAT: dict[str, Any] = {
    "model": "stub-model",
    "max_tokens": 5,
    "messages": [{"role": "system", "content": "You are the Acme support bot. Account 4421..."}],
}
ROUTES: list[tuple[str, dict[str, Any]]] = [
    ("/v1/chat/completions", CHAT),
    ("/v1/completions", {"model": "stub-model", "max_tokens": 5, "prompt": "Acme internal: "}),
    ("/v1/responses", {"model": "stub-model", "max_output_tokens": 5, "input": "Acme internal: "}),
    ("/v1/embeddings", {"model": "stub-model", "input": "Acme internal: "}),
    ("/v1/rerank", {"model": "stub-model", "query": "Acme", "documents": ["a"]}),
]


def config(url: str, cache_salt: str | None = "tenant") -> dict[str, object]:
    backend = {} if cache_salt is None else {"cache_salt": cache_salt}
    return {
        "pools": stub_pools(url, capacity=200_000, **backend),
        "tenants": {"acme": {"keys": ["ka"]}, "mallory": {"keys": ["km"]}},
        "passthrough": {"routes": [{"method": "POST", "path": "/v1/rerank"}]},
    }


async def post(url: str, key: str, path: str, body: dict[str, Any]) -> None:
    async with httpx.AsyncClient(headers={"authorization": f"Bearer {key}"}) as c:
        r = await c.post(url + path, json=body)
        assert r.status_code == 200, r.text


async def test_each_tenant_gets_its_own_salt_on_every_route_and_cannot_take_anothers(
    stub_backend: tuple[StubBackend, str], gateway_factory: GatewayFactory
) -> None:
    stub, url = stub_backend
    gw = await gateway_factory(config(url))
    for path, body in ROUTES:
        await post(gw.url, "ka", path, body)
        await post(gw.url, "ka", path, body)
        await post(gw.url, "km", path, body)
        acme_1, acme_2, mallory = (r.body["cache_salt"] for r in stub.requests[-3:])
        assert acme_1 == acme_2 != mallory, path  # a tenant shares its own cache, never another's
        assert re.fullmatch(r"tg-[0-9a-f]{32}", acme_1)
        # Mallory sends Acme's salt (and Acme's name, and a salt of her own): none of it is Acme's.
        for forged in (acme_1, "acme", tenant_cache_salt("acme")):
            await post(gw.url, "km", path, {**body, "cache_salt": forged})
            assert stub.requests[-1].body["cache_salt"] not in (acme_1, mallory)
    assert await gw.wait_idle() == {name: 0 for name in await gw.in_flight()}


async def test_a_tenant_can_still_keep_some_of_its_requests_apart(
    stub_backend: tuple[StubBackend, str], gateway_factory: GatewayFactory
) -> None:
    stub, url = stub_backend
    gw = await gateway_factory(config(url))
    for salt in (None, "session-1", "session-1", "session-2"):
        await post(gw.url, "ka", "/v1/chat/completions", {**CHAT, "cache_salt": salt} if salt else CHAT)
    plain, s1, s1_again, s2 = (r.body["cache_salt"] for r in stub.requests)
    assert s1 == s1_again and len({plain, s1, s2}) == 3


async def test_every_replica_gives_a_tenant_the_same_salt(
    stub_backend: tuple[StubBackend, str], gateway_factory: GatewayFactory
) -> None:
    stub, url = stub_backend
    one, two = await gateway_factory(config(url)), await gateway_factory(config(url))
    await post(one.url, "ka", "/v1/chat/completions", CHAT)
    await post(two.url, "ka", "/v1/chat/completions", CHAT)
    assert stub.requests[0].body["cache_salt"] == stub.requests[1].body["cache_salt"]


async def test_by_default_the_clients_own_salt_goes_as_sent(
    stub_backend: tuple[StubBackend, str], gateway_factory: GatewayFactory
) -> None:
    stub, url = stub_backend
    gw = await gateway_factory(config(url, cache_salt=None))
    await post(gw.url, "ka", "/v1/chat/completions", CHAT)
    await post(gw.url, "km", "/v1/chat/completions", {**CHAT, "cache_salt": "mine"})
    assert "cache_salt" not in stub.requests[0].body
    assert stub.requests[1].body["cache_salt"] == "mine"


def test_the_salt_depends_on_tenant_and_client_salt_only() -> None:
    assert tenant_cache_salt("a") == tenant_cache_salt("a", None) == tenant_cache_salt("a", "")
    # The tenant's name is length-prefixed: no (tenant, client salt) split writes another's bytes.
    assert tenant_cache_salt("ab", "c") != tenant_cache_salt("a", "bc")
    assert tenant_cache_salt("a", 1) != tenant_cache_salt("a", "x") and tenant_cache_salt(
        "a", 1
    ) == tenant_cache_salt("a", 1)


@pytest.mark.parametrize("value", ["yes", True, "per-tenant"])
def test_an_unknown_setting_names_the_field(value: object) -> None:
    with pytest.raises(
        ConfigError, match=r"pools\.default\.backends\[0\]\.cache_salt: expected one of 'client', 'tenant'"
    ):
        parse_config({"pools": stub_pools("http://127.0.0.1:9", cache_salt=value)})

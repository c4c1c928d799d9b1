"""The admin API: off without a token, roles, the OpenAPI document, and every operation applied live."""

from __future__ import annotations

import asyncio
import json
import logging
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from openapi_spec_validator import validate

from gateway.process.logs import JsonFormatter
from tests.conftest import GatewayFactory, StubBackend, serve_asgi, stub_pools
from tests.gateway.gw_support import ADMIN, READ, use


@pytest.fixture
def tokens_file(tmp_path: Path) -> str:
    path = tmp_path / "tokens"
    path.write_text("# role token\nadmin admin-secret\nread read-secret\n")
    return str(path)


def base(url: str, tokens_file: str | None, **extra: Any) -> dict[str, Any]:
    config: dict[str, Any] = {
        "pools": stub_pools(url),
        "tenants": {"acme": {"keys": ["sk-acme"], "budget_tokens": 1000}},
        **extra,
    }
    if tokens_file:
        config["admin"] = {"tokens_file": tokens_file, **extra.get("admin", {})}
    return config


async def test_without_a_token_the_admin_api_is_off_not_open(
    stub_backend: tuple[StubBackend, str], gateway_factory: GatewayFactory
) -> None:
    _, url = stub_backend
    gw = await gateway_factory(base(url, None))
    async with httpx.AsyncClient(base_url=gw.ops_url) as c:
        for method, path in [
            ("GET", "/admin/v1/tenants"),
            ("POST", "/admin/v1/tenants"),
            ("POST", "/admin/v1/reload"),
        ]:
            r = await c.request(method, path, headers=ADMIN)
            assert r.status_code == 404 and r.json()["error"]["code"] == "admin_api_off"


async def test_roles_read_token_reads_admin_token_writes_tenant_keys_get_nothing(
    stub_backend: tuple[StubBackend, str], gateway_factory: GatewayFactory, tokens_file: str
) -> None:
    _, url = stub_backend
    gw = await gateway_factory(base(url, tokens_file))
    async with httpx.AsyncClient(base_url=gw.ops_url) as c:
        assert (await c.get("/admin/v1/tenants", headers=READ)).status_code == 200
        r = await c.post("/admin/v1/tenants", json={"name": "x"}, headers=READ)
        assert r.status_code == 403 and r.json()["error"]["code"] == "forbidden"
        for headers in ({}, {"authorization": "Bearer sk-acme"}, {"authorization": "Bearer admin-secretX"}):
            r = await c.get("/admin/v1/tenants", headers=headers)
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_admin_token"
        assert (await c.post("/admin/v1/tenants", json={"name": "x"}, headers=ADMIN)).status_code == 201


async def test_the_openapi_document_is_valid_and_names_every_route(
    stub_backend: tuple[StubBackend, str], gateway_factory: GatewayFactory, tokens_file: str
) -> None:
    _, url = stub_backend
    gw = await gateway_factory(base(url, tokens_file))
    async with httpx.AsyncClient(base_url=gw.ops_url) as c:
        doc = (await c.get("/admin/v1/openapi.json", headers=READ)).json()
    validate(doc)
    assert doc["openapi"] == "3.1.0"
    served = {
        (method.lower(), route.path)
        for route in gw.app.admin_api.routes()
        for method in (route.methods or ())
        if method != "HEAD"  # type: ignore[attr-defined]
    }
    documented = {(m, p) for p, ops in doc["paths"].items() for m in ops if m != "parameters"}
    assert served == documented


async def test_tenant_lifecycle_with_keys_applies_at_once(
    stub_backend: tuple[StubBackend, str],
    gateway_factory: GatewayFactory,
    tokens_file: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    _, url = stub_backend
    gw = await gateway_factory(base(url, tokens_file))
    caplog.set_level(logging.INFO, logger="tokengate.audit")
    async with httpx.AsyncClient(base_url=gw.ops_url, headers=ADMIN) as c:
        r = await c.post(
            "/admin/v1/tenants", json={"name": "newco", "budget_tokens": 5000, "tier": "batch", "weight": 2}
        )
        assert r.status_code == 201 and r.json()["source"] == "admin"
        r = await c.post("/admin/v1/tenants/newco/keys", json={"name": "ci"})
        assert r.status_code == 201
        created = r.json()
        key = created["key"]
        assert key.startswith("tg-") and created["prefix"] == key[:10]
        assert (await use(gw, key)).status_code == 200
        listed = (await c.get("/admin/v1/tenants/newco/keys")).json()["keys"]
        assert (
            [k["id"] for k in listed] == [created["id"]]
            and "key" not in listed[0]
            and "digest" not in listed[0]
        )
        r = await c.patch("/admin/v1/tenants/newco", json={"budget_tokens": 200})
        assert r.json()["budget_tokens"] == 200
        assert (await gw.store.snapshot()).pools["tenant:newco"].capacity == 200
        assert (await use(gw, key, max_tokens=500)).status_code == 413  # now over the budget
        assert (await c.delete(f"/admin/v1/keys/{created['id']}")).status_code == 200
        assert (await use(gw, key)).status_code == 401
        assert (await c.delete("/admin/v1/tenants/newco")).status_code == 200
        assert (await c.get("/admin/v1/tenants/newco")).status_code == 404
    # As `tokengate serve` writes them: one JSON object per line, the change's fields as keys.
    lines = [JsonFormatter().format(rec) for rec in caplog.records if rec.name == "tokengate.audit"]
    assert len(lines) == 5 and all('"actor":"admin:' in line for line in lines)
    assert all(key not in line and created["prefix"] not in line.split('"prefix"')[0] for line in lines)
    update = json.loads(lines[2])
    assert {"timestamp", "level", "logger", "message"} <= set(update) and update[
        "logger"
    ] == "tokengate.audit"
    assert update["action"] == "tenant.update" and update["target"] == "tenants/newco"
    assert update["before"]["budget_tokens"] == 5000 and update["after"]["budget_tokens"] == 200


async def test_a_rotated_key_keeps_working_for_its_overlap_then_expires(
    stub_backend: tuple[StubBackend, str], gateway_factory: GatewayFactory, tokens_file: str
) -> None:
    _, url = stub_backend
    gw = await gateway_factory(base(url, tokens_file))
    async with httpx.AsyncClient(base_url=gw.ops_url, headers=ADMIN) as c:
        [file_key] = (await c.get("/admin/v1/tenants/acme/keys")).json()["keys"]
        assert file_key["source"] == "config" and file_key["prefix"] == "sk-"  # never more than half a key
        r = await c.post(f"/admin/v1/keys/{file_key['id']}/rotate", json={"overlap_s": 0.5})
        assert r.status_code == 201
        new_key = r.json()["key"]
        assert (await use(gw, "sk-acme")).status_code == 200  # inside the overlap: both work
        assert (await use(gw, new_key)).status_code == 200
        await asyncio.sleep(0.6)
        old = await use(gw, "sk-acme")
        assert old.status_code == 401 and old.json()["error"]["code"] == "expired_api_key"
        assert (await use(gw, new_key)).status_code == 200


async def test_pools_backends_and_tiers_change_live(
    stub_backend: tuple[StubBackend, str], gateway_factory: GatewayFactory, tokens_file: str
) -> None:
    first, url = stub_backend
    second = StubBackend()
    served = await serve_asgi(second)
    try:
        gw = await gateway_factory(base(url, tokens_file))
        async with httpx.AsyncClient(base_url=gw.ops_url, headers=ADMIN) as c:
            r = await c.patch("/admin/v1/pools/default", json={"budget_tokens": 50_000})
            assert r.json()["capacity_tokens"] == 50_000
            r = await c.post(
                "/admin/v1/pools/default/backends", json={"url": served.url, "capacity_tokens": 9000}
            )
            assert [b["url"] for b in r.json()["backends"]] == [url, served.url]
            r = await c.patch("/admin/v1/pools/default/backends", json={"url": url, "draining": True})
            assert [b["draining"] for b in r.json()["backends"]] == [True, False]
            assert (await use(gw, "sk-acme")).status_code == 200
            assert len(first.requests) == 0 and len(second.requests) == 1
            assert "cache_salt" not in second.requests[-1].body
            r = await c.patch(
                "/admin/v1/pools/default/backends", json={"url": served.url, "cache_salt": "tenant"}
            )
            assert r.status_code == 200, r.text
            assert (await use(gw, "sk-acme")).status_code == 200
            assert second.requests[-1].body["cache_salt"].startswith("tg-")  # the tenant's, set live
            r = await c.delete("/admin/v1/pools/default/backends", params={"url": url})
            assert [b["url"] for b in r.json()["backends"]] == [served.url]
            r = await c.put("/admin/v1/tiers/gold", json={"rank": 5, "ceiling": 0.5})
            assert "gold" in [t["name"] for t in r.json()["tiers"]] and len(r.json()["tiers"]) == 4
            r = await c.patch("/admin/v1/tenants/acme", json={"tier": "gold"})
            assert r.status_code == 200 and r.json()["tier"] == "gold"
            r = await c.delete("/admin/v1/tiers/gold")  # acme still uses it: refused, naming the field
            assert r.status_code == 400 and "tenants.acme.tier" in r.json()["error"]["message"]
            state = (await c.get("/admin/v1/state", headers=READ)).json()
            assert state["pools"]["backend:default"]["capacity"] == 50_000 and "acme" in state["tenants"]
    finally:
        await served.stop()


async def test_invalid_changes_are_refused_with_the_loaders_message(
    stub_backend: tuple[StubBackend, str], gateway_factory: GatewayFactory, tokens_file: str
) -> None:
    _, url = stub_backend
    gw = await gateway_factory(base(url, tokens_file))
    async with httpx.AsyncClient(base_url=gw.ops_url, headers=ADMIN) as c:
        cases = [
            ("POST", "/admin/v1/tenants", {"name": "x", "budget_tokens": -5}, "tenants.x.budget_tokens"),
            ("POST", "/admin/v1/tenants", {"name": "x", "tier": "platinum"}, "tenants.x.tier: unknown tier"),
            ("POST", "/admin/v1/tenants", {"name": "x", "keys": ["k"]}, "keys are managed with"),
            ("PATCH", "/admin/v1/tenants/acme", {"weight": "heavy"}, "tenants.acme.weight"),
            (
                "POST",
                "/admin/v1/pools/default/backends",
                {"url": "ftp://x", "capacity_tokens": 1},
                "backends[1].url",
            ),
            ("PATCH", "/admin/v1/pools/default", {"capacity": 5}, "Unknown field"),
        ]
        for method, path, body, message in cases:
            r = await c.request(method, path, json=body)
            assert r.status_code == 400 and message in r.json()["error"]["message"], (path, r.text)
        assert (
            await c.post("/admin/v1/tenants", content=b"[1,", headers={"content-type": "application/json"})
        ).status_code == 400
        assert (await c.get("/admin/v1/state")).status_code == 200
    assert (await use(gw, "sk-acme")).status_code == 200  # nothing changed


async def test_admin_changes_win_over_the_file_until_reset(
    stub_backend: tuple[StubBackend, str], gateway_factory: GatewayFactory, tokens_file: str, tmp_path: Path
) -> None:
    _, url = stub_backend
    path = tmp_path / "tokengate.yaml"
    config = base(url, tokens_file)
    path.write_text(yaml.safe_dump(config))
    gw = await gateway_factory(config)
    gw.app.config_path = str(path)

    async def budget() -> int:
        return (await gw.store.snapshot()).pools["tenant:acme"].capacity

    async with httpx.AsyncClient(base_url=gw.ops_url, headers=ADMIN) as c:
        await c.patch("/admin/v1/tenants/acme", json={"budget_tokens": 2000})
        config["tenants"]["acme"]["budget_tokens"] = 3000
        config["tenants"]["other"] = {"keys": ["sk-other"]}
        path.write_text(yaml.safe_dump(config))
        assert (await c.post("/admin/v1/reload")).json()["needs_restart"] == []
        assert await budget() == 2000  # the API's version wins over the file's...
        assert (await use(gw, "sk-other")).status_code == 200  # ...objects it never touched follow the file
        assert (await c.get("/admin/v1/overrides")).json()["overrides"]["tenants"] == {
            "acme": {"budget_tokens": 2000}
        }
        assert (await c.delete("/admin/v1/overrides/tenants/acme")).status_code == 200
        assert await budget() == 3000  # reset: the file again
        path.write_text("tenants: [broken\n")
        r = await c.post("/admin/v1/reload")
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_config"
        assert await budget() == 3000


async def test_the_memory_stores_admin_state_survives_a_restart_in_its_state_file(
    stub_backend: tuple[StubBackend, str], gateway_factory: GatewayFactory, tokens_file: str, tmp_path: Path
) -> None:
    _, url = stub_backend
    config = base(url, tokens_file, admin={"state_file": str(tmp_path / "state.json")})
    gw = await gateway_factory(config)
    async with httpx.AsyncClient(base_url=gw.ops_url, headers=ADMIN) as c:
        key = (await c.post("/admin/v1/tenants/acme/keys", json={})).json()["key"]
        await c.patch("/admin/v1/tenants/acme", json={"budget_tokens": 4321})
    await gw.served.stop()
    again = await gateway_factory(config)  # a new process reading the same file
    assert (await again.store.snapshot()).pools["tenant:acme"].capacity == 4321
    assert (await use(again, key)).status_code == 200

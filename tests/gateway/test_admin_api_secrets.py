"""Secrets and key lifetimes in the admin API: found while writing ``tokengate admin`` (docs/admin.md).

Each test failed on the first version of gateway/admin/api.py and control.py.
"""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from gateway.process.logs import JsonFormatter
from tests.conftest import GatewayFactory, StubBackend, stub_pools
from tests.gateway.gw_support import ADMIN, READ
from tests.gateway.gw_support import use_status as _status

UPSTREAM_KEY = "sk-upstream-secret-0123456789"


def _config(url: str, tmp_path: Path, **backend: Any) -> dict[str, Any]:
    tokens = tmp_path / "tokens"
    tokens.write_text("admin admin-secret\nread read-secret\n")
    return {
        "pools": stub_pools(url, **backend),
        "tenants": {"acme": {"keys": ["sk-acme"], "budget_tokens": 1000}},
        "admin": {"tokens_file": str(tokens)},
    }


async def test_a_read_only_token_never_sees_a_backends_api_key(
    stub_backend: tuple[StubBackend, str], gateway_factory: GatewayFactory, tmp_path: Path
) -> None:
    _, url = stub_backend
    gw = await gateway_factory(_config(url, tmp_path, api_key=UPSTREAM_KEY))
    async with httpx.AsyncClient(base_url=gw.ops_url) as c:
        await c.patch("/admin/v1/pools/default", json={"budget_tokens": 50_000}, headers=ADMIN)
        for path in ("/admin/v1/overrides", "/admin/v1/pools", "/admin/v1/pools/default"):
            r = await c.get(path, headers=READ)
            assert r.status_code == 200 and UPSTREAM_KEY not in r.text, path


async def test_the_audit_log_never_carries_a_backends_api_key(
    stub_backend: tuple[StubBackend, str],
    gateway_factory: GatewayFactory,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    _, url = stub_backend
    gw = await gateway_factory(_config(url, tmp_path, api_key=UPSTREAM_KEY))
    caplog.set_level(logging.INFO, logger="tokengate.audit")
    async with httpx.AsyncClient(base_url=gw.ops_url, headers=ADMIN) as c:
        assert (await c.patch("/admin/v1/pools/default", json={"budget_tokens": 50_000})).status_code == 200
    # As `tokengate serve` writes them: one JSON object per line, the change's fields as keys.
    lines = [JsonFormatter().format(rec) for rec in caplog.records if rec.name == "tokengate.audit"]
    assert lines and all(UPSTREAM_KEY not in line for line in lines)


async def test_a_read_only_token_never_sees_a_whole_key_from_the_file(
    stub_backend: tuple[StubBackend, str], gateway_factory: GatewayFactory, tmp_path: Path
) -> None:
    _, url = stub_backend
    gw = await gateway_factory(_config(url, tmp_path))  # acme's key in the file: "sk-acme"
    async with httpx.AsyncClient(base_url=gw.ops_url, headers=READ) as c:
        r = await c.get("/admin/v1/tenants/acme/keys")
    assert r.status_code == 200 and "sk-acme" not in [k["prefix"] for k in r.json()["keys"]]


async def test_rotating_an_expired_key_does_not_make_it_valid_again(
    stub_backend: tuple[StubBackend, str], gateway_factory: GatewayFactory, tmp_path: Path
) -> None:
    _, url = stub_backend
    gw = await gateway_factory(_config(url, tmp_path))
    async with httpx.AsyncClient(base_url=gw.ops_url, headers=ADMIN) as c:
        [old] = (await c.get("/admin/v1/tenants/acme/keys")).json()["keys"]
        assert (await c.post(f"/admin/v1/keys/{old['id']}/rotate", json={"overlap_s": 0})).status_code == 201
        deadline = time.monotonic() + 5
        while await _status(gw, "sk-acme") != 401:  # expired (the overlap was 0 s)
            assert time.monotonic() < deadline, "the rotated key never expired"
            await asyncio.sleep(0.01)
        r = await c.post(f"/admin/v1/keys/{old['id']}/rotate", json={"overlap_s": 3600})
        assert r.status_code == 409 or await _status(gw, "sk-acme") == 401

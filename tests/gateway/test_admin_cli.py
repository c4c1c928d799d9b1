"""``tokengate admin``: every command group against a real gateway, tables and --json, and the exit codes.

The gateway runs in the test's event loop (uvicorn); the CLI uses a synchronous client, so each call
runs in a thread.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from gateway import cli
from gateway.admin.cli import URL_ENV
from gateway.admin.tokens import ADMIN_ENV, METRICS_ENV, READONLY_ENV
from tests.conftest import GatewayFactory, RunningGateway, StubBackend, free_port, serve_asgi, stub_pools
from tests.gateway.gw_support import chat
from tests.gateway.gw_support import use_status as use

ADMIN_TOKEN = "admin-secret"
READ_TOKEN = "read-secret"


@dataclass
class Ran:
    code: int
    out: str
    err: str

    def json(self) -> Any:
        return json.loads(self.out)


@pytest.fixture(autouse=True)
def no_token_in_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in (ADMIN_ENV, READONLY_ENV, METRICS_ENV, URL_ENV):
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
def config(stub_backend: tuple[StubBackend, str], tmp_path: Path) -> dict[str, Any]:
    _, url = stub_backend
    tokens = tmp_path / "tokens"
    tokens.write_text(f"admin {ADMIN_TOKEN}\nread {READ_TOKEN}\n")
    return {
        "pools": stub_pools(url),
        "tenants": {"acme": {"keys": ["sk-acme-0123456789"], "budget_tokens": 1000}},
        "admin": {"tokens_file": str(tokens)},
    }


@pytest.fixture
def config_file(config: dict[str, Any], tmp_path: Path) -> Path:
    path = tmp_path / "tokengate.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


@pytest.fixture
async def gw(config: dict[str, Any], config_file: Path, gateway_factory: GatewayFactory) -> RunningGateway:
    running = await gateway_factory(config)
    running.app.config_path = str(config_file)  # what `tokengate serve --config` sets: reload reads it
    return running


@pytest.fixture
def admin(capsys: pytest.CaptureFixture[str]) -> Any:
    async def run(*argv: str) -> Ran:
        def call() -> int:
            try:
                return cli.main(["admin", *argv])
            except SystemExit as exc:  # argparse's usage errors
                return int(exc.code or 0)

        code = await asyncio.to_thread(call)
        captured = capsys.readouterr()
        return Ran(code, captured.out, captured.err)

    return run


def admin_url(gw: RunningGateway) -> str:
    """Where the admin routes are: the ops listener once the gateway has one, else its own port."""
    return str(getattr(gw, "ops_url", gw.url))


def gateway_args(gw: RunningGateway, token: str = ADMIN_TOKEN) -> list[str]:
    return ["--url", admin_url(gw), "--token", token]


async def capacity(gw: RunningGateway, pool: str) -> int:
    return int((await gw.store.snapshot()).pools[pool].capacity)


async def test_tenant_commands_create_show_update_and_delete_a_tenant_live(
    gw: RunningGateway, admin: Any
) -> None:
    g = gateway_args(gw)
    r = await admin(
        *g, "tenants", "create", "newco", "--budget-tokens", "5000", "--tier", "batch", "--weight", "2",
        "--models", "stub-*,other",
    )  # fmt: skip
    assert r.code == 0, r.err
    assert "newco" in r.out and "5000" in r.out and "stub-*,other" in r.out and "admin" in r.out
    assert await capacity(gw, "tenant:newco") == 5000

    listed = await admin(*g, "tenants", "list")
    rows = {line.split()[0]: line.split() for line in listed.out.splitlines()[2:]}
    assert rows["acme"][:2] == ["acme", "1000"] and rows["newco"][:4] == ["newco", "5000", "2", "batch"]

    r = await admin(*g, "tenants", "update", "newco", "--budget-tokens", "300", "--max-max-tokens", "50")
    assert r.code == 0 and "300" in r.out
    assert await capacity(gw, "tenant:newco") == 300
    shown = (await admin(*g, "--json", "tenants", "get", "newco")).json()
    assert shown["budget_tokens"] == 300 and shown["max_max_tokens"] == 50 and shown["tier"] == "batch"
    assert shown["models"] == ["stub-*", "other"] and shown["source"] == "admin"

    r = await admin(*g, "tenants", "update", "newco", "--max-max-tokens", "none", "--models", "")
    assert r.code == 0
    shown = (await admin(*g, "tenants", "get", "newco", "--json")).json()  # --json after the command too
    assert shown["max_max_tokens"] is None and shown["models"] == [] and shown["budget_tokens"] == 300

    assert shown["server_tools"] is None  # unset: whatever the engine runs
    r = await admin(*g, "tenants", "update", "newco", "--server-tools", "mcp:docs,code_interpreter")
    assert r.code == 0 and "mcp:docs,code_interpreter" in r.out, r.err
    r = await admin(*g, "tenants", "update", "newco", "--server-tools", "")
    assert r.code == 0 and "server_tools:        (none)" in r.out
    assert (await admin(*g, "--json", "tenants", "get", "newco")).json()["server_tools"] == []
    r = await admin(*g, "tenants", "update", "newco", "--server-tools", "any")
    assert r.code == 0 and "server_tools:        (any)" in r.out
    r = await admin(*g, "tenants", "update", "newco", "--server-tools", "Web Search")
    assert r.code != 0 and "server_tools[0]" in r.err

    r = await admin(*g, "tenants", "delete", "newco")
    assert r.code == 0 and "Deleted tenant newco" in r.out
    r = await admin(*g, "tenants", "get", "newco")
    assert r.code == 1 and "No tenant 'newco'" in r.err
    assert "newco" not in (await admin(*g, "--json", "tenants", "list")).out


async def test_a_created_key_works_at_once_is_printed_once_and_revoking_it_refuses_it(
    gw: RunningGateway, admin: Any
) -> None:
    g = gateway_args(gw)
    r = await admin(*g, "keys", "create", "acme", "--name", "ci")
    assert r.code == 0, r.err
    [key] = [w for w in r.out.split() if w.startswith("tg-")]
    assert r.out.count(key) == 1 and "shown once" in r.out
    assert await use(gw, key) == 200

    listed = await admin(*g, "keys", "list", "acme")
    assert key not in listed.out and "sk-acme-0123456789" not in listed.out
    assert key[:10] in listed.out and "ci" in listed.out and "active" in listed.out
    as_json = (await admin(*g, "keys", "list", "acme", "--json")).json()["keys"]
    [made] = [k for k in as_json if k["source"] == "admin"]
    assert all("key" not in k and "digest" not in k for k in as_json)

    r = await admin(*g, "keys", "revoke", made["id"])
    assert r.code == 0 and "Revoked key" in r.out
    assert await use(gw, key) == 401
    assert "revoked" in (await admin(*g, "keys", "list", "acme")).out


async def test_rotating_a_key_prints_the_new_one_and_keeps_the_old_for_the_overlap(
    gw: RunningGateway, admin: Any
) -> None:
    g = gateway_args(gw)
    [file_key] = (await admin(*g, "--json", "keys", "list", "acme")).json()["keys"]
    r = await admin(*g, "--json", "keys", "rotate", file_key["id"], "--overlap-s", "600")
    assert r.code == 0, r.err
    rotated = r.json()
    assert rotated["replaces"] == file_key["id"] and rotated["key"].startswith("tg-")
    assert await use(gw, rotated["key"]) == 200 and await use(gw, "sk-acme-0123456789") == 200
    listed = await admin(*g, "keys", "list", "acme")
    assert "valid until" in listed.out and rotated["key"] not in listed.out

    r = await admin(*g, "keys", "rotate", rotated["id"], "--overlap-s", "0")
    assert r.code == 0 and f"The old key {rotated['id']} stays valid until" in r.out
    assert await use(gw, rotated["key"]) == 401
    r = await admin(*g, "keys", "revoke", "key-nosuch")
    assert r.code == 1 and "No API key with id 'key-nosuch'" in r.err


async def test_pool_commands_set_the_budget_and_add_drain_resize_and_remove_backends(
    stub_backend: tuple[StubBackend, str], gw: RunningGateway, admin: Any
) -> None:
    first, url = stub_backend
    second = StubBackend()
    served = await serve_asgi(second)
    g = gateway_args(gw)  # the backend commands take the backend's --url: the gateway's goes first
    try:
        r = await admin(*g, "pools", "set", "default", "--budget-tokens", "50000")
        assert r.code == 0 and "budget 50000" in r.out
        assert await capacity(gw, "backend:default") == 50_000

        r = await admin(
            *g, "pools", "add-backend", "default", "--url", served.url, "--capacity-tokens", "9000",
            "--name", "second", "--models", "stub-model",
        )  # fmt: skip
        assert r.code == 0, r.err
        assert served.url in r.out and "second" in r.out and "9000" in r.out

        r = await admin(*g, "pools", "drain", "default", "--url", url)
        assert r.code == 0 and "draining" in r.out
        assert await use(gw, "sk-acme-0123456789") == 200
        assert len(first.requests) == 0 and len(second.requests) == 1
        r = await admin(*g, "pools", "undrain", "default", "--url", url)
        assert "draining" not in r.out

        r = await admin(
            *g, "pools", "resize-backend", "default", "--url", served.url, "--capacity-tokens", "7"
        )
        assert r.code == 0
        pool = (await admin(*g, "--json", "pools", "get", "default")).json()
        assert [(b["url"], b["capacity_tokens"], b["draining"]) for b in pool["backends"]] == [
            (url, 100_000, False),
            (served.url, 7, False),
        ]

        r = await admin(*g, "pools", "remove-backend", "default", "--url", served.url)
        assert r.code == 0 and served.url not in r.out
        listed = await admin(*g, "pools", "list")
        assert "default" in listed.out and url in listed.out and "serving, healthy" in listed.out
        r = await admin(*g, "pools", "remove-backend", "default", "--url", url)
        assert r.code == 1 and "A pool keeps at least one backend" in r.err
        r = await admin(*g, "pools", "get", "nosuch")
        assert r.code == 1 and "No pool 'nosuch'" in r.err
    finally:
        await served.stop()


async def test_tier_commands_set_and_delete_a_tier(gw: RunningGateway, admin: Any) -> None:
    g = gateway_args(gw)
    r = await admin(*g, "tiers", "set", "gold", "--rank", "5", "--ceiling", "0.5", "--max-queue-wait-s", "12")
    assert r.code == 0, r.err
    gold = next(line.split() for line in r.out.splitlines() if line.startswith("gold"))
    assert gold == ["gold", "5", "0.5", "12", "admin"]
    tiers = {t["name"]: t for t in (await admin(*g, "--json", "tiers", "list")).json()["tiers"]}
    assert set(tiers) == {"critical", "standard", "batch", "gold"} and tiers["gold"]["ceiling"] == 0.5

    await admin(*g, "tenants", "update", "acme", "--tier", "gold")
    r = await admin(*g, "tiers", "delete", "gold")
    assert r.code == 1 and "tenants.acme.tier" in r.err  # in use: refused with the loader's message
    await admin(*g, "tenants", "update", "acme", "--tier", "standard")
    r = await admin(*g, "tiers", "delete", "gold")
    assert r.code == 0 and "gold" not in r.out and "critical" in r.out


async def test_state_overrides_and_reload_show_and_reset_what_the_api_changed(
    config: dict[str, Any], config_file: Path, gw: RunningGateway, admin: Any
) -> None:
    g = gateway_args(gw)
    assert await use(gw, "sk-acme-0123456789", max_tokens=5000) == 413  # a recent error to show
    r = await admin(*g, "state")
    assert r.code == 0, r.err
    assert "backend:default" in r.out and "tenant:acme" in r.out and "request costs 5008 tokens" in r.out
    state = (await admin(*g, "--json", "state")).json()
    assert state["pools"]["tenant:acme"]["capacity"] == 1000 and state["recent_errors"][0]["status"] == 413

    assert "no overrides" in (await admin(*g, "overrides", "list")).out
    await admin(*g, "tenants", "update", "acme", "--budget-tokens", "2000")
    r = await admin(*g, "overrides", "list")
    assert "tenants/acme:" in r.out and "budget_tokens: 2000" in r.out
    assert (await admin(*g, "--json", "overrides", "list")).json()["overrides"]["tenants"] == {
        "acme": {"budget_tokens": 2000}
    }

    config["tenants"]["acme"]["budget_tokens"] = 3000
    await asyncio.to_thread(config_file.write_text, yaml.safe_dump(config))
    r = await admin(*g, "reload")
    assert r.code == 0 and "Reloaded" in r.out
    assert await capacity(gw, "tenant:acme") == 2000  # the override wins over the file...
    r = await admin(*g, "overrides", "reset", "tenants", "acme")
    assert r.code == 0 and "tenants/acme follows the config file again" in r.out
    assert await capacity(gw, "tenant:acme") == 3000  # ...until it is reset

    await asyncio.to_thread(config_file.write_text, "tenants: [broken\n")
    r = await admin(*g, "reload")
    assert r.code == 1 and "Reload refused" in r.err
    r = await admin(*g, "overrides", "reset", "tenants", "acme")
    assert r.code == 1 and "already follows the file" in r.err


async def test_a_backends_api_key_never_shows_in_the_overrides_table(
    config: dict[str, Any], gateway_factory: GatewayFactory, admin: Any
) -> None:
    config["pools"]["default"]["backends"][0]["api_key"] = "sk-upstream-secret"
    gw = await gateway_factory(config)
    g = gateway_args(gw)
    await admin(*g, "pools", "set", "default", "--budget-tokens", "40000")  # copies the file's backend
    r = await admin(*g, "overrides", "list")
    assert r.code == 0 and "api_key: '***'" in r.out and "sk-upstream-secret" not in r.out


async def test_errors_print_the_apis_message_and_exit_1_2_or_3(gw: RunningGateway, admin: Any) -> None:
    r = await admin("--url", admin_url(gw), "--token", "wrong", "tenants", "list")
    assert r.code == 1 and "Send an admin or read-only token" in r.err and r.out == ""
    r = await admin(*gateway_args(gw, READ_TOKEN), "tenants", "delete", "acme")
    assert r.code == 1 and "This token may only read; DELETE needs an admin token" in r.err
    assert (await admin(*gateway_args(gw, READ_TOKEN), "tenants", "list")).code == 0
    r = await admin(*gateway_args(gw), "tenants", "create", "x", "--budget-tokens", "0", "--tier", "gold")
    assert r.code == 1 and "tenants.x.tier: unknown tier" in r.err

    r = await admin("--url", f"http://127.0.0.1:{free_port()}", "--token", "t", "state")
    assert r.code == 3 and "connection refused" in r.err and "--url or TOKENGATE_ADMIN_URL" in r.err

    r = await admin("--url", admin_url(gw), "state")
    assert r.code == 2 and "no admin token" in r.err
    r = await admin(*gateway_args(gw), "tenants", "update", "acme")
    assert r.code == 2 and "give at least one setting" in r.err
    r = await admin(*gateway_args(gw), "tenants", "create")
    assert r.code == 2 and "name" in r.err
    r = await admin(*gateway_args(gw), "tenants", "update", "acme", "--budget-tokens", "lots")
    assert r.code == 2 and "expected a whole number or 'none'" in r.err
    r = await admin(*gateway_args(gw), "keys")
    assert r.code == 2


async def test_with_the_admin_api_off_the_cli_says_how_to_enable_it(
    stub_backend: tuple[StubBackend, str], gateway_factory: GatewayFactory, admin: Any
) -> None:
    _, url = stub_backend
    gw = await gateway_factory({"pools": stub_pools(url)})
    r = await admin(*gateway_args(gw), "tenants", "list")
    assert r.code == 1
    assert "The admin API is off: set TOKENGATE_ADMIN_TOKEN (or admin.tokens_file)" in r.err
    assert "takes effect when the gateway starts" in r.err


async def test_the_url_and_token_come_from_the_environment_and_flags_win(
    gw: RunningGateway, admin: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(URL_ENV, admin_url(gw) + "/")
    monkeypatch.setenv(ADMIN_ENV, ADMIN_TOKEN)
    r = await admin("tenants", "list")
    assert r.code == 0 and "acme" in r.out
    monkeypatch.delenv(ADMIN_ENV)
    monkeypatch.setenv(READONLY_ENV, READ_TOKEN)  # enough to read, refused for writing
    assert (await admin("tenants", "list")).code == 0
    assert (await admin("tenants", "delete", "acme")).code == 1
    r = await admin("tenants", "list", "--token", "wrong")
    assert r.code == 1 and "Send an admin or read-only token" in r.err
    monkeypatch.setenv(URL_ENV, f"http://127.0.0.1:{free_port()}")
    assert (await admin("tenants", "list", "--url", admin_url(gw))).code == 0


def test_admin_is_listed_among_the_tokengate_commands(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main([]) == 2
    assert "admin" in capsys.readouterr().out


async def test_state_of_one_budget_domain_and_of_all_merged(
    config: dict[str, Any], gateway_factory: GatewayFactory, admin: Any
) -> None:
    eu = await serve_asgi(StubBackend())
    try:
        config["pools"]["eu"] = {"backends": [{"url": eu.url, "capacity_tokens": 500}]}
        config["store"] = {"domains": {"eu": {"pools": ["eu"]}}}
        gw = await gateway_factory(config)
        g = gateway_args(gw)
        r = await admin(*g, "state")
        assert r.code == 0, r.err
        assert "budget domains default, eu, merged (--domain NAME for one)" in r.out
        assert "backend:eu" in r.out and "backend:default" in r.out
        r = await admin(*g, "state", "--domain", "eu")
        assert r.code == 0 and "budget domain eu (of default, eu)" in r.out
        assert "backend:eu" in r.out and "backend:default" not in r.out
        state = (await admin(*g, "--json", "state", "--domain", "eu")).json()
        assert state["pools"]["tenant:acme"]["capacity"] == 1000  # a tenant's budget, per domain
        r = await admin(*g, "state", "--domain", "us")
        assert r.code != 0 and "No budget domain 'us'; this gateway's domains: default, eu" in r.err
    finally:
        await eu.stop()


async def test_quota_commands_set_show_reset_and_delete_live(gw: RunningGateway, admin: Any) -> None:
    g = gateway_args(gw)
    r = await admin(*g, "quotas", "set", "acme", "daily", "--tokens", "30", "--window", "day")
    assert r.code == 0, r.err
    assert (await admin(*g, "--json", "tenants", "get", "acme")).json()["quotas"] == [
        {"name": "daily", "tokens": 30, "window": "day"}
    ]
    r = await admin(
        *g, "quotas", "set", "acme", "hourly", "--requests", "100", "--window", "hour", "--enforce", "false"
    )
    assert r.code == 0, r.err
    key = {"authorization": "Bearer sk-acme-0123456789", "x-stub-chunks": "3"}
    async with httpx.AsyncClient(base_url=gw.url) as c:
        body = chat(max_tokens=5)
        assert (await c.post("/v1/chat/completions", json=body, headers=key)).status_code == 200
        assert (await c.post("/v1/chat/completions", json=body, headers=key)).status_code == 200
        assert (
            await c.post("/v1/chat/completions", json=body, headers=key)
        ).status_code == 429  # 28 of 30 used

        shown = await admin(*g, "quotas", "show", "acme")
        assert shown.code == 0, shown.err
        lines = {ln.split()[0]: ln.split() for ln in shown.out.splitlines()[3:]}
        assert lines["daily"][1:6] == ["tokens", "day", "28", "0", "2"] and lines["hourly"][-3] == "shadow"

        r = await admin(*g, "quotas", "reset", "acme", "daily")
        assert r.code == 0 and "28 tokens of use forgotten" in r.out, r.out + r.err
        assert (await c.post("/v1/chat/completions", json=body, headers=key)).status_code == 200

    used = (await admin(*g, "--json", "quotas", "show", "acme")).json()["quotas"]
    assert [(q["name"], q["used"]) for q in used] == [("daily", 14), ("hourly", 3)]  # reset: daily only
    r = await admin(*g, "quotas", "set", "acme", "daily", "--tokens", "1000", "--window", "day")
    assert r.code == 0
    assert (await admin(*g, "--json", "quotas", "show", "acme")).json()["quotas"][0]["used"] == 14  # kept
    r = await admin(*g, "quotas", "set", "acme", "weekly", "--tokens", "10", "--window", "fortnight")
    assert r.code == 1 and "tenants.acme.quotas[2].window" in r.err
    r = await admin(*g, "quotas", "reset", "acme", "monthly")
    assert r.code == 1 and "has no quota 'monthly'" in r.err
    r = await admin(*g, "quotas", "delete", "acme", "hourly")
    assert r.code == 0
    assert [q["name"] for q in (await admin(*g, "--json", "tenants", "get", "acme")).json()["quotas"]] == [
        "daily"
    ]
    r = await admin(*g, "--token", READ_TOKEN, "quotas", "reset", "acme", "daily")
    assert r.code == 1 and "needs an admin token" in r.err


async def test_shadow_mode_flags_for_budgets_and_ceilings(gw: RunningGateway, admin: Any) -> None:
    g = gateway_args(gw)
    r = await admin(*g, "tenants", "update", "acme", "--budget-enforce", "false")
    assert r.code == 0 and "shadow mode" in r.out, r.err
    assert await capacity(gw, "tenant:acme") == 100_000  # the pool holds it to the backends only
    r = await admin(
        *g, "tiers", "set", "batch", "--rank", "2", "--ceiling", "0.5", "--ceiling-enforce", "false"
    )
    assert r.code == 0, r.err
    assert "0.5 (shadow)" in r.out
    r = await admin(*g, "tenants", "update", "acme", "--budget-enforce", "maybe")
    assert r.code == 2 and "expected true or false" in r.err
    r = await admin(*g, "tenants", "update", "acme", "--budget-enforce", "true")
    assert r.code == 0 and await capacity(gw, "tenant:acme") == 1000


async def test_price_commands_list_set_and_delete(gw: RunningGateway, admin: Any) -> None:
    g = gateway_args(gw)
    r = await admin(
        *g, "prices", "set", "stub-*", "--input", "0.2", "--output", "0.6", "--cached-input", "0.1"
    )
    assert r.code == 0, r.err
    row = next(line.split() for line in r.out.splitlines() if line.startswith("stub-*"))
    assert row[1:4] == ["0.2", "0.1", "0.6"]
    assert gw.app.quotas.price_of("stub-model") is not None
    r = await admin(*g, "--json", "prices", "list")
    assert r.json()["prices"] == [
        {"model": "stub-*", "price": {"input": 0.2, "output": 0.6, "cached_input": 0.1}, "source": "admin"}
    ]
    r = await admin(*g, "prices", "delete", "stub-*")
    assert r.code == 0 and "(no models configured)" in r.out  # the glob was the admin API's: gone
    r = await admin(*g, "prices", "delete", "stub-*")
    assert r.code == 1 and "No price on model glob" in r.err

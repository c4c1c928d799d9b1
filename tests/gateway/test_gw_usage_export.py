"""Usage for billing through the gateway over real sockets: every request that ran is counted once per
hour, tenant, key and model, the export (JSON, CSV, the CLI) adds up to what the quotas settled, a
request that never ran counts nothing, and bad ranges get clear errors."""

from __future__ import annotations

import asyncio
import csv
import io
import time
from typing import Any

import httpx
import pytest

from gateway import cli
from gateway.admin.tokens import ADMIN_ENV
from tests.conftest import GatewayFactory, RunningGateway, StubBackend, stub_pools
from tests.gateway.gw_support import chat, cut_stream
from tests.support import eventually

ADMIN = "admin-secret"
KEYS = ("sk-first-0123456789", "sk-second-0123456789")
PROMPT = 11  # the stub's prompt tokens


async def post(gw: RunningGateway, key: str, chunks: int = 3, **headers: str) -> httpx.Response:
    async with httpx.AsyncClient(base_url=gw.url) as c:
        return await c.post(
            "/v1/chat/completions",
            json=chat(max_tokens=20),
            headers={"authorization": f"Bearer {key}", "x-stub-chunks": str(chunks), **headers},
        )


async def export(gw: RunningGateway, **query: str) -> httpx.Response:
    async with httpx.AsyncClient(base_url=gw.ops_url, headers={"authorization": f"Bearer {ADMIN}"}) as c:
        return await c.get("/admin/v1/usage", params=query)


@pytest.fixture
async def gw(
    stub_backend: tuple[StubBackend, str], gateway_factory: GatewayFactory, monkeypatch: pytest.MonkeyPatch
) -> RunningGateway:
    monkeypatch.setenv(ADMIN_ENV, ADMIN)
    _, url = stub_backend
    return await gateway_factory(
        {
            "pools": stub_pools(url),
            "models": {"stub-*": {"price": {"input": 1.0, "output": 2.0}}},
            "tenants": {
                "acme": {"keys": list(KEYS), "quotas": [{"tokens": 1_000_000, "window": "day"}]},
                "other": {"keys": ["sk-other-0123456789"], "budget_tokens": 10},  # every request 413
            },
            "usage_log": {"flush_s": 0.05},
        }
    )


async def test_every_request_that_ran_is_counted_once_and_adds_up(gw: RunningGateway) -> None:
    answers = await asyncio.gather(
        *(post(gw, KEYS[0]) for _ in range(5)),
        *(post(gw, KEYS[1], chunks=7) for _ in range(2)),
    )
    assert [a.status_code for a in answers] == [200] * 7
    assert (await post(gw, "sk-other-0123456789")).status_code == 413  # never ran: nothing counted
    # a stream cut by its client before its usage: counted at its reservation, marked estimated
    await cut_stream(gw.url, KEYS[1])
    await eventually(lambda: not gw.app.quotas._live and gw.app.billing.pending() == 0)

    r = await export(gw, by="hour")
    assert r.status_code == 200, r.text
    data = r.json()
    rows = data["rows"]
    assert {row["tenant"] for row in rows} == {"acme"} and {row["model"] for row in rows} == {"stub-model"}
    by_key = {row["key"]: row for row in rows}
    assert len(by_key) == 2 and all(k.startswith("sha256:") and "sk-" not in k for k in by_key)
    first, second = sorted(by_key.values(), key=lambda row: row["requests"], reverse=True)
    assert (first["requests"], first["prompt_tokens"], first["completion_tokens"]) == (5, 5 * PROMPT, 15)
    assert first["cost"] == pytest.approx((5 * PROMPT * 1.0 + 15 * 2.0) / 1e6)
    assert second["requests"] == 3 and second["estimated_requests"] == 1
    assert second["completion_tokens"] == 14 + 40  # the cut stream: its 40 reserved
    # the same totals as the quota settled
    [(used, reserved)] = await gw.app.quotas.ledger.usage(
        [(q.key, q.window.oldest(time.time())) for q in gw.app.config.tenants[0].quotas]
    )
    totals = data["totals"]
    assert reserved == 0 and used == totals["prompt_tokens"] + totals["completion_tokens"]
    assert totals["requests"] == 8

    # CSV, by month, one tenant
    r = await export(gw, by="month", tenant="acme", format="csv")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/csv")
    lines = list(csv.DictReader(io.StringIO(r.text)))
    assert sum(int(line["requests"]) for line in lines) == 8
    assert all(line["start"].endswith("-01T00:00:00Z") for line in lines)
    r = await export(gw, tenant="other")
    assert r.json()["rows"] == []


async def test_the_cli_prints_a_table_and_csv(
    gw: RunningGateway, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    assert (await post(gw, KEYS[0])).status_code == 200
    await eventually(lambda: gw.app.billing.pending() == 0)
    base = ["admin", "--url", gw.ops_url, "--token", ADMIN, "usage"]

    def run(*argv: str) -> tuple[int, str, str]:
        code = cli.main([*base, *argv])
        out = capsys.readouterr()
        return code, out.out, out.err

    code, out, _ = await asyncio.to_thread(run)
    assert code == 0 and "stub-model" in out and "total: 1 requests" in out
    code, out, _ = await asyncio.to_thread(run, "--csv", "--by", "month")
    assert code == 0 and out.splitlines()[0].startswith("start,tenant,key,model,requests")
    assert len(out.splitlines()) == 2
    code, _, err = await asyncio.to_thread(run, "--from", "yesterday")
    assert code == 1 and "'from' must be an ISO 8601 date" in err


async def test_a_model_name_like_a_formula_stays_text_in_the_csv(gw: RunningGateway) -> None:
    """A hostile tenant names its model so that the billing CSV would run a formula in a spreadsheet."""
    async with httpx.AsyncClient(base_url=gw.url) as c:
        body = {**chat(max_tokens=5), "model": '=HYPERLINK("http://evil.example","x")'}
        r = await c.post("/v1/chat/completions", json=body, headers={"authorization": f"Bearer {KEYS[0]}"})
    assert r.status_code == 200, r.text
    await eventually(lambda: gw.app.billing.pending() == 0)
    lines = list(csv.DictReader(io.StringIO((await export(gw, format="csv")).text)))
    assert [line["model"] for line in lines] == ['\'=HYPERLINK("http://evil.example","x")']
    assert (await export(gw)).json()["rows"][0]["model"].startswith("=HYPERLINK")  # JSON: as it was


@pytest.mark.parametrize(
    ("query", "message"),
    [
        ({"from": "2026-13-01"}, "'from' must be an ISO 8601 date"),
        ({"by": "week"}, "'by' must be one of hour, day, month"),
        ({"format": "xml"}, "'format' must be json or csv"),
        ({"from": "2026-12-02", "to": "2026-12-01"}, "'to' must be after 'from'"),
        ({"from": "2020-01-01", "to": "2026-01-01"}, "export at most"),
    ],
)
async def test_bad_ranges_are_refused_clearly(
    gw: RunningGateway, query: dict[str, Any], message: str
) -> None:
    r = await export(gw, **query)
    assert r.status_code == 400 and message in r.json()["error"]["message"]


async def test_a_read_token_may_export_and_the_log_can_be_off(
    stub_backend: tuple[StubBackend, str], gateway_factory: GatewayFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(ADMIN_ENV, ADMIN)
    _, url = stub_backend
    gw = await gateway_factory({"pools": stub_pools(url), "usage_log": {"enabled": False}})
    r = await export(gw)
    assert r.status_code == 404 and r.json()["error"]["code"] == "usage_log_off"

"""Shadow mode on the in-flight limits, through the gateway over real sockets: a tenant's budget or a
tier's ceiling with enforce false never holds a request back, counts what it would have held back
(metrics, /stats, doctor), and its gauges are back at zero when the requests are done. Fuzzed:
whatever shadow limits and load, nothing is refused."""

from __future__ import annotations

import asyncio
import io
import random
from typing import Any

import httpx

from gateway.observe.diagnose import diagnose
from gateway.observe.doctor import report
from tests.conftest import GatewayFactory, RunningGateway, StubBackend, stub_pools
from tests.gateway.gw_support import chat
from tests.support import eventually

KEY = "sk-shadow"


async def post(gw: RunningGateway, max_tokens: int = 50, delay: float = 0.2) -> httpx.Response:
    async with httpx.AsyncClient(base_url=gw.url, timeout=30) as c:
        return await c.post(
            "/v1/chat/completions",
            json=chat(max_tokens=max_tokens),
            headers={"authorization": f"Bearer {KEY}", "x-stub-chunks": "2", "x-stub-delay": str(delay)},
        )


async def stats(gw: RunningGateway) -> dict[str, Any]:
    async with httpx.AsyncClient(base_url=gw.ops_url) as c:
        r = await c.get("/stats")
    assert r.status_code == 200, r.text
    return dict(r.json())


async def metrics(gw: RunningGateway) -> str:
    async with httpx.AsyncClient(base_url=gw.ops_url) as c:
        return (await c.get("/metrics")).text


async def gauges_empty(gw: RunningGateway) -> None:
    """Every gauge given back: nothing held in the ledger, the pools at zero."""
    await eventually(lambda: gw.app.quotas.ledger.held() == 0)
    assert not any((await gw.wait_idle()).values())


async def test_a_budget_in_shadow_mode_holds_nothing_back_and_counts(
    stub_backend: tuple[StubBackend, str], gateway_factory: GatewayFactory
) -> None:
    _, url = stub_backend
    gw = await gateway_factory(
        {
            "pools": stub_pools(url),
            "tenants": {"acme": {"keys": [KEY], "budget_tokens": 100, "budget_enforce": False}},
        }
    )
    # Each request holds its prompt + 50: two of them are past a budget of 100 (enforced, they
    # would run one at a time).
    answers = await asyncio.gather(*(post(gw) for _ in range(8)))
    assert [a.status_code for a in answers] == [200] * 8
    counted = gw.app.shadow.counts[("budget", "acme")]
    assert 4 <= counted <= 7  # all but the first ran alongside others (the gauge races a little)
    assert f'tokengate_shadow_refusals_total{{kind="budget",limit="acme"}} {float(counted)}' in await metrics(
        gw
    )
    page = await stats(gw)
    assert {
        "kind": "budget",
        "name": "acme",
        "unit": "tokens",
        "limit": 100,
        "would_refuse": counted,
    } in page["limits"]["shadow"]
    # the store's pool does not hold the budget: its capacity is the backends'
    tenant_row = next(t for t in page["tenants"] if t["name"] == "acme")
    assert tenant_row["capacity"] == 100_000
    out = io.StringIO()
    report(page, diagnose(page), gw.ops_url, out)
    line = next(ln for ln in out.getvalue().splitlines() if "[shadow]" in ln)
    assert "1 limit in shadow mode" in line and "budget acme" in line
    await gauges_empty(gw)


async def test_the_same_budget_enforced_runs_them_one_at_a_time(
    stub_backend: tuple[StubBackend, str], gateway_factory: GatewayFactory
) -> None:
    """The control: what the shadow budget counted is what the enforced one holds back."""
    _, url = stub_backend
    gw = await gateway_factory(
        {"pools": stub_pools(url), "tenants": {"acme": {"keys": [KEY], "budget_tokens": 100}}}
    )
    peak = 0

    async def watch() -> None:
        nonlocal peak
        while True:
            peak = max(peak, (await gw.in_flight()).get("tenant:acme", 0))
            await asyncio.sleep(0.01)

    watcher = asyncio.create_task(watch())
    answers = await asyncio.gather(*(post(gw, delay=0.05) for _ in range(4)))
    watcher.cancel()
    assert [a.status_code for a in answers] == [200] * 4
    assert 0 < peak <= 100
    assert not gw.app.shadow.configured and not gw.app.shadow.counts


async def test_a_tier_ceiling_in_shadow_mode_counts_per_pool(
    stub_backend: tuple[StubBackend, str], gateway_factory: GatewayFactory
) -> None:
    _, url = stub_backend
    gw = await gateway_factory(
        {
            "pools": stub_pools(url, capacity=1000),
            "tiers": {
                "interactive": {"rank": 0},
                "batch": {"rank": 1, "ceiling": 0.1, "ceiling_enforce": False},
            },
            "tenants": {"acme": {"keys": [KEY], "tier": "batch"}},
        }
    )
    answers = await asyncio.gather(*(post(gw, max_tokens=60) for _ in range(6)))
    assert [a.status_code for a in answers] == [200] * 6  # 100 tokens a ceiling; each holds ~70
    counted = gw.app.shadow.counts[("ceiling", "batch/backend:default")]
    assert 3 <= counted <= 5
    page = await stats(gw)
    row = next(r for r in page["limits"]["shadow"] if r["kind"] == "ceiling")
    assert row == {
        "kind": "ceiling",
        "name": "batch/backend:default",
        "unit": "tokens",
        "limit": 100,
        "would_refuse": counted,
    }
    text = await metrics(gw)
    assert (
        f'tokengate_shadow_refusals_total{{kind="ceiling",limit="batch/backend:default"}} {float(counted)}'
        in text
    )
    await gauges_empty(gw)


async def test_admin_api_shows_and_turns_shadow_mode(
    stub_backend: tuple[StubBackend, str], gateway_factory: GatewayFactory, monkeypatch: Any
) -> None:
    monkeypatch.setenv("TOKENGATE_ADMIN_TOKEN", "admin-secret")
    _, url = stub_backend
    gw = await gateway_factory(
        {"pools": stub_pools(url), "tenants": {"acme": {"keys": [KEY], "budget_tokens": 100}}}
    )
    auth = {"authorization": "Bearer admin-secret"}
    async with httpx.AsyncClient(base_url=gw.ops_url, headers=auth) as c:
        r = await c.patch("/admin/v1/tenants/acme", json={"budget_enforce": False})
        assert r.status_code == 200, r.text
        assert r.json()["budget_enforce"] is False
        bad = await c.patch("/admin/v1/tenants/acme", json={"budget_enforce": "no"})
        assert (
            bad.status_code == 400
            and "budget_enforce: expected true or false" in bad.json()["error"]["message"]
        )
    await eventually(lambda: gw.app.shadow.configured)
    answers = await asyncio.gather(*(post(gw) for _ in range(3)))
    assert [a.status_code for a in answers] == [200] * 3
    assert gw.app.shadow.counts[("budget", "acme")] >= 1
    await gauges_empty(gw)


async def test_shadow_limits_never_refuse_fuzzed(
    stub_backend: tuple[StubBackend, str], gateway_factory: GatewayFactory
) -> None:
    """Random shadow budgets, ceilings and quotas far below the load; every request runs."""
    _, url = stub_backend
    rng = random.Random(20261205)
    for _ in range(5):
        capacity = rng.choice([400, 1000, 5000])
        gw = await gateway_factory(
            {
                "pools": stub_pools(url, capacity=capacity),
                "tiers": {
                    "top": {"rank": 0, "ceiling": rng.choice([0.05, 0.2, 0.5]), "ceiling_enforce": False},
                },
                "tenants": {
                    "acme": {
                        "keys": [KEY],
                        "tier": "top",
                        "budget_tokens": rng.randint(1, 200),
                        "budget_enforce": False,
                        "quotas": [
                            {"tokens": rng.randint(1, 100), "window": "minute", "enforce": False},
                            {"requests": rng.randint(1, 3), "window": "hour", "enforce": False},
                        ],
                    }
                },
            }
        )
        sizes = [rng.randint(1, 300) for _ in range(rng.randint(4, 12))]
        answers = await asyncio.gather(*(post(gw, max_tokens=n, delay=rng.random() * 0.05) for n in sizes))
        assert [a.status_code for a in answers] == [200] * len(sizes), [
            a.text for a in answers if a.status_code != 200
        ]
        assert gw.app.quotas.refused == 0
        await gauges_empty(gw)

"""Quotas through the gateway over real sockets: 429 quota_exceeded with Retry-After, OpenAI's
rate-limit headers (read with the official SDK), settlement exactly once on every path, shadow
mode, cost quotas, the admin API's usage view and live changes, config errors."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import httpx
import openai
import pytest

from gateway.config.fields import ConfigError
from gateway.config.loader import parse_config
from tests.conftest import GatewayFactory, RunningGateway, StubBackend, stub_pools
from tests.gateway.gw_support import chat, cut_stream
from tests.support import eventually

KEY = "sk-quota"
ADMIN = "admin-secret"
# The stub answers 11 prompt tokens and one output token per chunk (3 by default here).
PROMPT, CHUNKS = 11, 3


def config(url: str, quotas: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    return {
        "pools": stub_pools(url),
        "tenants": {"acme": {"keys": [KEY], "quotas": quotas}},
        "drain_timeout_s": 1,
        **extra,
    }


async def post(gw: RunningGateway, max_tokens: int = 20, **headers: str) -> httpx.Response:
    async with httpx.AsyncClient(base_url=gw.url) as c:
        return await c.post(
            "/v1/chat/completions",
            json=chat(max_tokens=max_tokens),
            headers={"authorization": f"Bearer {KEY}", "x-stub-chunks": str(CHUNKS), **headers},
        )


async def usage(gw: RunningGateway) -> list[tuple[int, int]]:
    gate = gw.app.quotas
    specs = gw.app.config.tenants[0].quotas
    return await gate.ledger.usage([(q.key, q.window.oldest(time.time())) for q in specs])


async def settled(gw: RunningGateway) -> list[tuple[int, int]]:
    """The windows once every reservation is settled (none held)."""
    await eventually(lambda: not gw.app.quotas._live)
    return await usage(gw)


async def test_a_full_window_refuses_at_once_with_retry_after_and_headers(
    stub_backend: tuple[StubBackend, str], gateway_factory: GatewayFactory
) -> None:
    _, url = stub_backend
    gw = await gateway_factory(config(url, [{"tokens": 100, "window": "hour"}]))
    first = await post(gw)
    assert first.status_code == 200, first.text
    assert first.headers["x-ratelimit-limit-tokens"] == "100"
    # priced at admission: the prompt as priced + 20 reserved; what is left counts the reservation
    remaining = int(first.headers["x-ratelimit-remaining-tokens"])
    assert 0 < remaining < 100 - 20
    assert first.headers["x-ratelimit-reset-tokens"].endswith("s")
    # settled at the engine's usage: 11 + 3
    assert await settled(gw) == [(PROMPT + CHUNKS, 0)]
    statuses = [(await post(gw)).status_code for _ in range(8)]
    assert statuses.count(200) >= 1 and statuses[-1] == 429
    refused = await post(gw)
    assert refused.status_code == 429
    err = refused.json()["error"]
    assert err["code"] == "quota_exceeded" and "tokens-hour" in err["message"]
    assert 1 <= int(refused.headers["retry-after"]) <= 3600
    assert refused.headers["x-ratelimit-remaining-tokens"] == str(100 - (await settled(gw))[0][0])
    used, reserved = (await settled(gw))[0]
    assert reserved == 0 and used == statuses.count(200) * (PROMPT + CHUNKS) + PROMPT + CHUNKS
    assert not any((await gw.wait_idle()).values())


async def test_concurrent_requests_never_take_more_than_the_quota(
    stub_backend: tuple[StubBackend, str], gateway_factory: GatewayFactory
) -> None:
    _, url = stub_backend
    gw = await gateway_factory(config(url, [{"tokens": 1000, "window": "day"}]))
    answers = await asyncio.gather(*(post(gw, max_tokens=30, **{"x-stub-delay": "0.05"}) for _ in range(50)))
    ok = sum(a.status_code == 200 for a in answers)
    assert {a.status_code for a in answers} <= {200, 429}
    used, reserved = (await settled(gw))[0]
    assert reserved == 0 and used == ok * (PROMPT + CHUNKS) <= 1000
    assert not any((await gw.in_flight()).values())


async def test_every_path_settles_exactly_once(
    stub_backend: tuple[StubBackend, str], gateway_factory: GatewayFactory
) -> None:
    _, url = stub_backend
    gw = await gateway_factory(config(url, [{"tokens": 100_000, "window": "day"}]))
    assert (await post(gw)).status_code == 200  # 11 + 3
    assert (await post(gw, **{"x-stub-status": "500"})).status_code == 502  # an engine error: nothing used
    # a stream cut by its client half way: the reservation is charged (no usage came)
    await cut_stream(gw.url, KEY)
    used, reserved = await eventually_settled(gw)
    assert reserved == 0
    assert PROMPT + CHUNKS < used <= PROMPT + CHUNKS + 200  # the cut stream: its priced prompt + 40
    assert gw.app.quotas.ledger.held() == 0
    assert not any((await gw.in_flight()).values())


async def eventually_settled(gw: RunningGateway) -> tuple[int, int]:
    async def none_reserved() -> bool:
        return (await usage(gw))[0][1] == 0

    await eventually(none_reserved)
    return (await usage(gw))[0]


async def test_shadow_quota_never_refuses_but_counts(
    stub_backend: tuple[StubBackend, str], gateway_factory: GatewayFactory
) -> None:
    _, url = stub_backend
    gw = await gateway_factory(config(url, [{"tokens": 10, "window": "minute", "enforce": False}]))
    statuses = [(await post(gw)).status_code for _ in range(5)]
    assert statuses == [200] * 5
    assert gw.app.quotas.would_refuse == 5 and gw.app.quotas.refused == 0
    async with httpx.AsyncClient(base_url=gw.ops_url) as c:
        metrics = (await c.get("/metrics")).text
    assert (
        'tokengate_quota_refusals_total{enforced="false",quota="tokens-minute",tenant="acme"} 5.0' in metrics
    )


async def test_cost_quota_charges_the_models_price(
    stub_backend: tuple[StubBackend, str], gateway_factory: GatewayFactory
) -> None:
    _, url = stub_backend
    # $1,000 per 1M input, $10,000 per 1M output: 11 + 3 tokens cost 0.011 + 0.03 = $0.041
    cfg = config(url, [{"cost": 0.1, "window": "month"}])
    cfg["models"] = {"stub-*": {"price": {"input": 1000, "output": 10_000}}}
    gw = await gateway_factory(cfg)
    assert (await post(gw, max_tokens=5)).status_code == 200
    assert (await settled(gw)) == [(41_000, 0)]
    assert (await post(gw, max_tokens=5)).status_code == 200
    refused = await post(gw, max_tokens=5)
    assert refused.status_code == 429 and refused.json()["error"]["code"] == "quota_exceeded"
    assert "0.08 of 0.10" in refused.json()["error"]["message"]
    assert "x-ratelimit-limit-tokens" not in refused.headers  # a cost quota has no token headers


async def test_an_unpriced_model_under_a_cost_quota_is_refused_clearly(
    stub_backend: tuple[StubBackend, str], gateway_factory: GatewayFactory
) -> None:
    _, url = stub_backend
    gw = await gateway_factory(config(url, [{"cost": 5, "window": "day"}]))
    r = await post(gw)
    assert r.status_code == 403 and r.json()["error"]["code"] == "model_not_priced"
    assert "models.<glob>.price" in r.json()["error"]["message"]


async def test_a_request_bigger_than_the_whole_quota_is_413(
    stub_backend: tuple[StubBackend, str], gateway_factory: GatewayFactory
) -> None:
    _, url = stub_backend
    gw = await gateway_factory(config(url, [{"tokens": 50, "window": "day"}]))
    r = await post(gw, max_tokens=100)
    assert r.status_code == 413 and r.json()["error"]["code"] == "cost_exceeds_quota"
    assert "retry-after" not in r.headers


async def test_model_scoped_quotas_apply_to_their_models_only(
    stub_backend: tuple[StubBackend, str], gateway_factory: GatewayFactory
) -> None:
    _, url = stub_backend
    gw = await gateway_factory(config(url, [{"tokens": 10, "window": "day", "models": ["other-*"]}]))
    assert (await post(gw)).status_code == 200
    assert "x-ratelimit-limit-tokens" not in (await post(gw)).headers


async def test_the_official_sdk_reads_the_headers(
    stub_backend: tuple[StubBackend, str], gateway_factory: GatewayFactory
) -> None:
    _, url = stub_backend
    gw = await gateway_factory(
        config(url, [{"tokens": 5000, "window": "minute"}, {"tokens": 10**6, "window": "day"}])
    )
    client = openai.AsyncOpenAI(api_key=KEY, base_url=f"{gw.url}/v1", max_retries=0)
    raw = await client.chat.completions.with_raw_response.create(
        model="stub-model", messages=[{"role": "user", "content": "hello"}], max_tokens=10
    )
    assert raw.headers["x-ratelimit-limit-tokens"] == "5000"  # the tightest of the two
    assert int(raw.headers["x-ratelimit-remaining-tokens"]) < 5000
    assert raw.parse().usage is not None
    await client.close()


async def test_admin_sets_quotas_live_and_reads_their_usage(
    stub_backend: tuple[StubBackend, str], gateway_factory: GatewayFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TOKENGATE_ADMIN_TOKEN", ADMIN)
    _, url = stub_backend
    gw = await gateway_factory(config(url, []))
    assert (await post(gw)).status_code == 200
    admin = {"authorization": f"Bearer {ADMIN}"}
    async with httpx.AsyncClient(base_url=gw.ops_url, headers=admin) as c:
        r = await c.patch(
            "/admin/v1/tenants/acme", json={"quotas": [{"name": "daily", "tokens": 20, "window": "day"}]}
        )
        assert r.status_code == 200, r.text
        assert r.json()["quotas"] == [{"name": "daily", "tokens": 20, "window": "day"}]
        assert (await post(gw, max_tokens=5)).status_code == 200
        refused = await post(gw, max_tokens=5)
        assert refused.status_code == 429
        view = (await c.get("/admin/v1/tenants/acme/quotas")).json()["quotas"]
        assert view[0]["name"] == "daily" and view[0]["used"] == PROMPT + CHUNKS and view[0]["remaining"] == 6
        bad = await c.patch("/admin/v1/tenants/acme", json={"quotas": [{"tokens": 5, "window": "fortnight"}]})
        assert bad.status_code == 400 and "tenants.acme.quotas[0].window" in bad.json()["error"]["message"]


@pytest.mark.parametrize(
    ("quota", "message"),
    [
        ({"window": "day"}, "tenants.acme.quotas[0]: give exactly one of tokens"),
        ({"tokens": 5, "cost": 1, "window": "day"}, "give exactly one of tokens"),
        ({"tokens": 0, "window": "day"}, "tenants.acme.quotas[0].tokens: expected a positive integer"),
        ({"tokens": 5, "window": "day", "timezone": "Mars/Olympus"}, "quotas[0].timezone: unknown time zone"),
        ({"tokens": 5, "window": "day", "reset": "25:00"}, "quotas[0].reset: expected a local time HH:MM"),
        ({"tokens": 5, "window": "hour", "reset": "06:00"}, "only fixed day, week and month windows"),
        ({"tokens": 5, "window": "day", "colour": "red"}, "colour"),
        ({"requests": 1.5, "window": "day"}, "quotas[0].requests: expected a positive integer"),
        ({"requests": 5, "tokens": 5, "window": "day"}, "give exactly one of tokens"),
        ({"requests": 5, "window": "day", "per": "team"}, "quotas[0].per: expected one of 'tenant', 'key'"),
    ],
)
def test_config_errors_name_the_field(quota: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]")):
        parse_config(
            {
                "pools": stub_pools("http://127.0.0.1:1"),
                "tenants": {"acme": {"keys": [KEY], "quotas": [quota]}},
            }
        )


def test_two_quotas_with_one_name_are_refused() -> None:
    with pytest.raises(ConfigError, match="name of another quota"):
        parse_config(
            {
                "pools": stub_pools("http://127.0.0.1:1"),
                "tenants": {
                    "acme": {"quotas": [{"tokens": 5, "window": "day"}, {"tokens": 9, "window": "day"}]}
                },
            }
        )


async def test_the_engines_slot_share_is_not_charged_to_a_quota(
    stub_backend: tuple[StubBackend, str], gateway_factory: GatewayFactory
) -> None:
    """With max_num_seqs a request holds its share of the engine's KV room in the pools (here
    50,000 tokens); its quota is charged what it asked for, not that share."""
    _, url = stub_backend
    cfg = config(url, [{"tokens": 1000, "window": "day"}])
    cfg["pools"] = stub_pools(url, max_num_seqs=2)
    cfg["tenants"]["acme"]["tier"] = "critical"
    gw = await gateway_factory(cfg)
    r = await post(gw, max_tokens=20)
    assert r.status_code == 200, r.text
    assert int(r.headers["x-tokengate-cost"]) > 1000  # the pools held the slot share
    assert 1000 - 40 < int(r.headers["x-ratelimit-remaining-tokens"]) < 1000 - 20
    assert await settled(gw) == [(PROMPT + CHUNKS, 0)]


async def test_request_quotas_count_requests_that_ran_and_send_their_headers(
    stub_backend: tuple[StubBackend, str], gateway_factory: GatewayFactory
) -> None:
    _, url = stub_backend
    gw = await gateway_factory(
        config(url, [{"requests": 3, "window": "minute"}, {"tokens": 10**6, "window": "day"}])
    )
    first = await post(gw)
    assert first.headers["x-ratelimit-limit-requests"] == "3"
    assert first.headers["x-ratelimit-remaining-requests"] == "2"
    assert first.headers["x-ratelimit-limit-tokens"] == str(10**6)  # both kinds of header
    assert (await post(gw, **{"x-stub-status": "500"})).status_code == 502  # it ran: it counts
    assert (await post(gw)).status_code == 200
    refused = await post(gw)
    assert refused.status_code == 429 and "3 requests" in refused.json()["error"]["message"]
    assert refused.headers["x-ratelimit-remaining-requests"] == "0"
    assert (await settled(gw))[0] == (3, 0)


async def test_per_key_quotas_give_each_key_its_own_window(
    stub_backend: tuple[StubBackend, str], gateway_factory: GatewayFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TOKENGATE_ADMIN_TOKEN", ADMIN)
    _, url = stub_backend
    cfg = config(url, [{"name": "trial", "requests": 1, "window": "day", "per": "key"}])
    cfg["tenants"]["acme"]["keys"] = [KEY, "sk-second"]
    gw = await gateway_factory(cfg)
    assert (await post(gw)).status_code == 200
    assert (await post(gw)).status_code == 429  # this key's one request is used
    async with httpx.AsyncClient(base_url=gw.url) as c:
        other = await c.post(
            "/v1/chat/completions", json=chat(max_tokens=5), headers={"authorization": "Bearer sk-second"}
        )
    assert other.status_code == 200  # the other key's window is its own
    async with httpx.AsyncClient(base_url=gw.ops_url, headers={"authorization": f"Bearer {ADMIN}"}) as c:
        view = (await c.get("/admin/v1/tenants/acme/quotas")).json()["quotas"]
    assert sorted((row["name"], row["used"]) for row in view) == [("trial", 1), ("trial", 1)]
    assert all(row["key"].startswith("sha256:") and KEY not in row["key"] for row in view)
    # a reset of one key's window (by the id the view shows) leaves the other's
    first = next(row["key"] for row in view)
    async with httpx.AsyncClient(base_url=gw.ops_url, headers={"authorization": f"Bearer {ADMIN}"}) as c:
        r = await c.post("/admin/v1/tenants/acme/quotas/trial/reset", params={"key": first})
        assert r.status_code == 200 and r.json() == {
            "tenant": "acme",
            "reset": "trial",
            "forgotten": 1,
            "unit": "requests",
        }
        view = (await c.get("/admin/v1/tenants/acme/quotas")).json()["quotas"]
        assert sorted((row["key"] == first, row["used"]) for row in view) == [(False, 1), (True, 0)]
        unknown = await c.post("/admin/v1/tenants/acme/quotas/trial/reset", params={"key": "key-nope"})
        assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "key_not_found"
        r = await c.post("/admin/v1/tenants/acme/quotas/trial/reset")  # every key's
        assert r.status_code == 200 and r.json()["forgotten"] == 1


async def test_admin_prices_a_model_live_for_cost_quotas(
    stub_backend: tuple[StubBackend, str], gateway_factory: GatewayFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TOKENGATE_ADMIN_TOKEN", ADMIN)
    _, url = stub_backend
    cfg = config(url, [{"cost": 1, "window": "day"}])
    cfg["models"] = {"stub-*": {"context_length": 4096}, "other-*": {"price": {"input": 1, "output": 1}}}
    gw = await gateway_factory(cfg)
    assert (await post(gw)).status_code == 403  # unpriced
    async with httpx.AsyncClient(base_url=gw.ops_url, headers={"authorization": f"Bearer {ADMIN}"}) as c:
        shadowed = await c.put("/admin/v1/prices", json={"model": "stub-model", "input": 1, "output": 1})
        assert shadowed.status_code == 400 and "'stub-*' comes first" in shadowed.json()["error"]["message"]
        bad = await c.put("/admin/v1/prices", json={"model": "stub-*", "input": -1, "output": 1})
        assert bad.status_code == 400 and "models.stub-*.price.input" in bad.json()["error"]["message"]
        r = await c.put("/admin/v1/prices", json={"model": "stub-*", "input": 1000, "output": 10_000})
        assert r.status_code == 200, r.text
        rows = {row["model"]: row for row in r.json()["prices"]}
        assert rows["stub-*"]["price"] == {"input": 1000, "output": 10_000, "cached_input": 1000}
        assert rows["stub-*"]["source"] == "admin (over the file)"
        assert (await post(gw, max_tokens=5)).status_code == 200
        assert (await settled(gw)) == [(41_000, 0)]  # 11 prompt at 1000/1M + 3 output at 10,000/1M
        r = await c.delete("/admin/v1/prices", params={"model": "stub-*"})
        assert r.status_code == 200
        assert gw.app.live.current.config.models[0].context_length == 4096  # the rest of the entry kept
        assert (await post(gw)).status_code == 403
        missing = await c.delete("/admin/v1/prices", params={"model": "stub-*"})
        assert missing.status_code == 404 and missing.json()["error"]["code"] == "price_not_found"

"""Reservations: what a request holds for its output — its limit, a fixed number, or a learned
estimate — per pool and class, with KV feedback, while the backend is still told the full limit."""

from __future__ import annotations

from typing import Any

import httpx

from classifiers import Cost
from classifiers.reservation import ReservationSettings
from gateway.request.reservations import ReservationConfig, Reservations
from tests.conftest import GatewayFactory, RunningGateway, StubBackend, stub_pools
from tests.gateway.gw_support import chat
from tests.support import eventually


async def post(gw: RunningGateway, **extra: Any) -> httpx.Response:
    async with httpx.AsyncClient(base_url=gw.url) as c:
        headers = {"x-stub-chunks": "3", **extra.pop("headers", {})}
        r = await c.post("/v1/chat/completions", json=chat(max_tokens=4000, **extra), headers=headers)
        assert r.status_code == 200
        return r


async def flight_at_least(gw: RunningGateway, tokens: int) -> bool:
    return (await gw.in_flight())["backend:default"] >= tokens


def reserved(r: httpx.Response, prefill: int) -> int:
    return int(r.headers["x-tokengate-cost"]) - prefill


async def test_by_default_a_request_reserves_its_limit(
    stub_backend: tuple[StubBackend, str], gateway_factory: GatewayFactory
) -> None:
    _, url = stub_backend
    gw = await gateway_factory({"pools": stub_pools(url)})
    r = await post(gw)
    assert int(r.headers["x-tokengate-cost"]) > 4000


async def test_a_learned_reservation_shrinks_to_what_the_answers_really_use(
    stub_backend: tuple[StubBackend, str], gateway_factory: GatewayFactory
) -> None:
    stub, url = stub_backend
    gw = await gateway_factory(
        {"pools": stub_pools(url), "reservation": {"mode": "learned", "min_samples": 5}}
    )
    first = await post(gw)
    prefill = int(first.headers["x-tokengate-cost"]) - 4000  # cold start: the limit
    for _ in range(5):  # each answer reports 3 completion tokens
        await post(gw)
    learned = await post(gw)
    assert reserved(learned, prefill) == 3  # the bin holding 3
    assert stub.requests[-1].body["max_tokens"] == 4000  # the backend is still told the limit
    assert await gw.wait_idle() == {name: 0 for name in await gw.in_flight()}
    async with httpx.AsyncClient() as c:
        metrics = (await c.get(gw.ops_url + "/metrics")).text
    assert 'tokengate_reservation_ratio_count{class="default",tenant="default"}' in metrics


async def test_pools_and_classes_override_the_mode(
    stub_backend: tuple[StubBackend, str], gateway_factory: GatewayFactory
) -> None:
    _, url = stub_backend
    pools = stub_pools(url)
    pools["default"]["reservation"] = {"mode": "fixed", "fixed_tokens": 200}
    gw = await gateway_factory(
        {
            "pools": pools,
            "classes": [
                {
                    "name": "big",
                    "when": {"min_prompt_tokens": 1000},
                    "pool": "default",
                    "reservation": {"mode": "max_tokens"},
                },
                {"name": "small", "pool": "default"},
            ],
        }
    )
    small = await post(gw)
    assert (
        small.headers["x-tokengate-class"] == "small"
        and reserved(small, int(small.headers["x-tokengate-cost"]) - 200) == 200
    )
    big = await post(gw, messages=[{"role": "user", "content": "word " * 1200}])
    assert big.headers["x-tokengate-class"] == "big" and int(big.headers["x-tokengate-cost"]) > 5000


async def test_the_oracle_header_counts_only_when_the_benchmark_switch_is_on(
    stub_backend: tuple[StubBackend, str], gateway_factory: GatewayFactory
) -> None:
    _, url = stub_backend
    off = await gateway_factory({"pools": stub_pools(url)})
    on = await gateway_factory({"pools": stub_pools(url), "reservation": {"oracle_header": True}})
    oracle = {"headers": {"x-tokengate-oracle-output": "42"}}
    r_off, r_on = await post(off, **oracle), await post(on, **oracle)
    prefill = int(r_on.headers["x-tokengate-cost"]) - 42
    assert reserved(r_on, prefill) == 42 and reserved(r_off, prefill) == 4000


def test_kv_feedback_reserves_the_limit_from_the_high_watermark_until_the_low_one() -> None:
    usage: dict[str, float | None] = {"p": 0.5}
    res = Reservations(
        ReservationConfig(ReservationSettings(mode="fixed", fixed_tokens=100), kv_high=0.9, kv_low=0.7),
        {},
        {},
        lambda pool: usage[pool],
    )
    cost = Cost(10, 1000, per_choice=1000)

    def held() -> int:
        return res.reserve(cost=cost, tenant="t", model="m", klass="c", pool="p").decode

    assert held() == 100
    usage["p"] = 0.95
    assert held() == 1000 and res.tight_pools() == ["p"]
    usage["p"] = 0.8  # below high, not yet below low: still tight
    assert held() == 1000
    usage["p"] = None  # no fresh reading: keep the last decision
    assert held() == 1000
    usage["p"] = 0.6
    assert held() == 100 and res.tight_pools() == []


async def learned_gateway(
    gateway_factory: GatewayFactory, url: str, capacity: int = 100_000
) -> RunningGateway:
    gw = await gateway_factory(
        {
            "pools": stub_pools(url, capacity=capacity),
            "reservation": {"mode": "learned", "min_samples": 3, "grow_factor": 2},
        }
    )
    for _ in range(4):  # teach it that answers are 3 tokens long (weight decays: one more than needed)
        await post(gw)
    return gw


async def test_a_stream_that_outgrows_its_reservation_grows_its_lease_and_the_books_still_close(
    stub_backend: tuple[StubBackend, str], gateway_factory: GatewayFactory, caplog: Any
) -> None:
    import logging

    _, url = stub_backend
    gw = await learned_gateway(gateway_factory, url)
    caplog.set_level(logging.INFO, logger="tokengate.access")
    async with httpx.AsyncClient(base_url=gw.url) as c:
        r = await c.post(
            "/v1/chat/completions",
            json=chat(max_tokens=4000, stream=True),
            headers={"x-stub-chunks": "40", "x-stub-interval": "0.005"},
        )
    assert r.status_code == 200 and r.text.count("tok") >= 40
    line = [rec.getMessage() for rec in caplog.records if rec.name == "tokengate.access"][-1]
    assert '"extended":null' not in line and '"overdraft":null' in line  # grew in steps, always within room
    assert await gw.wait_idle() == {name: 0 for name in await gw.in_flight()}
    async with httpx.AsyncClient() as c:
        metrics = (await c.get(gw.ops_url + "/metrics")).text
    assert 'tokengate_lease_extensions_total{class="default"}' in metrics


async def test_growth_past_the_pool_is_an_overdraft_and_new_requests_wait_until_it_is_paid_back(
    stub_backend: tuple[StubBackend, str], gateway_factory: GatewayFactory, caplog: Any
) -> None:
    import asyncio
    import logging

    _, url = stub_backend
    gw = await gateway_factory(
        {
            "pools": stub_pools(url, capacity=4500),  # the standard tier may fill 90 %: 4050
            "reservation": {"mode": "learned", "min_samples": 3},
            "classes": [
                {
                    "name": "holder",
                    "when": {"user": ["holder"]},
                    "pool": "default",
                    "reservation": {"mode": "max_tokens"},
                },
                {"name": "chat", "pool": "default"},
            ],
        }
    )
    for _ in range(4):
        await post(gw)  # chat answers are 3 tokens long
    caplog.set_level(logging.INFO, logger="tokengate.access")
    async with httpx.AsyncClient(base_url=gw.url, timeout=30) as c:
        holder = asyncio.create_task(
            c.post(
                "/v1/chat/completions",
                json=chat(max_tokens=3900, user="holder"),
                # Long enough that the stream below grows past the pool while it still holds, even
                # on a loaded machine where relaying 400 chunks takes several seconds.
                headers={"x-stub-delay": "6"},
            )
        )
        await eventually(lambda: flight_at_least(gw, 3900), timeout_s=5)
        long = asyncio.create_task(
            c.post(
                "/v1/chat/completions",
                json=chat(max_tokens=4000, stream=True),
                headers={"x-stub-chunks": "800", "x-stub-interval": "0.004"},
            )
        )
        await eventually(lambda: flight_at_least(gw, 4501), timeout_s=5)  # grown past the pool's capacity
        small = asyncio.create_task(post(gw))  # 11 tokens: it fitted before the overdraft

        async def queued() -> bool:
            return (await gw.store.snapshot()).queue_depth["standard"] == 1

        await eventually(queued)  # it waits: the pool is overdrawn
        assert not small.done()
        assert (await long).status_code == 200 and (await holder).status_code == 200
        assert (await small).status_code == 200  # admitted once the overdraft was paid back
    line = next(
        r.getMessage()
        for r in caplog.records
        if r.name == "tokengate.access" and '"stream":true' in r.getMessage()
    )
    assert '"overdraft":null' not in line
    assert await gw.wait_idle() == {name: 0 for name in await gw.in_flight()}


async def test_stats_show_how_well_reservations_fit_and_the_capacity_they_hold_beside_what_is_used(
    stub_backend: tuple[StubBackend, str], gateway_factory: GatewayFactory
) -> None:
    import asyncio

    _, url = stub_backend
    gw = await learned_gateway(gateway_factory, url)  # answers are 3 tokens long: 3 are reserved
    for _ in range(16):  # 20 answers of 3 tokens: one longer answer leaves the p95 where it is
        await post(gw)
    await post(gw, headers={"x-stub-chunks": "40"})  # not streamed: settled at release, 37 overdrawn
    async with httpx.AsyncClient(base_url=gw.url, timeout=30) as c, httpx.AsyncClient() as ops:
        grown = await c.post(
            "/v1/chat/completions",
            json=chat(max_tokens=4000, stream=True),
            headers={"x-stub-chunks": "40", "x-stub-interval": "0.005"},
        )  # streamed: its lease grows instead
        assert grown.status_code == 200
        # A longer prompt is another key, not learned yet: it reserves its limit while it waits.
        cold = asyncio.create_task(
            c.post(
                "/v1/chat/completions",
                json=chat("word " * 400, max_tokens=4000, stream=True),
                headers={"x-stub-chunks": "2", "x-stub-delay": "2"},
            )
        )
        await eventually(lambda: flight_at_least(gw, 4000))
        during = (await ops.get(gw.ops_url + "/stats")).json()["reservations"]
        (pool,) = during["pools"]
        assert pool["pool"] == "default" and pool["capacity"] == 100_000
        assert pool["reserved"] - pool["used"] == 4000  # nothing streamed yet: only the prompt is used
        assert pool["reserved_share"] > pool["used_share"] > 0
        assert (await cold).status_code == 200
        await gw.wait_idle()
        st = (await ops.get(gw.ops_url + "/stats")).json()["reservations"]
        metrics = (await ops.get(gw.ops_url + "/metrics")).text
    (row,) = st["classes"]
    assert (row["class"], row["tenant"], row["requests"]) == ("default", "default", 20 + 1 + 1 + 1)
    assert sum(b["count"] for b in row["histogram"]) == row["requests"]
    assert row["histogram"][-1] == {"le": None, "count": 2}  # 40 tokens on 3 reserved: above every edge
    assert (row["overdrafts"], row["overdraft_tokens"]) == (1, 37)
    assert 'tokengate_overdraft_tokens_total{class="default",tenant="default"} 37.0' in metrics
    # Most answers used exactly what was learned; the five cold ones (the four that taught it, the
    # long prompt) used a sliver of their limit.
    assert row["ratio_p50_le"] == row["ratio_p90_le"] == 1.0 and row["histogram"][0]["count"] == 5
    assert st["extensions"]["default"] >= 1
    assert st["pools"][0]["reserved"] == st["pools"][0]["used"] == 0 and st["tight_pools"] == []
    learned = {x["prompt_bucket"]: x for x in st["learned"]}
    assert set(learned) == {0, 1}  # the short prompts' key and the long prompt's
    assert learned[0]["weight"] > 20 and learned[0]["estimate"] >= 40  # two 40-token answers: above p95

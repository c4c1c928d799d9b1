"""Reservations: what a request holds for its output — its limit, a fixed number, or a learned
estimate — per pool and class, with KV feedback, while the backend is still told the full limit."""

from __future__ import annotations

from typing import Any

import httpx

from classifiers import Cost
from classifiers.reservation import ReservationSettings
from gateway.reservations import ReservationConfig, Reservations
from tests.conftest import GatewayFactory, RunningGateway, StubBackend, stub_pools
from tests.gateway.gw_support import chat


async def post(gw: RunningGateway, **extra: Any) -> httpx.Response:
    async with httpx.AsyncClient(base_url=gw.url) as c:
        headers = {"x-stub-chunks": "3", **extra.pop("headers", {})}
        r = await c.post("/v1/chat/completions", json=chat(max_tokens=4000, **extra), headers=headers)
        assert r.status_code == 200
        return r


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

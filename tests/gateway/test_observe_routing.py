"""Routing consults the scraped backend load: saturated or stale backends lose, penalties discount."""

from __future__ import annotations

from gateway.observe.scrape import BackendLoad, parse_engine_metrics
from gateway.observe.settings import ScrapeSettings
from gateway.upstream.pools import BackendPool, BackendPoolSpec, BackendSpec, BreakerSettings, Router
from tests.gateway.gw_support import Clock


def _pool() -> BackendPool:
    spec = BackendPoolSpec(
        "p",
        (
            BackendSpec("http://127.0.0.1:18001", 100_000),
            BackendSpec("http://127.0.0.1:18002", 100_000),
        ),
    )
    return Router([spec], BreakerSettings()).pools["p"]


def _load(clock: Clock, text: str | None) -> BackendLoad:
    ld = BackendLoad(
        "p", "b", "u", ScrapeSettings(stale_after_s=15, kv_soft=0.8, kv_threshold=0.95), clock=clock
    )
    if text is not None:
        ld.update(parse_engine_metrics(text))
    return ld


def test_free_tokens_alone_without_loads() -> None:
    pool = _pool()
    a, b = pool.backends
    a.in_flight_tokens = 10_000
    assert pool.pick(None) is b


def test_saturated_backend_loses_even_with_more_free_tokens() -> None:
    clock = Clock()
    pool = _pool()
    a, b = pool.backends
    b.in_flight_tokens = 60_000  # a has far more free tokens by the gateway's own count...
    a.load = _load(clock, "vllm:kv_cache_usage_perc 0.97\n")  # ...but its engine's KV is full
    b.load = _load(clock, "vllm:kv_cache_usage_perc 0.30\n")
    assert pool.pick(None) is b


def test_penalty_discounts_free_tokens() -> None:
    clock = Clock()
    pool = _pool()
    a, b = pool.backends
    b.in_flight_tokens = 20_000  # 80k free vs 100k free
    a.load = _load(clock, "vllm:kv_cache_usage_perc 0.93\n")  # penalty ~0.43: 100k -> ~57k
    b.load = _load(clock, "vllm:kv_cache_usage_perc 0.10\n")
    assert pool.pick(None) is b
    a.load = _load(clock, "vllm:kv_cache_usage_perc 0.82\n")  # penalty ~0.07: 100k -> ~93k
    assert pool.pick(None) is a


def test_stale_metrics_count_as_saturated_and_all_saturated_still_routes() -> None:
    clock = Clock()
    pool = _pool()
    a, b = pool.backends
    a.load = _load(clock, "vllm:kv_cache_usage_perc 0.10\n")
    b.load = _load(clock, "vllm:kv_cache_usage_perc 0.10\n")
    b.in_flight_tokens = 1
    assert pool.pick(None) is a
    clock.t = 20  # neither scraped for 20 s: both presumed saturated, none idle
    a.in_flight_tokens = 5
    assert a.load.saturated and b.load.saturated
    assert pool.pick(None) is not None  # still routes rather than refusing
    b.load.update(parse_engine_metrics("vllm:kv_cache_usage_perc 0.5\n"))  # b answers again
    a.in_flight_tokens = 0
    b.in_flight_tokens = 50_000
    assert pool.pick(None) is b

"""Backend load scraping: engine name parsing, penalties, staleness, and a real HTTP scrape."""

from __future__ import annotations

import pytest
from aiohttp import web
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from gateway.observe.scrape import (
    BackendLoad,
    BackendLoadCollector,
    BackendLoads,
    BackendScraper,
    ScrapeTarget,
    parse_engine_metrics,
)
from gateway.observe.settings import ScrapeSettings
from loadtest.processes import free_port
from tests.gateway.gw_support import Clock
from tests.support import eventually

VLLM = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="llama"} 7.0
vllm:num_requests_running{engine="1",model_name="llama"} 5.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="llama"} 3.0
vllm:num_requests_waiting{engine="1",model_name="llama"} 0.0
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="llama"} 0.42
vllm:kv_cache_usage_perc{engine="1",model_name="llama"} 0.91
# TYPE vllm:num_preemptions counter
vllm:num_preemptions_total{engine="0",model_name="llama"} 10.0
vllm:num_preemptions_created{engine="0",model_name="llama"} 1.7e9
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.1",model_name="llama"} 4.0
vllm:time_to_first_token_seconds_count{engine="0",model_name="llama"} 9.0
"""

SGLANG_OLD = """\
sglang:num_used_tokens{name="m"} 3000
sglang:max_total_num_tokens{name="m"} 4000
sglang:num_running_reqs{name="m"} 2
sglang:num_queue_reqs{name="m"} 6
sglang:num_retracted_requests_total{name="m"} 4
"""

TGI = """\
# TYPE tgi_queue_size gauge
tgi_queue_size 12
tgi_batch_current_size 8
tgi_batch_current_max_tokens 30000
"""


def test_parse_vllm_sums_engines_and_takes_the_fullest_kv() -> None:
    s = parse_engine_metrics(VLLM)
    assert s.flavor == "vllm"
    assert s.running == 12.0
    assert s.waiting == 3.0
    assert s.kv_usage == pytest.approx(0.91)
    assert s.preemptions_total == 10.0


def test_parse_vllm_deprecated_kv_name_and_nan() -> None:
    s = parse_engine_metrics('vllm:gpu_cache_usage_perc{model_name="m"} 0.5\nvllm:num_requests_running NaN\n')
    assert s.kv_usage == 0.5
    assert s.running is None


def test_parse_sglang_derives_kv_from_token_counts() -> None:
    s = parse_engine_metrics(SGLANG_OLD)
    assert s.flavor == "sglang"
    assert s.kv_usage == pytest.approx(0.75)
    assert (s.running, s.waiting, s.preemptions_total) == (2.0, 6.0, 4.0)
    assert parse_engine_metrics('sglang:token_usage{name="m"} 0.33\n').kv_usage == pytest.approx(0.33)


def test_parse_tgi_has_no_kv_but_capacity_gives_an_estimate() -> None:
    s = parse_engine_metrics(TGI)
    assert s.flavor == "tgi"
    assert (s.kv_usage, s.running, s.waiting, s.preemptions_total) == (None, 8.0, 12.0, None)
    load = BackendLoad("p", "http://b", "http://b/metrics", ScrapeSettings(), capacity_tokens=40000)
    load.update(s)
    assert load.kv_usage == pytest.approx(0.75)


def test_parse_unknown_text() -> None:
    assert parse_engine_metrics("python_gc_objects_collected_total 3\n").flavor == "unknown"
    assert parse_engine_metrics("").flavor == "unknown"


def _sample(kv: float | None = 0.1, waiting: float = 0, preempt: float | None = 0.0) -> str:
    lines = [f"vllm:num_requests_running 4\nvllm:num_requests_waiting {waiting}"]
    if kv is not None:
        lines.append(f"vllm:kv_cache_usage_perc {kv}")
    if preempt is not None:
        lines.append(f"vllm:num_preemptions_total {preempt}")
    return "\n".join(lines) + "\n"


def test_penalty_ramps_with_kv_and_saturates_at_threshold() -> None:
    clock = Clock(1000.0)
    st = ScrapeSettings(kv_soft=0.8, kv_threshold=0.95, stale_after_s=15)
    load = BackendLoad("p", "http://b", "http://b/metrics", st, clock=clock)
    load.update(parse_engine_metrics(_sample(kv=0.5)))
    assert load.penalty() == 0.0 and not load.saturated
    load.update(parse_engine_metrics(_sample(kv=0.9)))
    mid = load.penalty()
    assert 0.0 < mid < 1.0 and not load.saturated
    load.update(parse_engine_metrics(_sample(kv=0.96)))
    assert load.saturated and load.penalty() == 1.0
    assert "KV cache 96%" in load.reason


def test_waiting_requests_nudge_but_do_not_saturate() -> None:
    load = BackendLoad("p", "http://b", "u", ScrapeSettings(), clock=Clock(1000.0))
    load.update(parse_engine_metrics(_sample(kv=0.1, waiting=10)))
    assert 0.0 < load.penalty() <= 0.5
    assert not load.saturated


def test_preemption_thrash_from_counter_deltas_and_restart() -> None:
    clock = Clock(1000.0)
    load = BackendLoad("p", "http://b", "u", ScrapeSettings(thrash_preemptions_per_s=1.0), clock=clock)
    load.update(parse_engine_metrics(_sample(preempt=100)))
    assert load.preemption_rate == 0.0
    clock.t += 5
    load.update(parse_engine_metrics(_sample(preempt=102)))  # 0.4/s: penalised, not thrashing
    assert load.preemption_rate == pytest.approx(0.4)
    assert 0.0 < load.penalty() < 1.0 and not load.thrashing
    clock.t += 5
    load.update(parse_engine_metrics(_sample(preempt=130)))  # 5.6/s: thrash
    assert load.thrashing and load.saturated and load.penalty() == 1.0
    clock.t += 5
    load.update(parse_engine_metrics(_sample(preempt=1)))  # engine restarted: counter reset
    assert load.preemption_rate == pytest.approx(0.2)
    assert not load.thrashing


def test_stale_metrics_mean_saturated_not_idle() -> None:
    clock = Clock(1000.0)
    load = BackendLoad("p", "http://b", "u", ScrapeSettings(stale_after_s=15), clock=clock)
    assert not load.stale  # just created: not judged yet
    clock.t += 16
    assert load.stale and load.saturated  # never answered
    load.update(parse_engine_metrics(_sample(kv=0.05)))
    assert not load.stale and load.penalty() == 0.0
    clock.t += 10
    load.mark_error("ConnectError")
    assert not load.stale  # one failure inside the window: last good numbers still stand
    clock.t += 6
    assert load.stale and load.saturated and load.penalty() == 1.0
    assert "stale" in load.reason and "ConnectError" in load.reason


def test_no_metrics_endpoint_is_not_penalised() -> None:
    clock = Clock(1000.0)
    load = BackendLoad("p", "http://b", "u", ScrapeSettings(stale_after_s=1), clock=clock)
    load.mark_no_metrics()
    clock.t += 100
    assert not load.stale and not load.saturated and load.penalty() == 0.0


async def test_scraper_over_real_http_and_collector_export() -> None:
    body = {"text": _sample(kv=0.5, waiting=2, preempt=3)}

    async def metrics(request: web.Request) -> web.Response:
        return web.Response(text=body["text"], content_type="text/plain")

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens here
    try:
        live = f"http://127.0.0.1:{port}"
        no_metrics = f"http://127.0.0.1:{port}/nothing"  # 404 on /nothing/metrics
        loads = BackendLoads(
            [
                ScrapeTarget("short", live),
                ScrapeTarget("short", no_metrics),
                ScrapeTarget("long", dead),
            ],
            ScrapeSettings(timeout_s=1.0),
        )
        scraper = BackendScraper(loads)
        await scraper.scrape_all()
        ok, nm, bad = loads.get(live), loads.get(no_metrics), loads.get(dead)
        assert ok is not None and nm is not None and bad is not None
        assert ok.kv_usage == 0.5 and ok.sample is not None and ok.sample.waiting == 2
        assert nm.no_metrics and nm.penalty() == 0.0
        assert bad.errors_total == 1 and bad.last_error

        body["text"] = _sample(kv=0.97, waiting=2, preempt=3)
        await scraper.scrape_all()
        assert ok.saturated and loads.penalty(live) == 1.0
        assert loads.penalty("http://unknown") == 0.0

        reg = CollectorRegistry()
        reg.register(BackendLoadCollector(loads))
        text = generate_latest(reg).decode()
        fams = {f.name: f for f in text_string_to_metric_families(text)}
        kv = {s.labels["backend"]: s.value for s in fams["tokengate_backend_kv_usage"].samples}
        assert kv == {live: 0.97}
        sat = {s.labels["backend"]: s.value for s in fams["tokengate_backend_saturated"].samples}
        assert sat[live] == 1.0 and sat[no_metrics] == 0.0
        errs = {s.labels["backend"]: s.value for s in fams["tokengate_backend_scrape_errors"].samples}
        assert errs[dead] == 2.0
    finally:
        await runner.cleanup()


async def test_scraper_background_loop_starts_and_stops() -> None:
    loads = BackendLoads(
        [ScrapeTarget("p", f"http://127.0.0.1:{free_port()}")], ScrapeSettings(interval_s=0.05)
    )
    scraper = BackendScraper(loads)
    await scraper.start()
    try:
        await eventually(lambda: next(iter(loads)).errors_total >= 2)
    finally:
        await scraper.close()

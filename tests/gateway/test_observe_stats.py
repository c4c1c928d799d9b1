"""/stats, /insights and /dashboard over a real socket, diagnosis in words, and `tokengate doctor`."""

from __future__ import annotations

import argparse
import asyncio
import io
import random
from contextlib import redirect_stdout

import httpx
import pytest
import yaml
from starlette.applications import Starlette

from budgets.types import PoolState, StoreSnapshot
from gateway.observe import ConfigView, Observer, ObserveSettings, StatsSources, doctor, observe_routes
from gateway.observe.diagnose import diagnose
from gateway.observe.scrape import ScrapeTarget, parse_engine_metrics
from tests.conftest import GatewayFactory, StubBackend, serve_asgi, stub_pools
from tests.gateway.gw_support import Clock, chat

SETTINGS = ObserveSettings.from_dict(
    {
        "window_s": 1,
        "hol": {"lookback_windows": 10, "min_windows": 5, "threshold": 0.7},
        "shape": {"min_requests": 20},
        "slos": {"short": {"ttft_p99_s": 0.2, "queue_wait_p99_s": 0.1}},
    }
)
VIEW = ConfigView(
    classes=[
        {"name": "long", "when": {"min_prompt_tokens": 8000}, "pool": "shared"},
        {"name": "short", "pool": "shared"},
    ],
    pools={
        "shared": {
            "backends": [
                {"url": "http://127.0.0.1:18001", "capacity_tokens": 200000},
                {"url": "http://127.0.0.1:18002", "capacity_tokens": 200000},
            ]
        }
    },
)


def _noisy_observer(clock: Clock) -> Observer:
    """A shared pool where the short class slows down whenever long requests are in flight."""
    obs = Observer(
        SETTINGS,
        targets=[
            ScrapeTarget("shared", "http://127.0.0.1:18001"),
            ScrapeTarget("shared", "http://127.0.0.1:18002"),
        ],
        clock=clock,
    )
    rng = random.Random(7)
    for k in range(12):
        active = k % 4 >= 2
        base = 100.0 + k
        if active:
            clock.t = base + 0.01
            obs.on_admit("long", "shared", 30_000)
        for i in range(20):
            clock.t = base + 0.02 + i * 0.04
            obs.on_admit("short", "shared", 400)
            ttft = 0.03 + (0.5 * rng.random() if active else 0.01 * rng.random())
            # no e2e_s: counted in the window it is reported in (this fake clock never runs backwards)
            obs.on_done("short", 400, queue_wait_s=0.001, ttft_s=ttft, backend_s=ttft + 0.1)
        if active:
            clock.t = base + 0.95
            obs.on_done("long", 30_000, queue_wait_s=0.002, ttft_s=0.9, backend_s=2.0, e2e_s=2.0)
    clock.t = 113.0  # windows close one window late (they take late samples meanwhile)
    obs.refresh()
    a, b = obs.loads
    a.update(parse_engine_metrics("vllm:kv_cache_usage_perc 0.97\nvllm:num_requests_running 3\n"))
    b.update(parse_engine_metrics("vllm:kv_cache_usage_perc 0.2\nvllm:num_requests_running 1\n"))
    return obs


async def _snapshot() -> StoreSnapshot:
    return StoreSnapshot(
        pools={
            "backend:shared": PoolState("backend:shared", 400_000, 392_000, True),
            "tenant:acme": PoolState("tenant:acme", 64_000, 1_200, False),
            "tenant:noisy": PoolState("tenant:noisy", 64_000, 60_000, False),
        },
        queue_depth={"critical": 0, "batch": 3},
        tenant_queue_depth={"noisy": 3},
        virtual_service={"acme": 1200.0, "noisy": 90000.0},
        leases=4,
    )


async def test_stats_insights_dashboard_and_doctor_over_http() -> None:
    clock = Clock(100.0)
    obs = _noisy_observer(clock)
    src = StatsSources(obs, snapshot=_snapshot, config_view=lambda: VIEW)
    served = await serve_asgi(Starlette(routes=observe_routes(src)))
    try:
        async with httpx.AsyncClient(base_url=served.url) as c:
            st = (await c.get("/stats")).json()
            assert st["version"] == 1 and st["window_s"] == 1.0
            classes = {x["name"]: x for x in st["classes"]}
            assert set(classes) == {"short", "long"}
            assert classes["short"]["recent"]["ttft"]["p99"] > 0.2
            assert len(classes["short"]["series"]) == 12
            assert classes["short"]["series"][-1]["t"] <= 0
            (pair,) = st["hol"]["pairs"]
            assert (pair["victim"], pair["aggressor"]) == ("short", "long")
            assert pair["correlation"] > 0.7
            pools = {p["name"]: p for p in st["pools"]}
            assert pools["shared"]["utilisation"] == 0.98
            assert {t["name"]: t["queued"] for t in st["tenants"]} == {"acme": 0, "noisy": 3}
            assert st["queues"] == {"critical": 0, "batch": 3}
            assert [b["saturated"] for b in st["backends"]] == [True, False]
            (shape,) = st["shape"]
            assert shape["advice"] == 2 and shape["plan"]["moved_classes"] == ["long"]
            topics = {(f["level"], f["topic"]) for f in st["findings"]}
            assert {
                ("crit", "hol"),
                ("crit", "slo"),
                ("crit", "kv"),
                ("crit", "split"),
                ("warn", "queue"),
            } <= topics

            r = await c.get("/insights", params={"format": "yaml"})
            assert r.status_code == 200 and r.headers["content-type"].startswith("application/yaml")
            doc = yaml.safe_load(r.text)
            assert {x["name"]: x["pool"] for x in doc["classes"]} == {
                "long": "shared-long",
                "short": "shared",
            }
            assert (
                len(doc["pools"]["shared"]["backends"]) == 1
                and len(doc["pools"]["shared-long"]["backends"]) == 1
            )
            assert "largest/median request cost" in r.text
            ins = (await c.get("/insights")).json()
            assert ins["yaml"] == r.text and ins["shape"][0]["pool"] == "shared"

            page = await c.get("/dashboard")
            assert page.status_code == 200 and "<canvas" in page.text and "/dashboard/app.js" in page.text
            assert 'id="reservations"' in page.text and 'id="reservation-pools"' in page.text
            assert st["reservations"] is None  # this gateway supplied no reservation sources
            js = await c.get("/dashboard/app.js")
            assert js.status_code == 200 and 'fetch("/stats"' in js.text
            assert (await c.get("/dashboard/app.css")).status_code == 200
            missing = await c.get("/dashboard/nope.js")
            assert missing.status_code == 404 and missing.json()["error"]["type"] == "not_found"

        out = io.StringIO()
        args = argparse.Namespace(url=served.url, timeout=5.0, json=False)
        with redirect_stdout(out):
            rc = await asyncio.to_thread(doctor.run, args)
        text = out.getvalue()
        assert rc == 2  # something critical
        assert "head-of-line blocking: class short's p99 TTFT follows class long" in text
        assert "route class long to its own pool" in " ".join(text.split())
        assert "KV cache 97%" in text
        assert "two services in one pool" in text
        assert "short" in text.split("Diagnosis")[0]  # the per-class table comes first
    finally:
        await served.stop()


def test_doctor_unreachable_gateway_exits_3(capsys: object) -> None:
    from tests.conftest import free_port

    args = argparse.Namespace(url=f"http://127.0.0.1:{free_port()}", timeout=1.0, json=False)
    assert doctor.run(args) == 3


def test_diagnose_healthy_and_empty() -> None:
    assert [f.level for f in diagnose({})] == ["info"]  # no data yet, said so
    st = {
        "classes": [
            {
                "name": "short",
                "slo": {"ttft_p99_s": 1.0, "queue_wait_p99_s": None},
                "recent": {"ttft": {"p50": 0.05, "p99": 0.2}},
            }
        ],
        "hol": {
            "threshold": 0.7,
            "min_windows": 6,
            "pairs": [
                {
                    "victim": "short",
                    "aggressor": "long",
                    "correlation": 0.1,
                    "r_p99": 0.1,
                    "r_inflight": None,
                    "windows": 8,
                }
            ],
        },
        "backends": [{"backend": "b", "pool": "p", "kv_usage": 0.3, "stale": False, "saturated": False}],
        "shape": [{"pool": "p", "advice": 0}],
    }
    fs = diagnose(st)
    assert {f.level for f in fs} == {"ok"}
    assert any("no head-of-line fingerprint" in f.text for f in fs)


def test_an_engine_queueing_with_its_cache_half_empty_is_named_slot_bound() -> None:
    def backend(kv: float, waiting: int) -> dict[str, object]:
        return {
            "backend": "b",
            "pool": "p",
            "kv_usage": kv,
            "waiting": waiting,
            "stale": False,
            "saturated": False,
        }

    (f,) = [f for f in diagnose({"backends": [backend(0.2, 40)]}) if f.topic == "slots"]
    assert f.level == "warn" and "max_num_seqs" in f.text and "40 requests" in f.text
    # A few waiting for a step, or waiting because the cache is full, are not the slots' doing.
    for kv, waiting in ((0.2, 3), (0.7, 40)):
        assert all(f.topic != "slots" for f in diagnose({"backends": [backend(kv, waiting)]}))


async def test_store_down_is_a_metric_and_a_finding() -> None:
    calls = {"n": 0}

    async def unhealthy() -> bool:
        calls["n"] += 1
        raise ConnectionError("redis gone")

    obs = Observer(ObserveSettings(), store_health=unhealthy)

    async def broken_snapshot() -> StoreSnapshot:
        raise ConnectionError("redis gone")

    await obs.check_store()
    await obs.check_store()
    assert obs.store_healthy is False and obs.store_errors == 2
    from prometheus_client import CollectorRegistry, generate_latest

    reg = CollectorRegistry()
    for c in obs.collectors():
        reg.register(c)
    text = generate_latest(reg).decode()
    assert "tokengate_store_healthy 0.0" in text and "tokengate_store_errors_total 2.0" in text
    from gateway.observe.stats import build_stats

    st = await build_stats(StatsSources(obs, snapshot=broken_snapshot))
    assert st["store_error"] and st["findings"][0]["topic"] == "store"


def test_records_drive_in_flight_and_windows() -> None:
    from gateway.observe.accesslog import Record

    clock = Clock(100.0)
    obs = Observer(ObserveSettings.from_dict({"window_s": 1}), clock=clock)
    long_rec = Record(
        method="POST", path="/v1/completions", start=0.0, klass="long", pool="p", prefill=9000, decode=100
    )
    obs.admitted(long_rec)
    assert obs.windows.inflight("long") == 9100
    rejected = Record(
        method="POST", path="/v1/completions", start=0.0, klass="short", queue_s=2.0, outcome="rejected"
    )
    obs.finished(rejected, 2.5)  # never admitted: nothing to release, its queue wait still counts
    bad_key = Record(method="POST", path="/v1/completions", start=0.0, status=401, outcome="rejected")
    obs.finished(bad_key, 0.01)
    long_rec.ttft_s, long_rec.queue_s, long_rec.backend_s = 0.8, 0.0, 1.0
    obs.finished(long_rec, 1.2)
    assert obs.windows.inflight_all() == {"long": 0, "short": 0}
    clock.t += 2.5
    obs.refresh()
    assert obs.windows.classes() == ["long", "short"]  # "unclassified" is not a class
    (sw,) = obs.windows.history("short")
    assert sw.count == 1 and sw.errors == 1 and sw.queue_wait.p99 == 2.0
    (lw,) = obs.windows.history("long")
    assert lw.ttft.p99 == 0.8 and lw.admitted_cost_sum == 9100


async def test_doctor_takes_a_url_ending_in_v1_and_the_api_port_says_where_stats_are(
    stub_backend: tuple[StubBackend, str], gateway_factory: GatewayFactory, capsys: pytest.CaptureFixture[str]
) -> None:
    stub, url = stub_backend
    gw = await gateway_factory({"pools": stub_pools(url)})
    async with httpx.AsyncClient(base_url=gw.url) as c:
        r = await c.get("/v1/stats")
    # Never forwarded to the backend as a charged pass-through: a 404 from the gateway itself.
    assert r.status_code == 404 and r.json()["error"]["code"] == "unknown_route"
    assert stub.requests == [] and await gw.wait_idle() == {"tenant:default": 0, "backend:default": 0}

    def doctor_at(base: str) -> int:
        return doctor.run(argparse.Namespace(url=base, token=None, timeout=5.0, json=False))

    assert await asyncio.to_thread(doctor_at, gw.ops_url + "/v1/") in (0, 1)
    assert "tokengate doctor: " + gw.ops_url in capsys.readouterr().out
    assert await asyncio.to_thread(doctor_at, gw.url + "/v1") == 3
    err = capsys.readouterr().err
    assert "HTTP 404" in err and "ops listener" in err  # the gateway's own words: where /stats is


async def test_a_dead_backend_is_said_to_be_down_not_only_that_its_metrics_are_stale(
    gateway_factory: GatewayFactory, capsys: pytest.CaptureFixture[str]
) -> None:
    from tests.conftest import free_port

    dead = f"http://127.0.0.1:{free_port()}"
    gw = await gateway_factory(
        {
            "pools": stub_pools(dead, models=["stub-model"]),
            "health": {"failure_threshold": 1, "cooldown_s": 60},
            "observability": {"scrape": {"interval_s": 0.05, "stale_after_s": 0.1}},
        }
    )
    async with httpx.AsyncClient(base_url=gw.url) as c:
        st = (await c.get(gw.ops_url + "/stats")).json()
        assert [b["health"] for b in st["backends"]] == ["unknown"]
        r = await c.post("/v1/chat/completions", json=chat())
        assert r.status_code == 502
        st = (await c.get(gw.ops_url + "/stats")).json()
    (b,) = st["backends"]
    assert b["health"] == "down" and b["consecutive_failures"] == 1
    down = [f for f in st["findings"] if f["topic"] == "backend"]
    assert [f["level"] for f in down] == ["crit"] and "is down" in down[0]["text"]
    assert not any("metrics are stale" in f["text"] for f in st["findings"])
    rc = await asyncio.to_thread(
        doctor.run, argparse.Namespace(url=gw.ops_url, token=None, timeout=5.0, json=False)
    )
    out = capsys.readouterr().out
    assert rc == 2 and "is down" in out and "down" in out.split("Backends")[1]


def test_a_backend_that_never_answered_is_named_so() -> None:
    st = {
        "backends": [
            {"backend": "b", "pool": "p", "health": "unknown", "stale": True, "reason": "metrics stale"}
        ]
    }
    (f,) = [f for f in diagnose(st) if f.topic == "backend"]
    assert f.level == "crit" and "has never answered" in f.text


def test_a_tenant_near_its_share_of_connections_is_a_finding_naming_it() -> None:
    def stats(n: int) -> dict[str, object]:
        top = [{"tenant": "chatty", "connections": n}, {"tenant": "quiet", "connections": 3}]
        return {"tenant_connections": {"total": n + 3, "limit_per_tenant": 100, "top_tenants": top}}

    assert [f for f in diagnose(stats(79)) if f.topic == "connections"] == []
    (f,) = [f for f in diagnose(stats(85)) if f.topic == "connections"]
    assert f.level == "warn" and "chatty (85)" in f.text and "quiet" not in f.text
    assert "limits.max_connections_per_tenant" in f.text
    (f,) = [f for f in diagnose(stats(100)) if f.topic == "connections"]
    assert f.level == "crit"
    no_bound = {"tenant_connections": {"total": 500, "limit_per_tenant": 0, "top_tenants": []}}
    assert [f for f in diagnose(no_bound) if f.topic == "connections"] == []


def test_a_long_encode_backlog_is_a_finding_naming_who_holds_most_of_it() -> None:
    quiet = {"encode_backlog": {"chars": 1_000_000, "top_tenants": [{"tenant": "a", "chars": 1_000_000}]}}
    assert [f for f in diagnose(quiet) if f.topic == "encode"] == []
    busy = {
        "encode_backlog": {"chars": 20_000_000, "top_tenants": [{"tenant": "flood", "chars": 19_000_000}]}
    }
    (f,) = [f for f in diagnose(busy) if f.topic == "encode"]
    assert f.level == "warn" and "flood's (19,000,000)" in f.text and "pricing.encode_threads" in f.text

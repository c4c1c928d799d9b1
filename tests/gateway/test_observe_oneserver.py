"""The one-server recipe: a one-backend pool with head-of-line blocking gets engine flags, priority
forwarding and a prefill gate in /stats, /insights, the findings and `tokengate doctor`, each marked
in effect or not from the gateway's config and the engine's own /metrics."""

from __future__ import annotations

import io
import random
from typing import Any

import httpx
import yaml
from prometheus_client import CollectorRegistry, generate_latest
from starlette.applications import Starlette

from backends.engine.kv_cache import BlockManager
from backends.engine.scheduler import SchedulerConfig
from backends.reference.metrics import EngineMetrics
from gateway.observe import ConfigView, Observer, ObserveSettings, StatsSources, doctor, observe_routes
from gateway.observe.diagnose import diagnose, suggested_reserve
from gateway.observe.oneserver import ShortLoad, one_server_plans, suggested_gate, suggested_gate_tokens
from gateway.observe.scrape import ScrapeTarget, parse_engine_metrics
from gateway.observe.stats import build_stats
from tests.conftest import serve_asgi
from tests.gateway.gw_support import Clock

URL = "http://127.0.0.1:18001"
URL2 = "http://127.0.0.1:18002"
SETTINGS = ObserveSettings.from_dict(
    {
        "window_s": 1,
        "hol": {"lookback_windows": 10, "min_windows": 5, "threshold": 0.7},
        "shape": {"min_requests": 20},
    }
)


def view(
    *, backends: int = 1, gate: int | None = None, reserve: int | None = None, accepts_priority: bool = False
) -> ConfigView:
    pool: dict[str, Any] = {
        "backends": [
            {"url": u, "capacity_tokens": 200_000, **({"accepts_priority": True} if accepts_priority else {})}
            for u in (URL, URL2)[:backends]
        ]
    }
    if gate is not None:
        pool["prefill_gate_tokens"] = gate
    if reserve is not None:
        pool["prefill_gate_reserve_tokens"] = reserve
    return ConfigView(
        classes=[
            {"name": "long", "when": {"min_prompt_tokens": 8000}, "pool": "shared"},
            {"name": "short", "pool": "shared"},
        ],
        pools={"shared": pool},
    )


def blocked_observer(engine_metrics: str, backends: int = 1) -> Observer:
    """Short requests slow down whenever 28k-token requests are in flight on the pool."""
    clock = Clock(100.0)
    obs = Observer(SETTINGS, targets=[ScrapeTarget("shared", u) for u in (URL, URL2)[:backends]], clock=clock)
    rng = random.Random(3)
    for k in range(12):
        active = k % 4 >= 2
        base = 100.0 + k
        if active:
            clock.t = base + 0.01
            obs.on_admit("long", "shared", 28_600)
        for i in range(20):
            clock.t = base + 0.02 + i * 0.04
            obs.on_admit("short", "shared", 1_200)
            ttft = 0.05 + (0.8 * rng.random() if active else 0.01 * rng.random())
            obs.on_done("short", 1_200, queue_wait_s=0.001, ttft_s=ttft, backend_s=ttft + 0.5)
        if active:
            clock.t = base + 0.95
            obs.on_done("long", 28_600, queue_wait_s=0.002, ttft_s=1.0, backend_s=6.0, e2e_s=6.0)
    clock.t = 113.0
    obs.refresh()
    for load in obs.loads:
        load.update(parse_engine_metrics(engine_metrics))
    return obs


def reference_metrics(**scheduler: Any) -> str:
    """The reference backend's own /metrics text for these scheduler settings."""
    registry = CollectorRegistry()
    EngineMetrics(registry, "m").publish_config(SchedulerConfig(**scheduler), BlockManager(100, 16))
    return generate_latest(registry).decode() + "vllm:num_requests_running 1\n"


VLLM = "vllm:kv_cache_usage_perc 0.2\nvllm:num_requests_running 3\n"


async def stats_of(obs: Observer, v: ConfigView) -> dict[str, Any]:
    return await build_stats(StatsSources(obs, config_view=lambda: v))


async def test_a_blocked_one_backend_pool_gets_the_recipe_for_vllm() -> None:
    st = await stats_of(blocked_observer(VLLM), view())
    (plan,) = st["one_server"]
    assert (plan["pool"], plan["victim"], plan["aggressor"], plan["engine"]) == (
        "shared",
        "short",
        "long",
        "vllm",
    )
    flags = {s["name"]: s for s in plan["engine_settings"]}
    assert flags["--long-prefill-token-threshold"]["value"] == "512"
    assert flags["--scheduling-policy"]["value"] == "priority"
    assert all(s["in_effect"] is None for s in plan["engine_settings"])  # vLLM keeps them out of /metrics
    gateway = {s["name"]: s for s in plan["gateway_settings"]}
    assert gateway["pools.shared.prefill_gate_tokens:"]["in_effect"] is False
    assert gateway[f"accepts_priority: true on backend {URL}"]["in_effect"] is False
    # The lane: the largest request (one at a time); the reserve: the largest short one plus the
    # short tokens sent while one is inside (24,000 tokens/s x a p99 TTFT of ~0.84 s: 21,400), but at
    # most half the lane, so the long prompts stay long.
    assert (plan["prefill_gate_tokens"], plan["prefill_gate_reserve_tokens"]) == (43_000, 14_000)
    assert gateway["pools.shared.prefill_gate_reserve_tokens:"]["in_effect"] is False
    assert any("v0 engine" in n for n in plan["notes"])
    findings = {f.topic: f for f in diagnose(st)}
    assert findings["one_server"].level == "crit"
    assert "--long-prefill-token-threshold 512" in findings["one_server"].text
    assert "cannot be split" in findings["hol"].text  # not "route it to its own pool"


async def test_the_reference_engines_metrics_show_which_controls_are_in_effect() -> None:
    off = await stats_of(blocked_observer(reference_metrics()), view())
    (plan,) = off["one_server"]
    assert plan["engine"] == "reference"
    flags = {s["name"]: s for s in plan["engine_settings"]}
    assert flags["--long-prefill-token-threshold"]["in_effect"] is False
    assert flags["--long-prefill-token-threshold"]["seen"] == "0"
    assert flags["--scheduling-policy"]["in_effect"] is False

    on = await stats_of(
        blocked_observer(reference_metrics(long_prefill_token_threshold=512, policy="priority")),
        view(gate=34_000, reserve=14_000, accepts_priority=True),
    )
    (plan,) = on["one_server"]
    assert plan["all_in_effect"]
    assert {f.topic: f.level for f in diagnose(on)}["one_server"] == "warn"

    vllm_scope = await stats_of(
        blocked_observer(
            reference_metrics(long_prefill_token_threshold=512, policy="priority", priority_scope="queue")
        ),
        view(gate=34_000, accepts_priority=True),
    )
    flags = {s["name"]: s for s in vllm_scope["one_server"][0]["engine_settings"]}
    assert flags["--scheduling-policy"]["in_effect"] is False  # vLLM's scope does not order running requests


async def test_a_pool_with_two_backends_gets_the_split_not_the_one_server_recipe() -> None:
    st = await stats_of(blocked_observer(VLLM, backends=2), view(backends=2))
    assert st["one_server"] == []
    assert "route class long to its own pool" in {f.topic: f for f in diagnose(st)}["hol"].text


async def test_sglang_and_tgi_get_their_own_equivalents() -> None:
    sglang = await stats_of(blocked_observer("sglang:token_usage 0.3\nsglang:num_running_reqs 2\n"), view())
    names = [s["name"] for s in sglang["one_server"][0]["engine_settings"]]
    assert names == [
        "--chunked-prefill-size",
        "--enable-priority-scheduling",
        "--schedule-low-priority-values-first",
    ]
    tgi = await stats_of(blocked_observer("tgi_queue_size 1\ntgi_batch_current_size 2\n"), view())
    (plan,) = tgi["one_server"]
    assert [s["name"] for s in plan["engine_settings"]] == ["--max-batch-prefill-tokens"]
    assert not any("accepts_priority" in s["name"] for s in plan["gateway_settings"])  # TGI has no priority


async def test_insights_yaml_carries_the_gateway_edit_and_the_engine_flags() -> None:
    obs = blocked_observer(VLLM)
    src = StatsSources(obs, config_view=lambda: view())
    served = await serve_asgi(Starlette(routes=observe_routes(src)))
    try:
        async with httpx.AsyncClient(base_url=served.url) as c:
            text = (await c.get("/insights", params={"format": "yaml"})).text
            body = (await c.get("/insights")).json()
    finally:
        await served.stop()
    first = text.split("---")[0]
    assert "--long-prefill-token-threshold 512 --scheduling-policy priority" in first
    doc = yaml.safe_load(first)
    shared = doc["pools"]["shared"]
    assert (shared["prefill_gate_tokens"], shared["prefill_gate_reserve_tokens"]) == (43_000, 14_000)
    assert shared["backends"] == [{"url": URL, "capacity_tokens": 200_000, "accepts_priority": True}]
    assert body["one_server"][0]["pool"] == "shared"
    assert any(f["topic"] == "one_server" for f in body["findings"])


async def test_doctor_prints_the_recipe() -> None:
    st = await stats_of(blocked_observer(VLLM), view())
    out = io.StringIO()
    doctor.report(st, diagnose(st), "http://gw", out)
    text = out.getvalue()
    assert (
        "[one_server]" in text and "--long-prefill-token-threshold" in text and "prefill_gate_tokens" in text
    )


def test_the_suggested_gate_fits_the_largest_request_and_a_few_median_ones() -> None:
    assert suggested_gate_tokens(28_600, 1_200) == 48_000  # 28,600 + 16 x 1,200, rounded up
    assert suggested_gate_tokens(None, None) == 32_000
    assert suggested_gate_tokens(9_000, 100.0) == 11_000
    # Never room for two of the largest: 8,000 + 16 x 2,000 would let a second 8,000 in.
    assert suggested_gate_tokens(8_000, 2_000.0) == 15_000


def test_the_suggested_gate_has_a_lane_for_the_largest_and_a_reserve_for_the_short_class() -> None:
    # Lane 29,000 (one 28,200 prompt at a time); reserve 6,500 + 8,000 tokens/s x 0.5 s, rounded up.
    assert suggested_gate(28_200, ShortLoad(6_500, 8_000.0, 0.5)) == (40_000, 11_000)
    # A blocked short class's TTFT counts for at most MAX_STAY_S (1 s): 4,500 + 8,000.
    assert suggested_gate(28_200, ShortLoad(4_500, 8_000.0, 5.0)) == (42_000, 13_000)
    # No rate: a burst of 16 median requests; no short class seen: the single size, default reserve.
    assert suggested_gate(28_200, ShortLoad(4_500), 500.0) == (42_000, 13_000)
    # At least the most short tokens sent within one second (the gate measures it), but at most half
    # the lane: a reserve as large as the long prompts would make them short.
    assert suggested_gate(28_207, ShortLoad(6_472, 2_000.0, 1.4, burst_tokens=11_500)) == (41_000, 12_000)
    assert suggested_gate(28_207, ShortLoad(6_472, 6_600.0, 1.4, burst_tokens=27_658)) == (43_000, 14_000)
    assert suggested_gate(28_200, ShortLoad(), 1_200.0) == (suggested_gate_tokens(28_200, 1_200.0), None)


async def test_a_gate_on_the_backend_sizes_the_reserve_from_its_own_short_prompts() -> None:
    obs = blocked_observer(VLLM)
    h = obs.settings.hol
    row = {"short": {"max_tokens": 6_400, "tokens_per_s": 7_000.0, "inside_p99_s": 0.4}}
    (plan,) = one_server_plans(
        obs.hol(),
        threshold=h.threshold,
        min_windows=h.min_windows,
        shape=obs.shape,
        pools=view(gate=40_000).pools,
        loads=obs.loads,
        gates={URL: row},
    )
    assert (plan.gate_tokens, plan.gate_reserve) == (29_000 + 10_000, 10_000)  # 6,400 + 2,800
    reserve = {s.name: s for s in plan.gateway_settings}["pools.shared.prefill_gate_reserve_tokens:"]
    assert (reserve.in_effect, reserve.seen) == (True, "10000")  # the default: a quarter of 40,000
    assert "the gate's short prompts" in reserve.why
    assert "prefill_gate_reserve_tokens: 10000" in plan.to_yaml(view(gate=40_000).pools)


def gate_row(short: dict[str, Any], long: dict[str, Any] | None = None) -> dict[str, Any]:
    return {
        "pool": "shared",
        "backend": "b0",
        "limit": 40_000,
        "reserve": 10_000,
        "short": short,
        "long": long or {},
    }


def test_the_doctor_says_when_the_gate_holds_short_prompts_and_what_reserve_they_need() -> None:
    short = {"requests": 800, "held": 40, "wait_p99_s": 0.26, "max_tokens": 6_400, "tokens_per_s": 7_000.0,
             "inside_p99_s": 0.9}  # fmt: skip
    (f,) = [f for f in diagnose({"prefill_gates": [gate_row(short)]}) if f.topic == "gate"]
    assert f.level == "warn"
    assert "holds short prompts: p99 wait 260 ms" in f.text
    # 6,400 + 7,000 x 0.9 = 12,700 -> 13,000; the gate grows by as much, so the lane stays 30,000.
    assert "from 10,000 to 13,000" in f.text and "from 40,000 to 43,000" in f.text
    assert suggested_reserve(short) == 13_000
    assert suggested_reserve({**short, "burst_tokens_1s": 17_600}) == 18_000  # a burst needs more
    # ... but a prompt that fits in the reserve is short: it stays at most half the smallest long one.
    assert suggested_reserve({**short, "burst_tokens_1s": 27_658}, {"min_tokens": 28_000}) == 14_000


def test_no_gate_finding_while_short_prompts_pass_and_a_note_when_long_ones_wait_long() -> None:
    quiet = {"requests": 800, "held": 0, "wait_p99_s": 0.0, "max_tokens": 6_400}
    assert not [f for f in diagnose({"prefill_gates": [gate_row(quiet)]}) if f.topic == "gate"]
    slow = gate_row(quiet, {"requests": 12, "held": 8, "wait_p99_s": 14.6})
    (f,) = [f for f in diagnose({"prefill_gates": [slow]}) if f.topic == "gate"]
    assert f.level == "info" and "14.60 s" in f.text and "lane of 30,000" in f.text

"""The buffered per-request metric children expose exactly what prometheus_client's own would."""

from __future__ import annotations

import random

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

from gateway.observe.metrics import _LATENCY_BUCKETS, BufferedCounter, BufferedHistogram, GatewayMetrics


def _exposition(reg: CollectorRegistry) -> list[str]:
    # _created carries the creation time of each registry's own children: not comparable
    return [line for line in generate_latest(reg).decode().splitlines() if "_created" not in line]


def test_buffered_children_render_the_same_as_direct_ones_once_collected() -> None:
    rng = random.Random(7)
    values = [rng.choice(_LATENCY_BUCKETS) for _ in range(200)]  # exactly on bounds: `le` is inclusive
    values += [rng.uniform(0, 700) for _ in range(500)] + [0.0, 1e9, float("inf")]
    direct, buffered = CollectorRegistry(), CollectorRegistry()
    hd = Histogram("t_seconds", "x", ("c",), buckets=_LATENCY_BUCKETS, registry=direct).labels("a")
    cd = Counter("t_tokens", "x", ("c",), registry=direct).labels("a")
    hb_child = Histogram("t_seconds", "x", ("c",), buckets=_LATENCY_BUCKETS, registry=buffered).labels("a")
    cb_child = Counter("t_tokens", "x", ("c",), registry=buffered).labels("a")
    hb, cb = BufferedHistogram(hb_child), BufferedCounter(cb_child)
    for v in values:
        hd.observe(v)
        hb.observe(v)
        n = rng.randint(1, 40)
        cd.inc(n)
        cb.inc(n)
    assert _exposition(buffered) != _exposition(direct)  # nothing handed over yet
    hb.flush()
    cb.flush()
    assert _exposition(buffered) == _exposition(direct)
    hb.flush()  # a second flush with nothing new changes nothing
    assert _exposition(buffered) == _exposition(direct)


def test_the_gateway_registry_hands_buffered_observations_over_on_every_scrape() -> None:
    m = GatewayMetrics(tenants=["acme"])
    b = m.bind("short", "acme", "standard")
    b.outcomes["ok"].inc()
    b.e2e.observe(0.2)
    b.e2e.observe(3.0)
    reg = m.registry
    labels = {"class": "short", "tier": "standard"}
    assert reg.get_sample_value("tokengate_request_duration_seconds_count", labels) == 2
    assert reg.get_sample_value("tokengate_request_duration_seconds_bucket", {**labels, "le": "0.25"}) == 1
    text = m.render().decode()
    assert 'tokengate_requests_total{class="short",outcome="ok",tenant="acme",tier="standard"} 1.0' in text
    b.e2e.observe(0.01)
    assert "tokengate_request_duration_seconds_count" in m.render().decode()
    assert reg.get_sample_value("tokengate_request_duration_seconds_count", labels) == 3


def test_renaming_tenants_hands_over_what_the_old_children_held() -> None:
    m = GatewayMetrics(tenants=["acme"])
    m.bind("short", "acme", "standard").outcomes["ok"].inc(5)
    m.set_tenants(["globex"])  # acme's children are dropped: their counts must not be
    m.bind("short", "acme", "standard").outcomes["ok"].inc(1)  # now labelled "other"
    reg = m.registry
    ok = {"class": "short", "outcome": "ok", "tier": "standard"}
    assert reg.get_sample_value("tokengate_requests_total", {**ok, "tenant": "acme"}) == 5
    assert reg.get_sample_value("tokengate_requests_total", {**ok, "tenant": "other"}) == 1

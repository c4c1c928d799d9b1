"""Health probes per backend (``probe``): the forms it takes, a backend that is never probed (its
breaker half-opens after the cooldown instead), and a probe that times out while the backend's
answers are flowing, which is not held against it."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest
import yaml

from gateway.config.loader import ConfigError, parse_config
from gateway.upstream.health import HealthChecker, HealthSettings
from gateway.upstream.pools import DEFAULT_PROBE, Backend, BackendSpec, BreakerSettings, HealthProbe
from tests.conftest import GatewayFactory, Receive, Scope, Send, StubBackend, serve_asgi, stub_pools
from tests.gateway.gw_support import RawRequest, chat
from tests.support import eventually

_OMIT = object()


def _probe(probe: Any = _OMIT) -> HealthProbe | None:
    backend: dict[str, Any] = {"url": "http://127.0.0.1:8001", "capacity_tokens": 1}
    if probe is not _OMIT:
        backend["probe"] = probe
    return parse_config({"pools": {"main": {"backends": [backend]}}}).pools[0].backends[0].probe


@pytest.mark.parametrize(
    ("probe", "expected"),
    [
        (_OMIT, DEFAULT_PROBE),
        (None, DEFAULT_PROBE),
        (False, None),
        ("off", None),
        ("/v1/models", HealthProbe("/v1/models", "GET")),
        ("/ping?full=1", HealthProbe("/ping?full=1", "GET")),
        ({"path": "/v1/models"}, HealthProbe("/v1/models", "GET")),
        ({"path": "/v1/models", "method": "HEAD"}, HealthProbe("/v1/models", "HEAD")),
        ({"path": "/health", "method": "head"}, HealthProbe("/health", "HEAD")),
    ],
)
def test_probe_forms(probe: Any, expected: HealthProbe | None) -> None:
    assert _probe(probe) == expected


def test_probe_default_and_off_in_yaml() -> None:
    assert DEFAULT_PROBE == HealthProbe("/health", "GET", fallback="/v1/models")
    for text in ("probe: off", "probe: false", "probe: 'off'", "probe: OFF"):
        assert _probe(yaml.safe_load(text)["probe"]) is None, text
    assert _probe(yaml.safe_load("probe: {path: /v1/models, method: HEAD}")["probe"]) == HealthProbe(
        "/v1/models", "HEAD"
    )


_AT = "pools.main.backends[0].probe"
_FORMS = "expected off, a path starting with '/', or {path, method}"


@pytest.mark.parametrize(
    ("probe", "message"),
    [
        ("health", f"{_AT}: {_FORMS}, got 'health'"),
        (True, f"{_AT}: {_FORMS}, got true"),
        (5, f"{_AT}: {_FORMS}, got 5"),
        (["/health"], f"{_AT}: {_FORMS}, got a list"),
        ("/my health", f"{_AT}: {_FORMS}, got '/my health'"),
        ({"path": "health"}, f"{_AT}.path: expected a path starting with '/' (no spaces), got 'health'"),
        ({"method": "GET"}, f"{_AT}.path: required, expected a string"),
        ({"path": "/h", "method": "POST"}, f"{_AT}.method: expected GET or HEAD, got 'POST'"),
        ({"path": "/h", "method": 1}, f"{_AT}.method: expected GET or HEAD, got 1"),
        ({"path": "/h", "timeout": 1}, f"{_AT}.timeout: unknown key"),
    ],
)
def test_probe_errors_name_the_field(probe: Any, message: str) -> None:
    with pytest.raises(ConfigError) as err:
        _probe(probe)
    assert str(err.value).startswith(message)


@dataclass
class Recorder:
    """In front of the stub backend: records every request's method and path (the stub records
    only the proxied ones), and while ``hang`` is set lets ``/health`` go unanswered until the
    prober gives up and disconnects."""

    app: StubBackend = field(default_factory=StubBackend)
    seen: list[tuple[str, str]] = field(default_factory=list)
    hang: bool = False
    hung: int = 0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            self.seen.append((scope["method"], scope["path"]))
            if self.hang and scope["path"] == "/health":
                self.hung += 1
                while (await receive())["type"] != "http.disconnect":
                    pass
                return
        await self.app(scope, receive, send)

    def paths(self, path: str) -> int:
        return sum(1 for _, p in self.seen if p == path)


FAST_PROBES = {"interval_s": 0.05, "unhealthy_interval_s": 0.05, "probe_timeout_s": 0.2}


async def test_probe_off_backend_is_never_probed(gateway_factory: GatewayFactory) -> None:
    quiet, probed = Recorder(), Recorder()
    quiet_served, probed_served = await serve_asgi(quiet), await serve_asgi(probed)
    try:
        pools = {
            "quiet": {
                "backends": [
                    {
                        "url": quiet_served.url,
                        "capacity_tokens": 100_000,
                        "models": ["stub-model"],
                        "probe": "off",
                    }
                ]
            },
            "probed": {
                "backends": [
                    {"url": probed_served.url, "capacity_tokens": 100_000, "models": ["other-model"]}
                ]
            },
        }
        gw = await gateway_factory({"pools": pools, "health": FAST_PROBES})
        async with httpx.AsyncClient(base_url=gw.url) as c:
            assert (await c.post("/v1/chat/completions", json=chat(max_tokens=1))).status_code == 200
        # The probed backend is asked several times over: the checker has run all along.
        await eventually(lambda: probed.paths("/health") >= 5, timeout_s=10)
        quiet_backend = next(b for b in gw.app.router.backends if b.pool == "quiet")
        assert quiet_backend.spec.probe is None and quiet_backend.healthy
        assert quiet.paths("/health") == quiet.paths("/v1/models") == 0
        assert ("POST", "/v1/chat/completions") in quiet.seen
        async with httpx.AsyncClient(base_url=gw.url) as c:  # ready although no probe confirms it
            assert (await c.get("/readyz")).json() == {"status": "ready"}
    finally:
        await quiet_served.stop()
        await probed_served.stop()


@pytest.mark.parametrize("method", ["GET", "HEAD"])
async def test_probe_path_is_what_is_asked(gateway_factory: GatewayFactory, method: str) -> None:
    stub = Recorder(StubBackend(health_status=500))  # its /health fails: only /v1/models says it is up
    served = await serve_asgi(stub)
    try:
        probe: object = "/v1/models" if method == "GET" else {"path": "/v1/models", "method": method}
        pools = stub_pools(served.url, models=["stub-model"], probe=probe)
        gw = await gateway_factory({"pools": pools, "health": FAST_PROBES})
        await eventually(lambda: stub.seen.count((method, "/v1/models")) >= 3, timeout_s=10)
        b = next(iter(gw.app.router.backends))
        assert b.state == "up"  # the first probe at start-up confirmed it
        assert stub.paths("/health") == 0
        assert {m for m, _ in stub.seen} == {method}
    finally:
        await served.stop()


async def test_a_backend_whose_stream_flows_is_not_probed_and_an_idle_one_that_hangs_goes_down(
    gateway_factory: GatewayFactory,
) -> None:
    stub = Recorder()
    served = await serve_asgi(stub)
    try:
        health = {**FAST_PROBES, "probe_timeout_s": 0.1, "failure_threshold": 2, "cooldown_s": 60}
        gw = await gateway_factory({"pools": stub_pools(served.url, models=["stub-model"]), "health": health})
        backend = next(iter(gw.app.router.backends))
        assert backend.state == "up"
        # An engine serving one request at a time: the probe waits behind the stream and times out.
        stub.hang = True
        req = await RawRequest.post(
            gw.url,
            "/v1/chat/completions",
            chat(stream=True),
            {"x-stub-chunks": "400", "x-stub-interval": "0.02"},
        )
        try:
            assert (await req.read_head())[0] == 200
            events = b""
            while events.count(b"data:") < 40:  # 0.8 s of stream: 16 probe intervals
                events += await req.read_some(4096)
            assert backend.in_flight_requests == 1  # the stream still flows
            # Answers arriving say it is alive: no probe goes to it (one could disturb it).
            assert stub.hung == 0
            assert backend.healthy and backend.consecutive_failures == 0
        finally:
            await req.close()
        # Idle, the same probe failing counts: the breaker opens after failure_threshold.
        await eventually(lambda: backend.in_flight_requests == 0)
        await eventually(lambda: not backend.healthy, timeout_s=10)
        assert backend.consecutive_failures >= 2
    finally:
        await served.stop()


async def test_probe_off_breaker_half_opens_after_the_cooldown(gateway_factory: GatewayFactory) -> None:
    stub = StubBackend()
    first = await serve_asgi(stub)
    port = int(first.url.rsplit(":", 1)[1])
    gw = await gateway_factory(
        {
            "pools": stub_pools(first.url, models=["stub-model"], probe="off"),
            "health": {**FAST_PROBES, "failure_threshold": 1, "cooldown_s": 30},
        }
    )
    backend = next(iter(gw.app.router.backends))
    await first.stop()
    async with httpx.AsyncClient(base_url=gw.url) as c:

        async def status() -> tuple[int, str | None]:
            r = await c.post("/v1/chat/completions", json=chat(max_tokens=1))
            return r.status_code, r.json().get("error", {}).get("code") if r.status_code != 200 else None

        assert (await status())[0] == 502  # the connect failure opens the breaker
        assert not backend.healthy
        assert await status() == (503, "no_healthy_backend")  # open: nothing goes through
        backend.down_since -= 30  # the cooldown has passed: half-open
        assert (await status())[0] == 502  # the one request let through fails: open again
        assert not backend.healthy and not backend.available
        assert await status() == (503, "no_healthy_backend")
        second = await serve_asgi(stub, port=port)
        try:
            assert await status() == (503, "no_healthy_backend")  # no probe notices it is back
            backend.down_since -= 30
            assert await status() == (200, None)  # the request let through succeeds: closed
            assert backend.healthy and backend.consecutive_failures == 0
            assert await status() == (200, None)
        finally:
            await second.stop()


def test_half_open_takes_one_request_at_a_time_and_only_without_a_probe() -> None:
    breaker = BreakerSettings(failure_threshold=1, cooldown_s=5.0)
    quiet = Backend(BackendSpec("http://a", 10, probe=None), "p", breaker)
    probed = Backend(BackendSpec("http://b", 10), "p", breaker)
    for b in (quiet, probed):
        assert b.record_connect_failure(now=time.monotonic())
        assert not b.available  # open: cooling down
        b.down_since -= 5.0
    assert not probed.available  # only its probe closes it
    assert quiet.available  # half-open
    with quiet.occupy(1):
        assert not quiet.available  # the trial request is in flight
        assert quiet.record_success()  # it answered: closed
        assert quiet.available and quiet.healthy
    assert not probed.record_success() and not probed.healthy  # a probed backend waits for its probe


async def test_a_probe_that_timed_out_behind_a_stream_that_made_progress_is_not_a_failure(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The probe went out while the backend looked idle (no bytes since the last look), waited
    behind its work and timed out while the answer's bytes came: not held against it."""
    caplog.set_level(logging.INFO, logger="tokengate.health")
    stub = Recorder()
    served = await serve_asgi(stub)
    spec = BackendSpec(url=served.url, capacity_tokens=1000, models=("stub-model",))
    backend = Backend(spec, "p", BreakerSettings(failure_threshold=1))
    checker = HealthChecker([backend], HealthSettings(probe_timeout_s=0.1))
    await checker.start()
    try:
        stub.hang = True
        backend.in_flight_requests = 1  # a request in flight whose bytes have not come yet
        probing = asyncio.create_task(checker.check_once(force=True))
        await eventually(lambda: stub.hung == 1)
        backend.progressed = True  # the answer's first bytes arrive while the probe waits
        await probing
        assert backend.healthy and backend.consecutive_failures == 0
        assert "not counted as a failure" in caplog.text
        backend.in_flight_requests = 0  # idle: the same probe failing counts
        await checker.check_once(force=True)
        assert not backend.healthy
    finally:
        await checker.close()
        await served.stop()


async def test_a_backend_just_handed_a_request_is_not_probed_before_its_first_bytes() -> None:
    """A request that starts just before a probe pass has sent no bytes yet: the probe would reach
    an engine that serves one request at a time as its stream starts, and cut it."""
    stub = Recorder()
    served = await serve_asgi(stub)
    spec = BackendSpec(url=served.url, capacity_tokens=1000, models=("stub-model",))
    backend = Backend(spec, "p")
    checker = HealthChecker([backend], HealthSettings())
    await checker.start()
    try:
        backend.progress_seen(0.0)  # (what the last pass did)
        before = stub.paths("/health")
        with backend.occupy(10):  # handed a request; no bytes back yet
            await checker.check_once(force=True)
        assert stub.paths("/health") == before
        await checker.check_once(force=True)  # idle now: probed
        assert stub.paths("/health") == before + 1
    finally:
        await checker.close()
        await served.stop()

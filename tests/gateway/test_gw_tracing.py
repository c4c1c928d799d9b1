"""OpenTelemetry traces (``tracing:``), exported to real OTLP receivers started here (gRPC and
HTTP/protobuf): each request's server, admission and upstream spans with the GenAI attributes and
the gateway's facts; the client's W3C trace context joined and ours sent upstream; refused, queued,
streamed and disconnected requests each with the right spans and status; sampling; and off by
default, when the client's headers pass through as they came."""

from __future__ import annotations

import asyncio
import logging
import random
import sys
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import orjson
import pytest

from gateway.config.fields import ConfigError
from gateway.config.loader import parse_config
from gateway.observe.tracing import parse_traceparent
from loadtest.processes import child_env, repo_root
from tests.conftest import GatewayFactory, RunningGateway, StubBackend, free_port, stub_pools
from tests.gateway.gw_support import access_lines, chat
from tests.gateway.otlp_receiver import GrpcReceiver, HttpReceiver, Span
from tests.support import eventually

KEY = {"authorization": "Bearer sk-acme"}
CLIENT_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"


@pytest.fixture(autouse=True)
def fast_batches(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "20")  # ms: the batch processor exports at once


@pytest.fixture
def grpc_receiver() -> Iterator[GrpcReceiver]:
    r = GrpcReceiver()
    try:
        yield r
    finally:
        r.stop()


@pytest.fixture
async def http_receiver() -> AsyncIterator[HttpReceiver]:
    r = await HttpReceiver().start()
    try:
        yield r
    finally:
        await r.stop()


def traced(url: str, endpoint: str, protocol: str = "grpc", **tracing: Any) -> dict[str, Any]:
    return {
        "pools": stub_pools(url, capacity=2000),
        "tenants": {"acme": {"keys": ["sk-acme"], "budget_tokens": 1000}},
        "tiers": {"standard": {"rank": 0, "max_queue_wait_s": 0.2}},
        "tracing": {"enabled": True, "protocol": protocol, "endpoint": endpoint, **tracing},
    }


async def post(
    gw: RunningGateway, body: dict[str, Any], headers: dict[str, str] | None = None
) -> httpx.Response:
    async with httpx.AsyncClient(base_url=gw.url, timeout=10) as c:
        return await c.post("/v1/chat/completions", json=body, headers={**KEY, **(headers or {})})


def by_kind(spans: list[Span]) -> dict[str, Span]:
    return {s.kind: s for s in spans}


async def test_a_request_joins_the_clients_trace_and_the_engine_gets_the_upstream_span_as_parent(
    stub_backend: tuple[StubBackend, str],
    gateway_factory: GatewayFactory,
    grpc_receiver: GrpcReceiver,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="tokengate.access")
    stub, url = stub_backend
    gw = await gateway_factory(traced(url, grpc_receiver.endpoint, service_name="gw-a"))
    r = await post(
        gw,
        chat(max_tokens=7),
        {"traceparent": f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01", "tracestate": "vendor=1"},
    )
    assert r.status_code == 200
    spans = await grpc_receiver.received.wait_for(CLIENT_TRACE, 3)
    kinds = by_kind(spans)
    server, admission, upstream = kinds["server"], kinds["internal"], kinds["client"]
    assert server.parent_id == CLIENT_SPAN and server.service == "gw-a"
    assert server.name == "POST /v1/chat/completions" and server.status == "unset"
    assert server.attributes["http.response.status_code"] == 200
    assert (
        server.attributes["tokengate.tenant"] == "acme"
        and server.attributes["tokengate.decision"] == "granted"
    )
    assert admission.name == "tokengate.admission" and admission.parent_id == server.span_id
    assert [e[0] for e in admission.events] == ["queued", "granted"]
    assert upstream.parent_id == server.span_id and upstream.name == "chat stub-model"
    a = upstream.attributes
    assert (a["gen_ai.operation.name"], a["gen_ai.provider.name"], a["gen_ai.request.model"]) == (
        "chat",
        "openai",
        "stub-model",
    )
    assert a["gen_ai.request.max_tokens"] == 7 and a["gen_ai.request.stream"] is False
    assert a["gen_ai.usage.input_tokens"] > 0 and a["gen_ai.usage.output_tokens"] > 0
    assert a["gen_ai.response.finish_reasons"] and "gen_ai.response.id" in a
    assert a["server.address"] == "127.0.0.1" and a["server.port"] == int(url.rsplit(":", 1)[1])
    assert a["tokengate.pool"] == "default" and server.attributes["tokengate.cost"] > 7
    # The times nest: the server span holds the other two.
    assert server.start_ns <= admission.start_ns <= admission.end_ns <= upstream.start_ns <= upstream.end_ns
    assert upstream.end_ns <= server.end_ns
    # The engine gets the upstream span as its parent, in the same trace; the client's state too.
    sent = stub.requests[-1].headers
    assert parse_traceparent(sent["traceparent"]) == (int(CLIENT_TRACE, 16), int(upstream.span_id, 16), True)
    assert sent["tracestate"] == "vendor=1"
    # The access line names the trace.
    assert access_lines(caplog)[-1]["trace_id"] == CLIENT_TRACE


async def test_streamed_refused_and_queued_requests_over_http_protobuf(
    stub_backend: tuple[StubBackend, str], gateway_factory: GatewayFactory, http_receiver: HttpReceiver
) -> None:
    stub, url = stub_backend
    stub.default_chunks, stub.default_interval = 10, 0.03
    gw = await gateway_factory(traced(url, http_receiver.endpoint, protocol="http/protobuf"))
    got = http_receiver.received

    async def one(trace: str, body: dict[str, Any]) -> int:
        r = await post(gw, body, {"traceparent": f"00-{trace}-{CLIENT_SPAN}-01"})
        return r.status_code

    streamed, queued, refused = "1" * 32, "2" * 32, "3" * 32
    # A stream holds 700 of acme's 1000; a second 700 waits its 0.2 s and is refused.
    first = asyncio.ensure_future(one(streamed, chat(max_tokens=690, stream=True)))
    await asyncio.sleep(0.05)
    assert await one(queued, chat(max_tokens=690)) == 429
    assert await first == 200
    # Too big ever to fit: refused at once.
    assert await one(refused, chat(max_tokens=5000)) == 413

    s = by_kind(await got.wait_for(streamed, 3))
    assert s["client"].attributes["gen_ai.request.stream"] is True
    assert s["client"].attributes["gen_ai.usage.output_tokens"] > 0
    assert "gen_ai.response.time_to_first_chunk" in s["client"].attributes
    assert s["client"].attributes["gen_ai.response.finish_reasons"] == ["length"]  # (read off the bytes)
    # The id and model come from the usage event (the relay parses no other).
    assert (
        s["client"].attributes["gen_ai.response.model"] == "stub-model"
        and s["client"].attributes["gen_ai.response.id"]
    )

    q = by_kind(await got.wait_for(queued, 2))
    assert set(q) == {"server", "internal"}  # it never went upstream
    assert q["server"].attributes["http.response.status_code"] == 429
    assert q["server"].attributes["error.type"] == "queue_timeout" and q["server"].status == "unset"
    adm = q["internal"]
    assert [e[0] for e in adm.events] == ["queued", "refused"] and adm.status == "error"
    assert adm.attributes["tokengate.decision"] == "queue_timeout"
    assert adm.attributes["tokengate.queue_wait_s"] >= 0.15

    big = by_kind(await got.wait_for(refused, 2))
    assert big["server"].attributes["http.response.status_code"] == 413
    assert big["internal"].attributes["tokengate.decision"] == "cost_exceeds_capacity"


async def test_a_client_that_hangs_up_mid_stream_leaves_a_499_server_span(
    stub_backend: tuple[StubBackend, str], gateway_factory: GatewayFactory, grpc_receiver: GrpcReceiver
) -> None:
    stub, url = stub_backend
    stub.default_chunks, stub.default_interval = 50, 0.05
    gw = await gateway_factory(traced(url, grpc_receiver.endpoint))
    trace = "4" * 32
    async with httpx.AsyncClient(base_url=gw.url, timeout=10) as c:
        headers = {**KEY, "traceparent": f"00-{trace}-{CLIENT_SPAN}-01"}
        async with c.stream(
            "POST", "/v1/chat/completions", json=chat(max_tokens=50, stream=True), headers=headers
        ) as r:
            async for _ in r.aiter_bytes():
                break
    spans = by_kind(await grpc_receiver.received.wait_for(trace, 3))
    assert spans["server"].attributes["http.response.status_code"] == 499
    assert spans["server"].attributes["tokengate.outcome"] == "client_disconnect"

    async def released() -> bool:
        return (await gw.app.store.snapshot()).leases == 0

    await eventually(released, timeout_s=5)


async def test_sampling_is_parent_based_and_the_ratio_decides_roots(
    stub_backend: tuple[StubBackend, str], gateway_factory: GatewayFactory, grpc_receiver: GrpcReceiver
) -> None:
    stub, url = stub_backend
    gw = await gateway_factory(traced(url, grpc_receiver.endpoint, sample_ratio=0.0))
    # A root: not sampled at 0; the engine still gets a traceparent (flags 00) to continue.
    assert (await post(gw, chat(max_tokens=3))).status_code == 200
    root = parse_traceparent(stub.requests[-1].headers["traceparent"])
    assert root is not None and root[2] is False
    # A client's sampled trace is followed (parent-based), an unsampled one too.
    assert (
        await post(gw, chat(max_tokens=3), {"traceparent": f"00-{'5' * 32}-{CLIENT_SPAN}-01"})
    ).status_code == 200
    assert (
        await post(gw, chat(max_tokens=3), {"traceparent": f"00-{'6' * 32}-{CLIENT_SPAN}-00"})
    ).status_code == 200
    await grpc_receiver.received.wait_for("5" * 32, 3)
    await asyncio.sleep(0.2)
    assert grpc_receiver.received.trace("6" * 32) == []
    assert grpc_receiver.received.trace(f"{root[0]:032x}") == []


async def test_hostile_trace_headers_start_a_new_trace_and_ignore_mode_never_joins(
    stub_backend: tuple[StubBackend, str], gateway_factory: GatewayFactory, grpc_receiver: GrpcReceiver
) -> None:
    stub, url = stub_backend
    gw = await gateway_factory(traced(url, grpc_receiver.endpoint))
    for bad in (
        "garbage",
        f"00-{'0' * 32}-{CLIENT_SPAN}-01",
        f"ff-{CLIENT_TRACE}-{CLIENT_SPAN}-01",
        "00-" + "x" * 60,
    ):
        r = await post(gw, chat(max_tokens=3), {"traceparent": bad, "tracestate": "k=" + "v" * 5000})
        assert r.status_code == 200
        sent = stub.requests[-1].headers
        parsed = parse_traceparent(sent["traceparent"])
        assert parsed is not None and f"{parsed[0]:032x}" not in (CLIENT_TRACE, "0" * 32)
        assert "tracestate" not in sent  # (only a joined trace's state goes on, and only a short one)
    ignoring = await gateway_factory(traced(url, grpc_receiver.endpoint, client_context="ignore"))
    assert (
        await post(ignoring, chat(max_tokens=3), {"traceparent": f"00-{'7' * 32}-{CLIENT_SPAN}-01"})
    ).status_code == 200
    parsed = parse_traceparent(stub.requests[-1].headers["traceparent"])
    assert parsed is not None and f"{parsed[0]:032x}" != "7" * 32
    spans = await grpc_receiver.received.wait_for(f"{parsed[0]:032x}", 3)
    assert by_kind(spans)["server"].parent_id == ""  # a root of its own


async def test_off_by_default_the_clients_trace_headers_pass_through_and_nothing_is_read(
    stub_backend: tuple[StubBackend, str], gateway_factory: GatewayFactory, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="tokengate.access")
    stub, url = stub_backend
    gw = await gateway_factory({"pools": stub_pools(url), "tenants": {"acme": {"keys": ["sk-acme"]}}})
    assert gw.app.tracer is None
    tp = f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"
    assert (await post(gw, chat(max_tokens=3), {"traceparent": tp})).status_code == 200
    assert stub.requests[-1].headers["traceparent"] == tp
    assert access_lines(caplog)[-1]["trace_id"] is None


@pytest.mark.parametrize(
    ("tracing", "message"),
    [
        ({"enabled": "yes"}, "tracing.enabled: expected true or false"),
        ({"protocol": "thrift"}, "tracing.protocol: expected one of 'grpc', 'http/protobuf', got 'thrift'"),
        ({"endpoint": "collector:4317"}, "tracing.endpoint: expected an http:// or https:// URL"),
        ({"sample_ratio": 2}, "tracing.sample_ratio: expected a share of traces between 0 and 1, got 2"),
        ({"client_context": "trust"}, "tracing.client_context: expected one of 'join', 'ignore'"),
        ({"sampler": 1}, "tracing.sampler: unknown key"),
    ],
)
def test_invalid_tracing_sections_name_the_field(tracing: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_config({"tracing": tracing})
    assert str(info.value).startswith(message)


def test_the_environment_fills_what_the_file_leaves_out() -> None:
    from gateway.observe.tracing import TracingSettings

    s = TracingSettings(enabled=True)
    env = {"OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf", "OTEL_TRACES_SAMPLER": "parentbased_traceidratio",
           "OTEL_TRACES_SAMPLER_ARG": "0.25"}  # fmt: skip
    assert s.resolved_protocol(env) == "http/protobuf" and s.resolved_ratio(env) == 0.25
    assert s.resolved_protocol({}) == "grpc" and s.resolved_ratio({}) == 1.0
    assert s.resolved_ratio({"OTEL_TRACES_SAMPLER": "always_off"}) == 0.0
    assert TracingSettings(sample_ratio=0.5).resolved_ratio(env) == 0.5


async def test_a_traced_upstream_continues_the_trace_and_replicas_each_make_one_trace_per_request(
    stub_backend: tuple[StubBackend, str], gateway_factory: GatewayFactory, grpc_receiver: GrpcReceiver
) -> None:
    """Gateway A in front of gateway B (a traced upstream, as a vLLM with --otlp-traces-endpoint
    would be) in front of the stub: one trace, B's server span the child of A's upstream span; and
    two replicas side by side make one trace of three spans per request, never more."""
    stub, url = stub_backend
    b = await gateway_factory(
        {
            "pools": stub_pools(url),
            "tracing": {"enabled": True, "endpoint": grpc_receiver.endpoint, "service_name": "gw-b"},
        }
    )
    a_config = traced(url, grpc_receiver.endpoint, service_name="gw-a")
    a_config["pools"] = {
        "default": {"backends": [{"url": b.url, "capacity_tokens": 2000, "models": ["stub-model"]}]}
    }
    a = await gateway_factory(a_config)
    trace = "8" * 32
    assert (
        await post(a, chat(max_tokens=3), {"traceparent": f"00-{trace}-{CLIENT_SPAN}-01"})
    ).status_code == 200
    spans = await grpc_receiver.received.wait_for(trace, 6)
    assert len(spans) == 6
    mine = {(s.service, s.kind): s for s in spans}
    assert mine["gw-a", "server"].parent_id == CLIENT_SPAN
    assert mine["gw-b", "server"].parent_id == mine["gw-a", "client"].span_id
    assert mine["gw-b", "client"].parent_id == mine["gw-b", "server"].span_id
    sent = parse_traceparent(stub.requests[-1].headers["traceparent"])
    assert sent == (int(trace, 16), int(mine["gw-b", "client"].span_id, 16), True)

    # Two replicas of one fleet, requests spread over both: each request one trace of three spans.
    replicas = [
        await gateway_factory(traced(url, grpc_receiver.endpoint, service_name=f"r{i}")) for i in range(2)
    ]
    traces = [f"{i + 1:032x}" for i in range(10)]
    for i, t in enumerate(traces):
        assert (
            await post(replicas[i % 2], chat(max_tokens=2), {"traceparent": f"00-{t}-{CLIENT_SPAN}-01"})
        ).status_code == 200
    for i, t in enumerate(traces):
        got = await grpc_receiver.received.wait_for(t, 3)
        assert len(got) == 3 and {s.service for s in got} == {f"r{i % 2}"}
    await asyncio.sleep(0.1)
    assert all(len(grpc_receiver.received.trace(t)) == 3 for t in traces)


async def test_the_trace_receiver_command_prints_each_span_as_a_json_line(
    stub_backend: tuple[StubBackend, str], gateway_factory: GatewayFactory
) -> None:
    _, url = stub_backend
    port = free_port()
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "gateway.cli", "trace-receiver", "--port", str(port),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, env=child_env(), cwd=repo_root(),
    )  # fmt: skip
    try:
        assert proc.stderr is not None and proc.stdout is not None
        assert b"OTLP/gRPC on 127.0.0.1:" in await asyncio.wait_for(proc.stderr.readline(), 30)
        gw = await gateway_factory(traced(url, f"http://127.0.0.1:{port}", service_name="gw-cli"))
        trace = "9" * 32
        assert (
            await post(gw, chat(max_tokens=3), {"traceparent": f"00-{trace}-{CLIENT_SPAN}-01"})
        ).status_code == 200
        lines = [orjson.loads(await asyncio.wait_for(proc.stdout.readline(), 10)) for _ in range(3)]
        assert {line["trace_id"] for line in lines} == {trace} and {line["service"] for line in lines} == {
            "gw-cli"
        }
        server = next(line for line in lines if line["kind"] == "server")
        assert server["parent_id"] == CLIENT_SPAN and server["attributes"]["tokengate.tenant"] == "acme"
        assert server["duration_ms"] > 0
    finally:
        proc.terminate()
        assert await asyncio.wait_for(proc.wait(), 10) == 0


async def test_a_prompt_priced_on_an_estimate_carries_the_estimates_error(
    stub_backend: tuple[StubBackend, str], gateway_factory: GatewayFactory, grpc_receiver: GrpcReceiver
) -> None:
    from tests.gateway.test_gw_estimates import ask, config, exact_prefill, train

    _, url = stub_backend
    gw = await gateway_factory(
        {**config(url), "tracing": {"enabled": True, "endpoint": grpc_receiver.endpoint}}
    )
    rng = random.Random(5)
    hostile = "".join(chr(rng.randrange(0x4E00, 0x9FFF)) for _ in range(25_000))  # dense: estimated low
    async with httpx.AsyncClient(base_url=gw.url, timeout=30) as c:
        await train(c, rng)
        trace = "e" * 32
        r = await ask(c, hostile, traceparent=f"00-{trace}-{CLIENT_SPAN}-01", **{"x-stub-delay": "1.0"})
    assert r.status_code == 200
    server = by_kind(await grpc_receiver.received.wait_for(trace, 3))["server"]
    error = server.attributes["tokengate.estimate_error"]
    assert error > 0.5  # counted far above its estimate
    assert server.attributes["tokengate.cost"] >= await exact_prefill(hostile)

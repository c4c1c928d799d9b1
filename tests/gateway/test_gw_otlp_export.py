"""The OTLP exporter (``gateway.observe.otlp_export``) against real receivers on loopback: grpcio's
gRPC server and raw HTTP/1.1 servers that answer as collectors do (kept alive, chunked, closing,
refusing). What it must hold: every span sent once, in batches over one kept connection; a big
batch through HTTP/2 flow control; a receiver that restarts costs no batch; a refusing, absent or
stalled receiver is counted, logged once and never reaches the caller; a full queue drops new
requests and counts them; closing sends what waits."""

from __future__ import annotations

import asyncio
import gzip
import logging
import threading
from collections.abc import AsyncIterator, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc
import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
from opentelemetry.proto.trace.v1 import trace_pb2

from gateway.observe import otlp
from gateway.observe.otlp_export import Exporter, ExportSettings
from tests.conftest import free_port
from tests.support import eventually

RESOURCE = otlp.encode_resource([("service.name", "test")])
SCOPE = otlp.encode_scope("tokengate", None)


def span(n: int, pad: int = 0) -> bytes:
    """A span carrying its number (``n``) and ``pad`` bytes of attribute, written by the official
    protos (what the exporter sends is the caller's bytes as they are)."""
    return trace_pb2.Span(
        trace_id=(n + 1).to_bytes(16, "big"),
        span_id=(n + 1).to_bytes(8, "big"),
        name="s",
        kind=trace_pb2.Span.SPAN_KIND_SERVER,
        start_time_unix_nano=1,
        end_time_unix_nano=2,
        attributes=[
            KeyValue(key="n", value=AnyValue(int_value=n)),
            KeyValue(key="pad", value=AnyValue(string_value="x" * pad)),
        ],
    ).SerializeToString()


def numbers(request: trace_service_pb2.ExportTraceServiceRequest) -> list[int]:
    return [
        next(a.value.int_value for a in s.attributes if a.key == "n")
        for rs in request.resource_spans
        for ss in rs.scope_spans
        for s in ss.spans
    ]


def settings(protocol: str, endpoint: str, **env: str) -> ExportSettings:
    return ExportSettings.resolve(protocol, endpoint, {"OTEL_BSP_SCHEDULE_DELAY": "20", **env})


def exporter(s: ExportSettings, pad: int = 0) -> Exporter[int]:
    return Exporter(s, RESOURCE, SCOPE, lambda n: [span(n, pad)])


class GrpcCollector:
    """``TraceService/Export`` on grpcio's server (what the OpenTelemetry Collector speaks), keeping
    the span numbers it took; ``refuse`` makes it answer with that status instead."""

    def __init__(self, port: int = 0) -> None:
        self.got: list[int] = []
        self.calls = 0
        self.refuse: grpc.StatusCode | None = None
        self._lock = threading.Lock()

        def export(request: bytes, context: grpc.ServicerContext) -> bytes:
            with self._lock:
                self.calls += 1
            if self.refuse is not None:
                context.abort(self.refuse, "the collector is overloaded")
            parsed = trace_service_pb2.ExportTraceServiceRequest.FromString(request)
            with self._lock:
                self.got += numbers(parsed)
            return trace_service_pb2.ExportTraceServiceResponse().SerializeToString()

        handler = grpc.method_handlers_generic_handler(
            "opentelemetry.proto.collector.trace.v1.TraceService",
            {"Export": grpc.unary_unary_rpc_method_handler(export)},
        )
        self._server = grpc.server(ThreadPoolExecutor(max_workers=2), options=[("grpc.so_reuseport", 0)])
        self._server.add_generic_rpc_handlers((handler,))
        self.port = self._server.add_insecure_port(f"127.0.0.1:{port}")
        self._server.start()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        self._server.stop(grace=None).wait(5)


@pytest.fixture
def collector() -> Iterator[GrpcCollector]:
    c = GrpcCollector()
    try:
        yield c
    finally:
        c.stop()


class HttpCollector:
    """``POST /v1/traces`` on a raw asyncio server, answering as ``answer`` says: ``keep`` (kept
    alive, Content-Length), ``chunked``, ``close`` (Connection: close), ``refuse`` (503) or
    ``stall`` (never answers)."""

    def __init__(self, answer: str = "keep") -> None:
        self.answer = answer
        self.got: list[int] = []
        self.connections = 0
        self._server: asyncio.Server | None = None
        self._writers: list[asyncio.StreamWriter] = []

    async def start(self) -> HttpCollector:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return self

    @property
    def endpoint(self) -> str:
        assert self._server is not None
        return f"http://127.0.0.1:{self._server.sockets[0].getsockname()[1]}/v1/traces"

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        self._writers.append(writer)
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = next(
                    int(line.split(b":", 1)[1])
                    for line in head.split(b"\r\n")
                    if line.lower().startswith(b"content-length:")
                )
                body = await reader.readexactly(length)
                if b"content-encoding: gzip" in head.lower():
                    body = gzip.decompress(body)
                if self.answer == "stall":
                    await asyncio.sleep(3600)
                if self.answer == "refuse":
                    writer.write(b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 4\r\n\r\nbusy")
                    continue
                self.got += numbers(trace_service_pb2.ExportTraceServiceRequest.FromString(body))
                out = trace_service_pb2.ExportTraceServiceResponse().SerializeToString()
                if self.answer == "chunked":
                    chunks = b"".join(
                        b"%x\r\n%s\r\n" % (len(out[i : i + 1]), out[i : i + 1]) for i in range(len(out))
                    )
                    writer.write(
                        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + chunks + b"0\r\n\r\n"
                    )
                elif self.answer == "close":
                    writer.write(
                        b"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: %d\r\n\r\n%s"
                        % (len(out), out)
                    )
                    await writer.drain()
                    writer.close()
                    return
                else:
                    writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(out), out))
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            for w in self._writers:
                w.close()
            await self._server.wait_closed()


@pytest.fixture
async def http_collector() -> AsyncIterator[HttpCollector]:
    c = await HttpCollector().start()
    try:
        yield c
    finally:
        await c.stop()


async def add_all(exp: Exporter[int], ns: Sequence[int]) -> None:
    for n in ns:
        exp.add(n)
        if n % 64 == 0:
            await asyncio.sleep(0)  # (as requests end: the loop turns between them)


async def test_every_span_arrives_once_in_batches_over_one_http2_connection(collector: GrpcCollector) -> None:
    exp = exporter(settings("grpc", collector.endpoint, OTEL_BSP_MAX_EXPORT_BATCH_SIZE="100"))
    await add_all(exp, range(1000))
    await eventually(lambda: len(collector.got) == 1000, timeout_s=10)
    await exp.close()
    assert sorted(collector.got) == list(range(1000))
    assert collector.calls >= 10  # batches of at most 100
    assert exp.sender.connections == 1
    assert (exp.exported, exp.failed, exp.dropped) == (1000, 0, 0)


async def test_a_batch_far_past_the_receivers_flow_control_window_goes_through(
    collector: GrpcCollector,
) -> None:
    # ~1.5 MB in one call: over twenty times HTTP/2's initial 64 KiB window.
    exp = exporter(settings("grpc", collector.endpoint, OTEL_BSP_MAX_EXPORT_BATCH_SIZE="1500"), pad=1000)
    await add_all(exp, range(1500))
    await exp.close()
    assert sorted(collector.got) == list(range(1500))
    assert collector.calls == 1
    assert exp.failed == 0


async def test_gzip_over_grpc_and_http(collector: GrpcCollector, http_collector: HttpCollector) -> None:
    for endpoint, protocol, got in ((collector.endpoint, "grpc", collector.got),
                                    (http_collector.endpoint, "http/protobuf", http_collector.got)):  # fmt: skip
        exp = exporter(settings(protocol, endpoint, OTEL_EXPORTER_OTLP_COMPRESSION="gzip"), pad=200)
        await add_all(exp, range(50))
        await exp.close()
        assert sorted(got) == list(range(50)), protocol


async def test_an_answer_sent_with_goodbye_and_a_ping_in_one_write_counts() -> None:
    """A receiver shutting down writes the call's answer, GOAWAY and a PING at once; h2 refuses the
    PING after GOAWAY and, given the write whole, drops the answer before it too: the exporter
    counted a delivered batch as failed. Read frame by frame, the answer counts."""
    from h2.config import H2Configuration
    from h2.connection import H2Connection
    from h2.events import RequestReceived, StreamEnded

    async def answer_and_leave(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        conn = H2Connection(H2Configuration(client_side=False, header_encoding=None))
        conn.initiate_connection()
        writer.write(conn.data_to_send())
        sid = None
        while (data := await reader.read(65536)) != b"":
            for ev in conn.receive_data(data):
                if isinstance(ev, RequestReceived):
                    sid = ev.stream_id
                elif isinstance(ev, StreamEnded) and sid is not None:
                    conn.send_headers(sid, [(b":status", b"200"), (b"content-type", b"application/grpc")])
                    conn.send_data(sid, b"\x00\x00\x00\x00\x00")
                    conn.send_headers(sid, [(b"grpc-status", b"0")], end_stream=True)
                    conn.close_connection()
                    ping = (
                        b"\x00\x00\x08\x06\x00\x00\x00\x00\x00" + b"12345678"
                    )  # (h2 sends none after GOAWAY)
                    writer.write(conn.data_to_send() + ping)  # the answer, GOAWAY and PING: one write
                    await writer.drain()
                    writer.close()
                    return
            writer.write(conn.data_to_send())

    server = await asyncio.start_server(answer_and_leave, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    exp = exporter(settings("grpc", f"http://127.0.0.1:{port}"))
    try:
        await add_all(exp, range(10))
        await exp.close()
        assert (exp.exported, exp.failed) == (10, 0)
    finally:
        server.close()


async def test_a_collector_that_restarts_between_batches_costs_no_batch() -> None:
    first = GrpcCollector()
    port = first.port
    exp = exporter(settings("grpc", first.endpoint))
    try:
        await add_all(exp, range(10))
        # Answered, not just received: a collector stopped before its answer is out fails the call.
        await eventually(lambda: exp.exported == 10, timeout_s=10)
        first.stop()  # the kept connection is closed under the exporter while it is idle
        second = GrpcCollector(port)
        try:
            await add_all(exp, range(10, 20))
            await exp.close()
            assert sorted(second.got) == list(range(10, 20))
            assert exp.failed == 0 and exp.sender.connections == 2
        finally:
            second.stop()
    finally:
        first.stop()


async def test_a_refusing_collector_is_counted_and_logged_once_and_never_reaches_the_caller(
    collector: GrpcCollector, caplog: pytest.LogCaptureFixture
) -> None:
    collector.refuse = grpc.StatusCode.RESOURCE_EXHAUSTED
    exp = exporter(settings("grpc", collector.endpoint, OTEL_BSP_MAX_EXPORT_BATCH_SIZE="10"))
    with caplog.at_level(logging.WARNING, logger="tokengate.tracing"):
        await add_all(exp, range(50))
        await exp.close()
    assert (exp.exported, exp.failed) == (0, 50)
    warnings = [r.getMessage() for r in caplog.records if r.name == "tokengate.tracing"]
    assert len(warnings) == 1, warnings  # once a minute, not once a batch
    assert "gRPC status 8" in warnings[0] and "the collector is overloaded" in warnings[0]
    # The same exporter recovers when the collector does.
    collector.refuse = None
    exp = exporter(settings("grpc", collector.endpoint))
    await add_all(exp, range(5))
    await exp.close()
    assert sorted(collector.got) == list(range(5))


@pytest.mark.parametrize("protocol", ["grpc", "http/protobuf"])
async def test_nothing_listening_is_counted_and_closing_does_not_hang(protocol: str) -> None:
    endpoint = f"http://127.0.0.1:{free_port()}"
    exp = exporter(settings(protocol, endpoint, OTEL_EXPORTER_OTLP_TIMEOUT="500"))
    await add_all(exp, range(20))
    await asyncio.wait_for(exp.close(), 5)
    assert (exp.exported, exp.failed) == (0, 20)


async def test_a_stalled_collector_fills_the_queue_then_new_requests_are_dropped_and_counted() -> None:
    stalled = await HttpCollector("stall").start()
    try:
        s = settings("http/protobuf", stalled.endpoint, OTEL_EXPORTER_OTLP_TIMEOUT="300",
                     OTEL_BSP_MAX_QUEUE_SIZE="100", OTEL_BSP_MAX_EXPORT_BATCH_SIZE="50")  # fmt: skip
        exp = exporter(s)
        loop = asyncio.get_running_loop()
        started = loop.time()
        for n in range(1000):
            exp.add(n)  # never waits for the receiver
        assert loop.time() - started < 0.5
        await asyncio.wait_for(exp.close(), 10)
        assert exp.dropped > 0
        assert exp.exported == 0 and exp.failed + exp.dropped == 1000
    finally:
        await stalled.stop()


@pytest.mark.parametrize("answer", ["keep", "chunked", "close"])
async def test_http_answers_kept_alive_chunked_or_closing(answer: str) -> None:
    c = await HttpCollector(answer).start()
    try:
        exp = exporter(settings("http/protobuf", c.endpoint, OTEL_BSP_MAX_EXPORT_BATCH_SIZE="10"))
        await add_all(exp, range(100))
        await exp.close()
        assert sorted(c.got) == list(range(100))
        assert exp.failed == 0
        # Kept alive: one connection for ten batches; a collector that closes after each, one each.
        assert c.connections == (10 if answer == "close" else 1)
    finally:
        await c.stop()


async def test_an_http_error_status_is_a_failure() -> None:
    c = await HttpCollector("refuse").start()
    try:
        exp = exporter(settings("http/protobuf", c.endpoint))
        await add_all(exp, range(10))
        await exp.close()
        assert (exp.exported, exp.failed) == (0, 10)
    finally:
        await c.stop()


async def test_closing_sends_what_waits_and_a_request_that_cannot_be_encoded_loses_only_its_spans(
    http_collector: HttpCollector,
) -> None:
    s = settings("http/protobuf", http_collector.endpoint, OTEL_BSP_SCHEDULE_DELAY="60000")

    def encode(n: int) -> list[bytes]:
        if n == 7:
            raise ValueError("not encodable")
        return [span(n)]

    exp: Exporter[int] = Exporter(s, RESOURCE, SCOPE, encode)
    await add_all(exp, range(20))
    await asyncio.sleep(0.1)
    assert http_collector.got == []  # neither a full batch nor the schedule yet
    await exp.close()
    assert sorted(http_collector.got) == [n for n in range(20) if n != 7]
    exp.add(99)  # a request that ends after the exporter closed: dropped and counted, never sent
    await asyncio.sleep(0.1)
    assert exp.dropped == 1 and 99 not in http_collector.got


def test_the_settings_follow_the_standard_variables() -> None:
    env: dict[str, Any] = {
        "OTEL_EXPORTER_OTLP_ENDPOINT": "https://collector:4317",
        "OTEL_EXPORTER_OTLP_HEADERS": "api-key=s%20ecret,x=1",
        "OTEL_EXPORTER_OTLP_TIMEOUT": "2500",
        "OTEL_BSP_MAX_QUEUE_SIZE": "64",
    }
    s = ExportSettings.resolve("grpc", None, env)
    assert (s.endpoint, s.secure, s.timeout_s, s.max_queue) == ("collector:4317", True, 2.5, 64)
    assert s.headers == (("api-key", "s ecret"), ("x", "1"))
    h = ExportSettings.resolve("http/protobuf", None, {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318/"})
    assert h.endpoint == "http://c:4318/v1/traces"

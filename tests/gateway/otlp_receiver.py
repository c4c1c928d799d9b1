"""Real OTLP trace receivers for tests, on free loopback ports: gRPC (``TraceService/Export``, the
gateway's own ``tokengate trace-receiver``, served by grpcio) and HTTP/protobuf (``POST /v1/traces``),
both decoding the wire format with the OpenTelemetry protos. Each keeps the spans it received,
flattened."""

from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass, field
from typing import Any

from opentelemetry.proto.collector.trace.v1 import trace_service_pb2
from opentelemetry.proto.common.v1.common_pb2 import AnyValue
from opentelemetry.proto.trace.v1 import trace_pb2

from gateway.observe.trace_receiver import TraceReceiver
from tests.conftest import Served, serve_asgi
from tests.support import eventually

KINDS = {1: "internal", 2: "server", 3: "client", 4: "producer", 5: "consumer"}
STATUS = {0: "unset", 1: "ok", 2: "error"}


def _value(v: AnyValue) -> Any:
    which = v.WhichOneof("value")
    if which == "array_value":
        return [_value(x) for x in v.array_value.values]
    return getattr(v, which) if which else None


@dataclass
class Span:
    name: str
    trace_id: str
    span_id: str
    parent_id: str
    kind: str
    attributes: dict[str, Any]
    events: list[tuple[str, dict[str, Any]]]
    status: str
    start_ns: int
    end_ns: int
    service: str


@dataclass
class Received:
    spans: list[Span] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, request: trace_service_pb2.ExportTraceServiceRequest) -> None:
        out = []
        for rs in request.resource_spans:
            service = next((_value(a.value) for a in rs.resource.attributes if a.key == "service.name"), "")
            for ss in rs.scope_spans:
                for s in ss.spans:
                    out.append(_flatten(s, service))
        with self.lock:
            self.spans.extend(out)

    def trace(self, trace_id: str) -> list[Span]:
        with self.lock:
            return [s for s in self.spans if s.trace_id == trace_id]

    async def wait_for(self, trace_id: str, n: int, timeout_s: float = 10.0) -> list[Span]:
        await eventually(lambda: len(self.trace(trace_id)) >= n, timeout_s=timeout_s, interval_s=0.02,
                         message=f"{n} spans of trace {trace_id} not received")  # fmt: skip
        return self.trace(trace_id)


def _flatten(s: trace_pb2.Span, service: str) -> Span:
    return Span(
        name=s.name,
        trace_id=s.trace_id.hex(),
        span_id=s.span_id.hex(),
        parent_id=s.parent_span_id.hex(),
        kind=KINDS.get(s.kind, str(s.kind)),
        attributes={a.key: _value(a.value) for a in s.attributes},
        events=[(e.name, {a.key: _value(a.value) for a in e.attributes}) for e in s.events],
        status=STATUS.get(s.status.code, str(s.status.code)),
        start_ns=s.start_time_unix_nano,
        end_ns=s.end_time_unix_nano,
        service=service,
    )


class GrpcReceiver:
    """``http://127.0.0.1:<port>``: an OTLP/gRPC trace receiver (the gateway's own,
    ``gateway.observe.trace_receiver``)."""

    def __init__(self) -> None:
        self.received = Received()
        self._receiver = TraceReceiver(self.received.add)

    @property
    def endpoint(self) -> str:
        return self._receiver.endpoint

    def stop(self) -> None:
        self._receiver.stop()


class HttpReceiver:
    """``http://127.0.0.1:<port>/v1/traces``: an OTLP/HTTP trace receiver (binary protobuf)."""

    def __init__(self) -> None:
        self.received = Received()
        self.served: Served | None = None

    async def start(self) -> HttpReceiver:
        self.served = await serve_asgi(self)
        return self

    @property
    def endpoint(self) -> str:
        assert self.served is not None
        return self.served.url

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while True:
                m = await receive()
                if m["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                else:
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        body = b""
        while True:
            m = await receive()
            body += m.get("body", b"")
            if not m.get("more_body"):
                break
        ok = scope["path"] == "/v1/traces" and scope["method"] == "POST"
        if ok:
            await asyncio.to_thread(
                self.received.add, trace_service_pb2.ExportTraceServiceRequest.FromString(body)
            )
        out = trace_service_pb2.ExportTraceServiceResponse().SerializeToString() if ok else b""
        await send({"type": "http.response.start", "status": 200 if ok else 404,
                    "headers": [(b"content-type", b"application/x-protobuf")]})  # fmt: skip
        await send({"type": "http.response.body", "body": out})

    async def stop(self) -> None:
        if self.served is not None:
            await self.served.stop()

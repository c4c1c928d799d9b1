"""``tokengate trace-receiver``: an OTLP/gRPC trace receiver that writes every span it gets as one
JSON line on stdout — the OpenTelemetry Collector's debug exporter, for checking that a gateway's
traces arrive and what they hold, and the compose stack's trace backend where a collector or Jaeger
image cannot be pulled (point a collector at the gateways instead where one can).

    tokengate trace-receiver --port 4317
    {"service":"tokengate","trace_id":"4bf9...","span_id":"...","parent_id":"...","name":"POST /v1/chat/completions",
     "kind":"server","start_unix_nano":...,"duration_ms":12.3,"status":"unset","attributes":{...},"events":[...]}

Needs grpcio and opentelemetry-proto (``pip install 'tokengate[otel]'``). :class:`TraceReceiver` is
the same receiver for code (the overhead benchmark counts spans with it).
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

KINDS = {0: "unspecified", 1: "internal", 2: "server", 3: "client", 4: "producer", 5: "consumer"}
STATUS = {0: "unset", 1: "ok", 2: "error"}


def _value(v: Any) -> Any:
    which = v.WhichOneof("value")
    if which == "array_value":
        return [_value(x) for x in v.array_value.values]
    if which == "kvlist_value":
        return {kv.key: _value(kv.value) for kv in v.kvlist_value.values}
    if which == "bytes_value":
        return v.bytes_value.hex()
    return getattr(v, which) if which else None


def span_records(request: Any) -> Iterator[dict[str, Any]]:
    """Each span of an ``ExportTraceServiceRequest`` as a plain mapping (ids in hex)."""
    for rs in request.resource_spans:
        service = next((_value(a.value) for a in rs.resource.attributes if a.key == "service.name"), None)
        for ss in rs.scope_spans:
            for s in ss.spans:
                yield {
                    "service": service,
                    "trace_id": s.trace_id.hex(),
                    "span_id": s.span_id.hex(),
                    "parent_id": s.parent_span_id.hex() or None,
                    "name": s.name,
                    "kind": KINDS.get(s.kind, str(s.kind)),
                    "start_unix_nano": s.start_time_unix_nano,
                    "end_unix_nano": s.end_time_unix_nano,
                    "duration_ms": round((s.end_time_unix_nano - s.start_time_unix_nano) / 1e6, 3),
                    "status": STATUS.get(s.status.code, str(s.status.code)),
                    "attributes": {a.key: _value(a.value) for a in s.attributes},
                    "events": [
                        {
                            "name": e.name,
                            "time_unix_nano": e.time_unix_nano,
                            "attributes": {a.key: _value(a.value) for a in e.attributes},
                        }
                        for e in s.events
                    ],
                }


class TraceReceiver:
    """OTLP/gRPC ``TraceService/Export`` on ``host:port`` (0: a free port); ``on_request`` gets each
    decoded ``ExportTraceServiceRequest`` (on a receiver thread)."""

    def __init__(self, on_request: Callable[[Any], None], host: str = "127.0.0.1", port: int = 0) -> None:
        import grpc
        from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

        class Servicer(trace_service_pb2_grpc.TraceServiceServicer):
            def Export(self, request: Any, context: Any) -> Any:
                on_request(request)
                return trace_service_pb2.ExportTraceServiceResponse()

        self._server = grpc.server(ThreadPoolExecutor(max_workers=2))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Servicer(), self._server)
        self.port = self._server.add_insecure_port(f"{host}:{port}")
        if not self.port:
            raise OSError(f"cannot listen on {host}:{port}")
        self.host = host
        self._server.start()

    @property
    def endpoint(self) -> str:
        return f"http://{self.host}:{self.port}"

    def stop(self) -> None:
        self._server.stop(grace=None).wait(5)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default="127.0.0.1", help="listen address (0.0.0.0 in a container)")
    p.add_argument("--port", type=int, default=4317, help="OTLP/gRPC port (default 4317)")


def run(args: argparse.Namespace) -> int:
    lock = threading.Lock()

    def write(request: Any) -> None:
        lines = [json.dumps(r, separators=(",", ":")) for r in span_records(request)]
        with lock:
            sys.stdout.write("".join(line + "\n" for line in lines))
            sys.stdout.flush()

    receiver = TraceReceiver(write, args.host, args.port)
    print(f"tokengate trace-receiver: OTLP/gRPC on {args.host}:{receiver.port}", file=sys.stderr, flush=True)
    done = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: done.set())
    done.wait()
    receiver.stop()
    return 0


__all__ = ["TraceReceiver", "add_arguments", "run", "span_records"]

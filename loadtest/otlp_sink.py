"""An OTLP/gRPC trace receiver that counts what it gets: the far end of the overhead benchmark's
traced gateway (``python -m loadtest.bench.overhead --tracing``). Started in the benchmark's own
process, on a free loopback port, so none of its CPU is charged to the gateway."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any


class OtlpSink:
    def __init__(self) -> None:
        import grpc
        from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

        sink = self
        self.spans = 0
        self.exports = 0
        self._lock = threading.Lock()

        class Servicer(trace_service_pb2_grpc.TraceServiceServicer):
            def Export(self, request: Any, context: Any) -> Any:
                n = sum(len(ss.spans) for rs in request.resource_spans for ss in rs.scope_spans)
                with sink._lock:
                    sink.spans += n
                    sink.exports += 1
                return trace_service_pb2.ExportTraceServiceResponse()

        self._server = grpc.server(ThreadPoolExecutor(max_workers=2))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Servicer(), self._server)
        self.port = self._server.add_insecure_port("127.0.0.1:0")
        self._server.start()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        self._server.stop(grace=None).wait(5)

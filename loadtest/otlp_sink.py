"""An OTLP/gRPC trace receiver that counts what it gets: the far end of the overhead benchmark's
traced gateway (``python -m loadtest.bench.overhead --tracing``). Started in the benchmark's own
process, on a free loopback port, so none of its CPU is charged to the gateway."""

from __future__ import annotations

import threading
from typing import Any

from gateway.observe.trace_receiver import TraceReceiver


class OtlpSink:
    def __init__(self) -> None:
        self.spans = 0
        self.exports = 0
        self._lock = threading.Lock()
        self._receiver = TraceReceiver(self._count)

    def _count(self, request: Any) -> None:
        n = sum(len(ss.spans) for rs in request.resource_spans for ss in rs.scope_spans)
        with self._lock:
            self.spans += n
            self.exports += 1

    @property
    def endpoint(self) -> str:
        return self._receiver.endpoint

    def stop(self) -> None:
        self._receiver.stop()

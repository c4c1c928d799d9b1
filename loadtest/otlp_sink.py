"""An OTLP/gRPC trace receiver that counts what it gets: the far end of the overhead benchmark's
traced gateway (``python -m loadtest.bench.overhead --tracing``).

It runs as a process of its own, as a collector would: inside the benchmark's process its gRPC
threads would take the load generator's GIL during the traced rounds only, slowing the client and
so raising the traced gateway's CPU per request (fewer requests per loop turn) for a reason that
is not the gateway's. Its own CPU is not charged to the gateway.

    python -m loadtest.otlp_sink      # prints its port, then "<spans> <exports> <cpu s>" when stdin closes
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from typing import Any

from loadtest.processes import child_env


class OtlpSink:
    def __init__(self) -> None:
        self.spans = 0
        self.exports = 0
        self.cpu_s = 0.0
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "loadtest.otlp_sink"],
            env=child_env(),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self._proc.stdout is not None
        line = self._proc.stdout.readline()
        if not line.strip().isdigit():
            self._proc.kill()
            raise RuntimeError(f"the OTLP sink did not start: {line!r}")
        self.port = int(line)

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        """Stop the sink and read its counts."""
        out, _ = self._proc.communicate(timeout=30)
        parts = out.split()
        if len(parts) >= 3:
            self.spans, self.exports, self.cpu_s = int(parts[0]), int(parts[1]), float(parts[2])


def main() -> None:
    from gateway.observe.trace_receiver import TraceReceiver

    counts = [0, 0]
    lock = threading.Lock()

    def count(request: Any) -> None:
        n = sum(len(ss.spans) for rs in request.resource_spans for ss in rs.scope_spans)
        with lock:
            counts[0] += n
            counts[1] += 1

    receiver = TraceReceiver(count)
    print(receiver.port, flush=True)
    sys.stdin.read()  # until the benchmark closes it
    receiver.stop()
    print(counts[0], counts[1], time.process_time(), flush=True)


if __name__ == "__main__":
    main()

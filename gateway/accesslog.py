"""One structured access-log line per request (JSON on logger ``tokengate.access``).

The record is filled along the request's path and dumped once with orjson at the end; when
the logger is disabled nothing is formatted. Keys never appear in it.
"""

from __future__ import annotations

import json
import logging
import threading
from dataclasses import dataclass
from typing import TextIO

import orjson

access_log = logging.getLogger("tokengate.access")

# Errors may quote client input; a log line stays one readable line.
_ERROR_LIMIT = 1000
_PATH_LIMIT = 256


@dataclass(slots=True)
class Record:
    method: str
    path: str
    start: float  # perf_counter at arrival
    tenant: str = "-"
    tier: str = "-"
    klass: str = "unclassified"
    pool: str | None = None
    backend: str | None = None
    stream: bool = False
    prefill: int = 0
    decode: int = 0
    status: int = 0
    outcome: str = "ok"
    queue_s: float | None = None
    ttft_s: float | None = None
    backend_s: float | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    error: str | None = None

    def emit(self, end: float) -> None:
        """Write the line; never raises (a value orjson refuses is written as text instead)."""
        if not access_log.isEnabledFor(logging.INFO):
            return
        fields = self.fields(end)
        try:
            line = orjson.dumps(fields).decode()
        except TypeError:  # e.g. an integer beyond 64 bits, or a str with a lone surrogate
            line = json.dumps(fields, default=str, ensure_ascii=True)
        try:
            access_log.info(line)
        except Exception:  # a broken handler must not fail the request's bookkeeping
            logging.getLogger("tokengate").exception("writing the access log failed")

    def fields(self, end: float) -> dict[str, object]:
        return {
            "method": self.method,
            "path": self.path[:_PATH_LIMIT],
            "status": self.status,
            "outcome": self.outcome,
            "tenant": self.tenant,
            "class": self.klass,
            "tier": self.tier,
            "pool": self.pool,
            "backend": self.backend,
            "stream": self.stream,
            "cost": self.prefill + self.decode,
            "prefill": self.prefill,
            "decode": self.decode,
            "queue_ms": _ms(self.queue_s),
            "ttft_ms": _ms(self.ttft_s),
            "backend_ms": _ms(self.backend_s),
            "total_ms": _ms(end - self.start),
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "error": None if self.error is None else self.error[:_ERROR_LIMIT],
        }


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000.0, 2)


class LineHandler(logging.Handler):
    """Writes each record's message as one line, flushing on a timer instead of per line.

    ``logging.StreamHandler`` flushes after every record: one write syscall per request on the
    hot path. Here a daemon thread flushes every ``flush_interval_s`` (a terminal's line-buffered
    stdout still shows each line at once).
    """

    def __init__(self, stream: TextIO, flush_interval_s: float = 0.5) -> None:
        super().__init__()
        self.stream = stream
        self._interval = flush_interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._flush_forever, name="tokengate-access-flush", daemon=True
        )
        self._thread.start()

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.stream.write(record.getMessage() + "\n")
        except Exception:
            self.handleError(record)

    def flush(self) -> None:
        with self.lock if self.lock is not None else _NoLock():
            try:
                self.stream.flush()
            except (OSError, ValueError):
                pass

    def _flush_forever(self) -> None:
        while not self._stop.wait(self._interval):
            self.flush()

    def close(self) -> None:
        self._stop.set()
        self.flush()
        super().close()


class _NoLock:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None

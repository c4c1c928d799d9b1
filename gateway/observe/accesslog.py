"""One structured access-log line per request (on logger ``tokengate.access``).

The record is filled along the request's path and dumped once with orjson at the end; when
the logger is disabled nothing is formatted. Keys never appear in it. The line is the whole log
line, ``timestamp``, ``level``, ``logger`` and ``message`` included (like every other line, see
``gateway.process.logs``), so its handler writes it as it is; ``set_format("text")`` makes it a
``key=value`` line for humans instead.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, TextIO

from gateway.process.logs import LogFormat, dumps, iso_timestamp, text_value

if TYPE_CHECKING:
    from gateway.observe.tracing import TraceContext

access_log = logging.getLogger("tokengate.access")
_NAME = access_log.name
_text = False  # set by set_format: a module flag, read once per line


def set_format(fmt: LogFormat) -> None:
    global _text
    _text = fmt == "text"


# Errors may quote client input; a log line stays one readable line.
_ERROR_LIMIT = 1000
_PATH_LIMIT = 256


@dataclass(slots=True)
class Record:
    method: str
    path: str
    start: float  # perf_counter at arrival
    request_id: str = "-"  # ours, or the client's when trusted (gateway.request.requestid)
    client_request_id: str | None = None  # a client's x-request-id we did not adopt, sanitised
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
    reason: str | None = None  # the error code behind a non-2xx status (queue_timeout, ...)
    queue_s: float | None = None
    ttft_s: float | None = None
    backend_s: float | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    cached_tokens: int | None = None  # of the prompt, served from the engine's prefix cache
    # The engine sent no usage: prompt_tokens is the priced prompt, completion_tokens the output
    # events the stream relayed (gateway.request.usage).
    usage_estimated: bool = False
    extended: int = 0  # output tokens a stream's lease grew by (its reservation was outgrown)
    slot_tokens: int = 0  # of decode, held beyond the reservation: its share of the engine's sequence slots
    overdraft: int = 0  # of those, tokens beyond what its pools had room for
    error: str | None = None
    # Tracing (gateway.observe.tracing), set only while it is on: the request's trace, and what its
    # spans read beyond the fields above.
    trace: TraceContext | None = None
    model: str | None = None
    max_tokens: int | None = None
    granted: bool = False  # its lease was granted
    queued_at: float | None = None  # perf_counter when it asked the budget store
    upstream_at: float | None = None  # perf_counter when the upstream call began
    backend_url: str | None = None
    response_id: str | None = None
    response_model: str | None = None
    finish_reasons: tuple[str, ...] | None = None
    estimate_error: float | None = None  # priced on an estimate: exact / estimated prompt - 1

    def emit(self, end: float) -> None:
        """Write the line; never raises (a value orjson refuses is written as text instead)."""
        if not access_log.isEnabledFor(logging.INFO):
            return
        fields = self.fields(end)
        line = _text_line(fields) if _text else dumps(fields)
        try:
            handler = _sole_line_handler()
            if handler is not None:
                handler.write_line(line)  # what logging would do, without a LogRecord per request
            else:
                access_log.info(line)
        except Exception:  # a broken handler must not fail the request's bookkeeping
            logging.getLogger("tokengate").exception("writing the access log failed")

    def fields(self, end: float) -> dict[str, object]:
        path = self.path[:_PATH_LIMIT]
        return {
            "timestamp": iso_timestamp(time.time()),
            "level": "info",
            "logger": _NAME,
            "message": f"{self.method} {path} {self.status}",
            "request_id": self.request_id,
            "client_request_id": self.client_request_id,
            "method": self.method,
            "path": path,
            "status": self.status,
            "outcome": self.outcome,
            "reason": self.reason,
            "tenant": self.tenant,
            "class": self.klass,
            "tier": self.tier,
            "pool": self.pool,
            "backend": self.backend,
            "stream": self.stream,
            "cost": self.prefill + self.decode,
            "prefill": self.prefill,
            "decode": self.decode,
            # (inline, not a helper: four calls per request)
            "queue_ms": None if self.queue_s is None else round(self.queue_s * 1000.0, 2),
            "ttft_ms": None if self.ttft_s is None else round(self.ttft_s * 1000.0, 2),
            "backend_ms": None if self.backend_s is None else round(self.backend_s * 1000.0, 2),
            "total_ms": round((end - self.start) * 1000.0, 2),
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "usage_estimated": self.usage_estimated or None,
            "slot_tokens": self.slot_tokens or None,
            "extended": self.extended or None,
            "overdraft": self.overdraft or None,
            "error": None if self.error is None else self.error[:_ERROR_LIMIT],
            "trace_id": None if self.trace is None else self.trace.trace_hex,
        }


def _text_line(fields: dict[str, object]) -> str:
    head = f"{fields['timestamp']} INFO {_NAME}: {fields['message']}"
    skip = ("timestamp", "level", "logger", "message", "method", "path", "status")
    return head + "".join(
        f" {k}={text_value(v)}" for k, v in fields.items() if v is not None and k not in skip
    )


def _sole_line_handler() -> LineHandler | None:
    """The access logger's own handler when it is the only place a line can go (as ``tokengate
    serve`` sets it up): then the line is written directly. Anything else (a filter, another or a
    propagating handler, as in tests with ``caplog``) gets the record through ``logging``."""
    handlers = access_log.handlers
    if len(handlers) != 1 or access_log.propagate or access_log.filters:
        return None
    h = handlers[0]
    if type(h) is not LineHandler or h.filters or h.level > logging.INFO:
        return None
    return h


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

    def write_line(self, line: str) -> None:
        """``emit`` for a line that needs no record: under the handler's lock, as ``handle`` takes it."""
        with self.lock if self.lock is not None else _NoLock():
            self.stream.write(line + "\n")

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

"""Log lines: one JSON object per line (the default), or plain text for humans (``--log-format text``).

Every line has ``timestamp`` (UTC, ISO 8601, milliseconds), ``level``, ``logger`` and ``message``;
a record may carry more named fields as ``extra={"fields": {...}}`` (the audit log does), which JSON
lines hold as keys and text lines append as ``key=value``. uvicorn's own loggers go through the same
handler (``setup_logging``), so a log collector never meets a line it cannot parse.

The access log (``tokengate.access``) does not go through these formatters: it builds its whole line
itself, once per request, and is written by its own buffered handler (``gateway.observe.accesslog``).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Mapping
from typing import Any, Literal

import orjson

LogFormat = Literal["json", "text"]
FORMATS: tuple[LogFormat, ...] = ("json", "text")

# (second, its date-time text): one tuple, so a reader on another thread never pairs a second with
# the wrong text.
_cache: tuple[int, str] = (-1, "")


def iso_timestamp(t: float) -> str:
    """``2026-11-30T16:41:51.433Z`` for a ``time.time()`` value; the date part is cached per second
    (the access log calls this once per request)."""
    global _cache
    second = int(t)
    cached_second, prefix = _cache
    if second != cached_second:
        prefix = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(second))
        _cache = (second, prefix)
    return f"{prefix}.{int((t - second) * 1000):03d}Z"


def dumps(obj: Any) -> str:
    """One JSON line; never raises (what orjson refuses, e.g. a lone surrogate, goes through json)."""
    try:
        return orjson.dumps(obj, default=str).decode()
    except TypeError:
        return json.dumps(obj, default=str, ensure_ascii=True)


def text_value(v: Any) -> str:
    if isinstance(v, str):
        plain = v and v.isprintable() and " " not in v and "=" not in v and '"' not in v
        return v if plain else json.dumps(v, ensure_ascii=False)  # quoted, a newline escaped
    return dumps(v) if isinstance(v, Mapping | list | tuple) else str(v)


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        obj: dict[str, Any] = {
            "timestamp": iso_timestamp(record.created),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        fields = getattr(record, "fields", None)
        if isinstance(fields, Mapping):
            for k, v in fields.items():
                obj.setdefault(str(k), v)
        if record.exc_info:
            obj["exception"] = self.formatException(record.exc_info)
        if record.stack_info:
            obj["stack"] = self.formatStack(record.stack_info)
        return dumps(obj)


class TextFormatter(logging.Formatter):
    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s: %(message)s")

    def formatTime(self, record: logging.LogRecord, datefmt: str | None = None) -> str:
        return iso_timestamp(record.created)  # the access log's format: one clock format everywhere

    def formatMessage(self, record: logging.LogRecord) -> str:
        line = super().formatMessage(record)
        fields = getattr(record, "fields", None)
        if isinstance(fields, Mapping) and fields:
            line += " " + " ".join(f"{k}={text_value(v)}" for k, v in fields.items())
        return line


def formatter(fmt: LogFormat) -> logging.Formatter:
    return JsonFormatter() if fmt == "json" else TextFormatter()


__all__ = ["FORMATS", "JsonFormatter", "LogFormat", "TextFormatter", "dumps", "formatter", "iso_timestamp"]

"""OTLP trace export without the SDK: spans written straight into the protobuf wire format, batched,
and sent by a thread of their own over gRPC (``TraceService/Export``, grpcio with the bytes as they
are) or HTTP/protobuf (``POST .../v1/traces``).

Why not the OpenTelemetry SDK: its encoder builds each span's protobuf message attribute by
attribute in Python, ~60 µs per span here — three spans cost a traced request about as much CPU
as the whole request costs the gateway. Written directly, with every attribute's key (and every
string value seen before) encoded once and reused, a request's three spans cost a few µs. The
wire format is the one in opentelemetry-proto (``trace/v1/trace.proto``, ``common/v1/common.proto``);
the tests decode what the exporter sends with those protos.

The exporter follows the standard variables where the config leaves a value out:
``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` / ``OTEL_EXPORTER_OTLP_ENDPOINT`` (HTTP: the base URL, to which
``/v1/traces`` is added), ``..._HEADERS`` (``k=v,k2=v2``), ``..._TIMEOUT`` (ms), ``..._COMPRESSION``
(``gzip``), ``..._INSECURE`` (gRPC), ``OTEL_BSP_SCHEDULE_DELAY`` (ms between exports),
``OTEL_BSP_MAX_QUEUE_SIZE`` (spans kept while the receiver is slow; the rest are dropped and
counted), ``OTEL_BSP_MAX_EXPORT_BATCH_SIZE``, ``OTEL_RESOURCE_ATTRIBUTES``.
"""

from __future__ import annotations

import gzip
import logging
import struct
import threading
import time
import urllib.request
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote, urlsplit

log = logging.getLogger("tokengate.tracing")

# The tag of Span.attributes (field 9, length-delimited): what Attributes.encode takes for a span.
SPAN_ATTRIBUTES = b"\x4a"
# SpanKind and Status.code, as the protos number them.
INTERNAL, SERVER, CLIENT = 1, 2, 3
UNSET, ERROR = 0, 2

_EXPORT_METHOD = "/opentelemetry.proto.collector.trace.v1.TraceService/Export"
_MASK64 = (1 << 64) - 1
_pack_d = struct.Struct("<d").pack
_pack_q = struct.Struct("<Q").pack


def _varint(n: int) -> bytes:
    n &= _MASK64  # (a negative int64 is its two's complement, ten bytes)
    if n < 0x80:
        return bytes((n,))
    out = bytearray()
    while n >= 0x80:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _field(tag: bytes, payload: bytes) -> bytes:
    """A length-delimited field: its tag, the length, the bytes."""
    return tag + _varint(len(payload)) + payload


def _str(tag: bytes, s: str) -> bytes:
    return _field(tag, s.encode("utf-8", "replace"))


class Attributes:
    """Encoded ``KeyValue`` fields (as the ``tag`` field of their message), cached: the key of each
    attribute once, and a string attribute's whole encoding per value (a bounded cache: tenants,
    classes, pools and models repeat)."""

    # Values unique to a request: never cached (they would only push the repeating ones out).
    UNIQUE = frozenset({"tokengate.request_id", "gen_ai.response.id"})

    def __init__(self, limit: int = 8192) -> None:
        self._keys: dict[str, bytes] = {}
        self._strings: dict[tuple[bytes, str, Any], bytes] = {}  # strings, and ints (counts repeat)
        self._names: dict[str, bytes] = {}
        self._limit = limit

    def _key(self, key: str) -> bytes:
        k = self._keys.get(key)
        if k is None:
            k = self._keys[key] = _str(b"\x0a", key)
        return k

    def encode(self, tag: bytes, attrs: Sequence[tuple[str, Any]]) -> bytes:
        out = []
        strings = self._strings
        keys = self._keys
        unique = self.UNIQUE
        for key, value in attrs:
            kind = type(value)
            if kind is str:
                if key not in unique:
                    hit = strings.get((tag, key, value))
                    if hit is not None:
                        out.append(hit)
                        continue
                kv = self._key(key) + _field(b"\x12", _str(b"\x0a", value))
                if key not in unique:
                    if len(strings) >= self._limit:
                        strings.clear()
                    strings[(tag, key, value)] = tag + _varint(len(kv)) + kv
            else:
                if kind is int:
                    hit = strings.get((tag, key, value))
                    if hit is not None:
                        out.append(hit)
                        continue
                    any_value = b"\x18" + _varint(value)
                elif kind is float:
                    any_value = b"\x21" + _pack_d(value)
                elif kind is bool:
                    any_value = b"\x10\x01" if value else b"\x10\x00"
                elif isinstance(value, (list, tuple)):
                    any_value = _field(
                        b"\x2a", b"".join(_field(b"\x0a", _str(b"\x0a", str(v))) for v in value)
                    )
                else:
                    any_value = _str(b"\x0a", str(value))
                k = keys.get(key)
                if k is None:
                    k = self._key(key)
                n = len(any_value)
                kv = k + (b"\x12" + bytes((n,)) + any_value if n < 0x80 else _field(b"\x12", any_value))
            n = len(kv)
            field = tag + bytes((n,)) + kv if n < 0x80 else tag + _varint(n) + kv
            if kind is int and key not in unique:
                if len(strings) >= self._limit:
                    strings.clear()
                strings[(tag, key, value)] = field
            out.append(field)
        return b"".join(out)

    def name(self, tag: bytes, name: str) -> bytes:
        """A string field of ``tag`` (span and event names), encoded once per name (bounded)."""
        hit = self._names.get(name)
        if hit is None:
            if len(self._names) >= self._limit:
                self._names.clear()
            hit = self._names[name] = _str(tag, name)
        return hit


@dataclass(frozen=True, slots=True)
class Event:
    name: str
    time_ns: int
    attributes: Sequence[tuple[str, Any]] = ()


_TIMES = struct.Struct("<BQBQ")  # start_time_unix_nano (field 7) and end (field 8), fixed64 each
_KIND = {k: b"\x30" + bytes((k,)) for k in range(6)}
_SAMPLED = b"\x85\x01\x01\x00\x00\x00"  # flags (field 16, fixed32): W3C sampled
_EVENT_TIME = struct.Struct("<BQ")


def encode_span(
    attrs: Attributes,
    *,
    trace_id: int,
    span_id: int,
    parent_id: int | None,
    name: str,
    kind: int,
    start_ns: int,
    end_ns: int,
    attributes: bytes,
    events: Sequence[Event] = (),
    status: int = UNSET,
    status_message: str | None = None,
) -> bytes:
    """One sampled ``Span`` message's bytes (not yet wrapped as a ``ScopeSpans.spans`` field);
    ``attributes`` already encoded as its fields (``attrs.encode(SPAN_ATTRIBUTES, ...)``), so what
    several spans share is encoded once."""
    out = b"\x0a\x10" + trace_id.to_bytes(16, "big") + b"\x12\x08" + span_id.to_bytes(8, "big")
    if parent_id is not None:
        out += b"\x22\x08" + parent_id.to_bytes(8, "big")
    out += attrs.name(b"\x2a", name) + _KIND[kind] + _TIMES.pack(0x39, start_ns, 0x41, end_ns) + attributes
    for e in events:
        body = _EVENT_TIME.pack(0x09, e.time_ns) + attrs.name(b"\x12", e.name)
        if e.attributes:
            body += attrs.encode(b"\x1a", e.attributes)
        out += b"\x5a" + bytes((len(body),)) + body if len(body) < 0x80 else _field(b"\x5a", body)
    if status or status_message:
        st = (_str(b"\x12", status_message) if status_message else b"") + (
            b"\x18" + _varint(status) if status else b""
        )
        out += _field(b"\x7a", st)
    return out + _SAMPLED


def export_request(resource: bytes, scope: bytes, spans: Sequence[bytes]) -> bytes:
    """``ExportTraceServiceRequest`` bytes: one ResourceSpans, one ScopeSpans holding ``spans``
    (``resource`` and ``scope`` already encoded messages)."""
    scope_spans = _field(b"\x0a", scope) + b"".join(_field(b"\x12", s) for s in spans)
    resource_spans = _field(b"\x0a", resource) + _field(b"\x12", scope_spans)
    return _field(b"\x0a", resource_spans)


def encode_resource(attributes: Sequence[tuple[str, Any]]) -> bytes:
    return Attributes().encode(b"\x0a", attributes)


def encode_scope(name: str, version: str | None) -> bytes:
    return _str(b"\x0a", name) + (_str(b"\x12", version) if version else b"")


# ---- the exporter ----


def _env(env: Mapping[str, str], name: str) -> str | None:
    """``OTEL_EXPORTER_OTLP_TRACES_<name>``, else ``OTEL_EXPORTER_OTLP_<name>``."""
    v = env.get(f"OTEL_EXPORTER_OTLP_TRACES_{name}") or env.get(f"OTEL_EXPORTER_OTLP_{name}")
    return v.strip() if v else None


def _int_env(env: Mapping[str, str], name: str, default: int) -> int:
    try:
        return max(1, int(env.get(name, "") or default))
    except ValueError:
        return default


def parse_pairs(value: str | None) -> list[tuple[str, str]]:
    """``k=v,k2=v2`` (values URL-encoded), as OTEL_EXPORTER_OTLP_HEADERS and OTEL_RESOURCE_ATTRIBUTES
    spell them; malformed items are skipped."""
    out = []
    for item in (value or "").split(","):
        k, sep, v = item.partition("=")
        if sep and k.strip():
            out.append((unquote(k.strip()), unquote(v.strip())))
    return out


@dataclass(frozen=True, slots=True)
class ExportSettings:
    protocol: str  # grpc | http/protobuf
    endpoint: str  # gRPC: host:port target (with secure); HTTP: the full URL of /v1/traces
    secure: bool
    headers: tuple[tuple[str, str], ...]
    timeout_s: float
    gzip: bool
    schedule_s: float
    max_queue: int
    max_batch: int

    @classmethod
    def resolve(cls, protocol: str, endpoint: str | None, env: Mapping[str, str]) -> ExportSettings:
        raw = _env(env, "TIMEOUT")
        timeout_ms = int(raw) if raw and raw.isdigit() and int(raw) > 0 else 10_000
        headers = tuple(parse_pairs(_env(env, "HEADERS")))
        compress = (_env(env, "COMPRESSION") or "").lower() == "gzip"
        if protocol == "grpc":
            url = endpoint or _env(env, "ENDPOINT") or "http://localhost:4317"
            u = urlsplit(url if "://" in url else "http://" + url)
            insecure = (_env(env, "INSECURE") or "").lower() == "true"
            target = f"{u.hostname or 'localhost'}:{u.port or 4317}"
            secure = u.scheme == "https" and not insecure
        else:
            own = env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
            if endpoint:
                target = (
                    endpoint
                    if endpoint.rstrip("/").endswith("/v1/traces")
                    else endpoint.rstrip("/") + "/v1/traces"
                )
            elif own:
                target = own.strip()  # (the traces variable is the whole URL)
            else:
                base = env.get("OTEL_EXPORTER_OTLP_ENDPOINT", "").strip() or "http://localhost:4318"
                target = base.rstrip("/") + "/v1/traces"
            secure = target.startswith("https://")
        return cls(
            protocol=protocol,
            endpoint=target,
            secure=secure,
            headers=headers,
            timeout_s=timeout_ms / 1000.0,
            gzip=compress,
            schedule_s=_int_env(env, "OTEL_BSP_SCHEDULE_DELAY", 5000) / 1000.0,
            max_queue=_int_env(env, "OTEL_BSP_MAX_QUEUE_SIZE", 2048),
            max_batch=_int_env(env, "OTEL_BSP_MAX_EXPORT_BATCH_SIZE", 512),
        )


class Exporter:
    """Encoded spans in, OTLP requests out, from a daemon thread: every ``schedule_s``, or as soon
    as a batch is full. ``add`` never blocks and never raises: past ``max_queue`` waiting spans the
    newest are dropped (and counted)."""

    def __init__(self, settings: ExportSettings, resource: bytes, scope: bytes) -> None:
        self.settings = settings
        self._resource, self._scope = resource, scope
        self._queue: deque[bytes] = deque()
        self._wake = threading.Event()
        self._stop = False
        self.exported = 0
        self.dropped = 0
        self.failed = 0
        self._last_error = 0.0
        self._send = self._grpc_sender() if settings.protocol == "grpc" else self._http_send
        self._thread = threading.Thread(target=self._run, name="tokengate-otlp", daemon=True)
        self._thread.start()

    def add(self, spans: Sequence[bytes]) -> None:
        q = self._queue
        if len(q) + len(spans) > self.settings.max_queue:
            self.dropped += len(spans)
            return
        q.extend(spans)
        if len(q) >= self.settings.max_batch:
            self._wake.set()

    def close(self) -> None:
        """Send what is queued (each call bounded by the export timeout), then stop the thread."""
        self._stop = True
        self._wake.set()
        self._thread.join(self.settings.timeout_s * 2 + 1)
        channel = getattr(self, "_channel", None)
        if channel is not None:
            channel.close()

    def _run(self) -> None:
        s = self.settings
        while True:
            self._wake.wait(s.schedule_s)
            self._wake.clear()
            while self._queue:
                batch: list[bytes] = []
                q = self._queue
                while q and len(batch) < s.max_batch:
                    batch.append(q.popleft())
                self._export(batch)
                if not self._stop and len(q) < s.max_batch:
                    break  # (a full batch goes at once; a partial one waits for the schedule)
            if self._stop:
                return

    def _export(self, spans: list[bytes]) -> None:
        body = export_request(self._resource, self._scope, spans)
        try:
            self._send(body)
            self.exported += len(spans)
        except Exception as exc:  # the receiver's trouble must never reach a request
            self.failed += len(spans)
            now = time.monotonic()
            if now - self._last_error > 60:
                self._last_error = now
                log.warning(
                    "exporting %d spans to %s failed: %s: %s (more failures are counted, logged once a minute)",
                    len(spans),
                    self.settings.endpoint,
                    type(exc).__name__,
                    exc,
                )

    def _http_send(self, body: bytes) -> None:
        s = self.settings
        headers = {"Content-Type": "application/x-protobuf", **dict(s.headers)}
        if s.gzip:
            body = gzip.compress(body)
            headers["Content-Encoding"] = "gzip"
        req = urllib.request.Request(s.endpoint, data=body, headers=headers, method="POST")
        with urllib.request.urlopen(req, timeout=s.timeout_s) as resp:
            resp.read()

    def _grpc_sender(self) -> Any:
        import grpc

        s = self.settings
        options = [("grpc.enable_retries", 0)]
        self._channel = (
            grpc.secure_channel(s.endpoint, grpc.ssl_channel_credentials(), options=options)
            if s.secure
            else grpc.insecure_channel(s.endpoint, options=options)
        )
        # The request is already serialized: the stub sends the bytes as they are.
        call = self._channel.unary_unary(_EXPORT_METHOD, request_serializer=None, response_deserializer=None)
        metadata = tuple((k.lower(), v) for k, v in s.headers)
        compression = grpc.Compression.Gzip if s.gzip else None

        def send(body: bytes) -> None:
            call(body, timeout=s.timeout_s, metadata=metadata, compression=compression)

        return send


__all__ = [
    "CLIENT",
    "ERROR",
    "INTERNAL",
    "SERVER",
    "SPAN_ATTRIBUTES",
    "UNSET",
    "Attributes",
    "Event",
    "ExportSettings",
    "Exporter",
    "encode_resource",
    "encode_scope",
    "encode_span",
    "export_request",
    "parse_pairs",
]

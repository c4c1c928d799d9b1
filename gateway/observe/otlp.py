"""OTLP spans without the SDK: written straight into the protobuf wire format (sent by
``otlp_export``).

Why not the OpenTelemetry SDK: its encoder builds each span's protobuf message attribute by
attribute in Python, ~60 µs per span here — three spans cost a traced request about as much CPU
as the whole request costs the gateway. Written directly, with every attribute's key (and every
string value seen before) encoded once and reused, a request's three spans cost a few µs. The
wire format is the one in opentelemetry-proto (``trace/v1/trace.proto``, ``common/v1/common.proto``);
the tests decode what the exporter sends with those protos.
"""

from __future__ import annotations

import logging
import struct
from collections.abc import Sequence
from typing import Any

log = logging.getLogger("tokengate.tracing")

# The tag of Span.attributes (field 9, length-delimited): what Attributes.encode takes for a span.
SPAN_ATTRIBUTES = b"\x4a"
# SpanKind and Status.code, as the protos number them.
INTERNAL, SERVER, CLIENT = 1, 2, 3
UNSET, ERROR = 0, 2

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
        self._reals: dict[tuple[bytes, str], bytes] = {}
        self._texts: dict[tuple[bytes, str], bytes] = {}
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

    def cached(self, tag: bytes, key: str, value: int | tuple[str, ...]) -> bytes:
        """One attribute's field whose value repeats (a count, finish reasons), cached."""
        k = (tag, key, value)
        hit = self._strings.get(k)
        if hit is None:
            hit = self.encode(tag, ((key, value),))
            if len(self._strings) >= self._limit:
                self._strings.clear()
            self._strings[k] = hit
        return hit

    def real(self, tag: bytes, key: str, value: float) -> bytes:
        """One double attribute's field: its fixed head once per key, then the 8 bytes."""
        head = self._reals.get((tag, key))
        if head is None:
            k = self._key(key)
            head = self._reals[(tag, key)] = tag + _varint(len(k) + 11) + k + b"\x12\x09\x21"
        return head + _pack_d(value)

    def text(self, tag: bytes, key: str, value: str) -> bytes:
        """One string attribute's field, never cached (a value unique to its request)."""
        k = self._texts.get((tag, key))
        if k is None:
            k = self._texts[(tag, key)] = self._key(key)
        v = value.encode("utf-8", "replace")
        n = len(v)
        if n < 0x7C and len(k) + n < 0x7C:  # (every length one byte: a request id, a response id)
            return tag + bytes((len(k) + n + 4,)) + k + b"\x12" + bytes((n + 2,)) + b"\x0a" + bytes((n,)) + v
        kv = k + _field(b"\x12", _field(b"\x0a", v))
        return tag + _varint(len(kv)) + kv

    def name(self, tag: bytes, name: str) -> bytes:
        """A string field of ``tag`` (span and event names), encoded once per name (bounded)."""
        hit = self._names.get(name)
        if hit is None:
            if len(self._names) >= self._limit:
                self._names.clear()
            hit = self._names[name] = _str(tag, name)
        return hit


# A span is written as: trace_id (field 1), span_id (2), parent_span_id (4), then span_head (name,
# kind), TIMES, its attributes, events and status, and SAMPLED (gateway.observe.tracing does it).
TIMES = struct.Struct("<BQBQ")  # start_time_unix_nano (field 7) and end (field 8), fixed64 each
_KIND = {k: b"\x30" + bytes((k,)) for k in range(6)}
SAMPLED = b"\x85\x01\x01\x00\x00\x00"  # flags (field 16, fixed32): W3C sampled
EVENT_TIME = struct.Struct("<BQ")  # an event's time_unix_nano (field 1, fixed64)


def span_head(attrs: Attributes, name: str, kind: int) -> bytes:
    """A span's name and kind fields: what spans of one name and kind share (kept by the caller)."""
    return attrs.name(b"\x2a", name) + _KIND[kind]


def event(attrs: Attributes, name: str, time_ns: int, attributes: Sequence[tuple[str, Any]] = ()) -> bytes:
    """A span's ``Event`` field: its time, name and attributes."""
    body = EVENT_TIME.pack(0x09, time_ns) + attrs.name(b"\x12", name)
    if attributes:
        body += attrs.encode(b"\x1a", attributes)
    return b"\x5a" + bytes((len(body),)) + body if len(body) < 0x80 else _field(b"\x5a", body)


def status(code: int, message: str | None = None) -> bytes:
    """A span's ``Status`` field (none for UNSET without a message)."""
    if not code and not message:
        return b""
    st = (_str(b"\x12", message) if message else b"") + (b"\x18" + _varint(code) if code else b"")
    return _field(b"\x7a", st)


ERROR_STATUS = status(ERROR)


def export_request(resource: bytes, scope: bytes, spans: Sequence[bytes]) -> bytes:
    """``ExportTraceServiceRequest`` bytes: one ResourceSpans, one ScopeSpans holding ``spans``
    (``resource`` and ``scope`` already encoded messages). The spans' bytes are copied once (one
    join), not once per level of nesting."""
    parts: list[bytes] = []
    size = 0
    for s in spans:
        n = len(s)
        head = b"\x12" + (bytes((n,)) if n < 0x80 else _varint(n))
        parts.append(head)
        parts.append(s)
        size += len(head) + n
    scope_field = _field(b"\x0a", scope)
    size += len(scope_field)
    resource_field = _field(b"\x0a", resource)
    rs_size = len(resource_field) + 1 + len(_varint(size)) + size
    head = b"\x0a" + _varint(rs_size) + resource_field + b"\x12" + _varint(size) + scope_field
    return b"".join((head, *parts))


def encode_resource(attributes: Sequence[tuple[str, Any]]) -> bytes:
    return Attributes().encode(b"\x0a", attributes)


def encode_scope(name: str, version: str | None) -> bytes:
    return _str(b"\x0a", name) + (_str(b"\x12", version) if version else b"")


__all__ = [
    "CLIENT",
    "ERROR",
    "ERROR_STATUS",
    "EVENT_TIME",
    "INTERNAL",
    "SAMPLED",
    "SERVER",
    "SPAN_ATTRIBUTES",
    "TIMES",
    "UNSET",
    "Attributes",
    "encode_resource",
    "encode_scope",
    "event",
    "export_request",
    "span_head",
    "status",
]

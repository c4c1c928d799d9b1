"""OTLP export on the event loop: finished requests are kept as they are and, a batch at a time,
encoded into spans (``otlp``) and sent by the loop itself, over one kept connection: gRPC
(``TraceService/Export`` on HTTP/2, with ``h2``) or HTTP/protobuf (``POST .../v1/traces``).

Why on the loop, without a thread: grpcio's client, called from a thread of its own, cost a traced
request more CPU than encoding its spans (its threads and the GIL hand-offs they force on the
loop); one HTTP/2 or HTTP/1.1 request per batch costs the loop a few µs per request. Measured in
docs/observability.md ("Traces").

Where the config leaves a value out, the standard variables set it:
``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` / ``OTEL_EXPORTER_OTLP_ENDPOINT`` (HTTP: the base URL, to which
``/v1/traces`` is added), ``..._HEADERS`` (``k=v,k2=v2``), ``..._TIMEOUT`` (ms), ``..._COMPRESSION``
(``gzip``), ``..._INSECURE`` (gRPC), ``OTEL_BSP_SCHEDULE_DELAY`` (ms between exports),
``OTEL_BSP_MAX_QUEUE_SIZE`` (spans kept while the receiver is slow; past it requests' spans are
dropped and counted), ``OTEL_BSP_MAX_EXPORT_BATCH_SIZE``.
"""

from __future__ import annotations

import asyncio
import contextlib
import gzip
import logging
import ssl
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar
from urllib.parse import unquote, urlsplit

from gateway.observe.otlp import export_request

log = logging.getLogger("tokengate.tracing")

_EXPORT_METHOD = "/opentelemetry.proto.collector.trace.v1.TraceService/Export"
# Requests encoded between two yields to the loop: a batch never holds other requests' bytes for
# more than a fraction of a millisecond.
_CHUNK = 32

T = TypeVar("T")


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


class _Unanswered(ConnectionError):
    """The connection failed before the receiver answered any of the call: on a connection kept
    from an earlier call, the receiver most likely closed it while it was idle."""


class _Sender:
    """One kept connection to the receiver, one call at a time. A call that fails unanswered on a
    kept connection is made once more on a new one; any other failure closes the connection and
    the next call opens a new one."""

    def __init__(self, settings: ExportSettings) -> None:
        self.settings = settings
        self.connections = 0  # opened so far

    async def send(self, body: bytes) -> None:
        for again in (False, True):
            kept = self._connected()
            try:
                await asyncio.wait_for(self._call(body), self.settings.timeout_s)
                return
            except _Unanswered:
                self.close()
                if again or not kept:
                    raise
            except BaseException:
                self.close()
                raise

    def _connected(self) -> bool:
        raise NotImplementedError

    async def _call(self, body: bytes) -> None:
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError


class HttpSender(_Sender):
    """``POST`` of OTLP bodies to one URL over a kept-alive HTTP/1.1 connection (TLS for https)."""

    def __init__(self, settings: ExportSettings) -> None:
        super().__init__(settings)
        u = urlsplit(settings.endpoint)
        self._https = u.scheme == "https"
        self._host = u.hostname or "localhost"
        self._port = u.port or (443 if self._https else 80)
        path = (u.path or "/") + (f"?{u.query}" if u.query else "")
        extra = "".join(f"{k}: {v}\r\n" for k, v in settings.headers)
        if settings.gzip:
            extra += "Content-Encoding: gzip\r\n"
        self._head = (
            f"POST {path} HTTP/1.1\r\nHost: {u.netloc}\r\nContent-Type: application/x-protobuf\r\n{extra}"
        ).encode("latin-1")
        self._conn: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None = None

    def _connected(self) -> bool:
        return self._conn is not None

    async def _call(self, body: bytes) -> None:
        if self._conn is None:
            tls = ssl.create_default_context() if self._https else None
            self._conn = await asyncio.open_connection(self._host, self._port, ssl=tls)
            self.connections += 1
        reader, writer = self._conn
        if self.settings.gzip:
            body = gzip.compress(body)
        try:
            writer.write(self._head + b"Content-Length: %d\r\n\r\n" % len(body) + body)
            await writer.drain()
            status_line = await reader.readline()
        except OSError as exc:
            raise _Unanswered(f"the connection failed: {exc}") from None
        if not status_line:
            raise _Unanswered("the receiver closed the connection")
        parts = status_line.split(None, 2)
        if len(parts) < 2 or not parts[1].isdigit():
            raise ConnectionError("the receiver's answer is not HTTP")
        status = int(parts[1])
        length, chunked, close = 0, False, False
        while True:
            line = await reader.readline()
            if line in (b"\r\n", b"\n", b""):
                break
            name, _, value = line.partition(b":")
            name = name.strip().lower()
            if name == b"content-length":
                length = int(value.strip() or 0)
            elif name == b"transfer-encoding":
                chunked = b"chunked" in value.lower()
            elif name == b"connection":
                close = b"close" in value.lower()
        if chunked:
            while True:
                size = int((await reader.readline()).split(b";")[0].strip() or b"0", 16)
                await reader.readexactly(size + 2)
                if size == 0:
                    break
        elif length:
            await reader.readexactly(length)
        if close:
            self.close()
        if not 200 <= status < 300:
            raise ConnectionError(f"HTTP {status}")

    def close(self) -> None:
        if self._conn is not None:
            self._conn[1].close()
            self._conn = None


class GrpcSender(_Sender):
    """``TraceService/Export`` over HTTP/2 (TLS with ALPN ``h2`` for https). ``h2`` does the
    framing, flow control and header compression; the call's outcome is its ``grpc-status``."""

    def __init__(self, settings: ExportSettings) -> None:
        super().__init__(settings)
        s = settings
        self._host, _, port = s.endpoint.rpartition(":")
        self._port = int(port)
        headers = [
            (b":method", b"POST"),
            (b":scheme", b"https" if s.secure else b"http"),
            (b":path", _EXPORT_METHOD.encode()),
            (b":authority", s.endpoint.encode()),
            (b"content-type", b"application/grpc"),
            (b"te", b"trailers"),
            (b"grpc-timeout", b"%dm" % max(1, int(s.timeout_s * 1000))),
            *((k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in s.headers),
        ]
        if s.gzip:
            headers.append((b"grpc-encoding", b"gzip"))
        self._headers = headers
        self._conn: _H2 | None = None

    def _connected(self) -> bool:
        return self._conn is not None and self._conn.open

    async def _open(self) -> _H2:
        from h2.config import H2Configuration
        from h2.connection import H2Connection

        self.close()
        tls = None
        if self.settings.secure:
            tls = ssl.create_default_context()
            tls.set_alpn_protocols(["h2"])
        reader, writer = await asyncio.open_connection(self._host, self._port, ssl=tls)
        self.connections += 1
        h2 = H2Connection(H2Configuration(client_side=True, header_encoding=None))
        h2.initiate_connection()
        writer.write(h2.data_to_send())
        self._conn = _H2(reader, writer, h2)
        return self._conn

    async def _call(self, body: bytes) -> None:
        from h2.exceptions import H2Error

        conn = self._conn if self._conn is not None and self._conn.open else await self._open()
        h2, writer = conn.h2, conn.writer
        if self.settings.gzip:
            body = gzip.compress(body)
        message = (b"\x01" if self.settings.gzip else b"\x00") + len(body).to_bytes(4, "big") + body
        call = conn.call = _Call(
            h2.get_next_available_stream_id(), asyncio.get_running_loop().create_future()
        )
        try:
            h2.send_headers(call.sid, self._headers)
            view, sent = memoryview(message), 0
            while sent < len(message) and not call.done.done():
                n = min(
                    h2.local_flow_control_window(call.sid), h2.max_outbound_frame_size, len(message) - sent
                )
                if n > 0:
                    h2.send_data(
                        call.sid, view[sent : sent + n].tobytes(), end_stream=sent + n == len(message)
                    )
                    sent += n
                    writer.write(h2.data_to_send())
                else:  # the receiver's window is full: the reader wakes this when it opens
                    conn.window.clear()
                    writer.write(h2.data_to_send())
                    await writer.drain()
                    await conn.window.wait()
            writer.write(h2.data_to_send())
            await writer.drain()
            await call.done
        except (OSError, H2Error) as exc:
            if call.answered:
                raise ConnectionError(f"the connection failed: {exc}") from None
            raise _Unanswered(f"the connection failed: {exc}") from None
        finally:
            conn.call = None
        if call.status != b"0":
            detail = f": {call.message.decode('utf-8', 'replace')}" if call.message else ""
            raise ConnectionError(f"gRPC status {(call.status or b'none').decode()}{detail}")

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None


@dataclass(slots=True)
class _Call:
    sid: int
    done: asyncio.Future[None]  # set by the connection's reader: the call's end, or how it failed
    status: bytes | None = None
    message: bytes = b""
    answered: bool = False  # the receiver sent the call's headers

    def end(self, failure: BaseException | None = None) -> None:
        if not self.done.done():
            if failure is None:
                self.done.set_result(None)
            else:
                self.done.set_exception(failure)


_FRAME_HEADER = 9  # an HTTP/2 frame: 3 bytes of payload length, type, flags, stream id


class _H2:
    """One HTTP/2 connection to the receiver, read by a task of its own: the receiver's pings,
    settings and window updates are answered as they come, and one that says goodbye (GOAWAY)
    while idle is retired before the next call rather than failing it."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, h2: Any) -> None:
        self.reader, self.writer, self.h2 = reader, writer, h2
        self.open = True
        self.call: _Call | None = None
        self.window = asyncio.Event()
        self._task = asyncio.get_running_loop().create_task(self._read(), name="tokengate-otlp-h2")

    async def _read(self) -> None:
        from h2 import events
        from h2.exceptions import H2Error

        buffered = b""
        try:
            while self.open:
                data = await self.reader.read(65536)
                if not data:
                    break
                # Frame by frame: h2 raises on the first frame it refuses and returns none of the
                # events before it, and a receiver that shuts down sends the call's answer, GOAWAY
                # and a PING in one write (a PING after GOAWAY is refused): the answer must count.
                buffered += data
                while len(buffered) >= _FRAME_HEADER:
                    end = _FRAME_HEADER + int.from_bytes(buffered[:3], "big")
                    if len(buffered) < end:
                        break
                    frame, buffered = buffered[:end], buffered[end:]
                    for ev in self.h2.receive_data(frame):
                        self._event(ev, events)
                self.writer.write(self.h2.data_to_send())
        except (OSError, H2Error):
            pass
        finally:
            self._closed()

    def _event(self, ev: Any, events: Any) -> None:
        call = self.call
        if isinstance(ev, events.DataReceived):
            self.h2.acknowledge_received_data(ev.flow_controlled_length, ev.stream_id)
        elif isinstance(ev, (events.WindowUpdated, events.RemoteSettingsChanged)):
            self.window.set()
        elif isinstance(ev, events.ConnectionTerminated):
            self.open = False
            if call is not None:
                if not call.answered and ev.last_stream_id is not None and ev.last_stream_id < call.sid:
                    call.end(_Unanswered("the receiver is closing the connection"))
                else:
                    call.end(
                        ConnectionError(f"the receiver ended the connection (HTTP/2 error {ev.error_code})")
                    )
        elif call is None or getattr(ev, "stream_id", None) != call.sid:
            return
        elif isinstance(ev, (events.ResponseReceived, events.TrailersReceived)):
            call.answered = True
            for name, value in ev.headers:
                if name == b"grpc-status":
                    call.status = value
                elif name == b"grpc-message":
                    call.message = value[:200]
                elif name == b":status" and value != b"200":
                    call.status, call.message = b"none", b"HTTP " + value
        elif isinstance(ev, events.StreamEnded):
            call.end()
        elif isinstance(ev, events.StreamReset):
            call.end(ConnectionError(f"the receiver reset the call (HTTP/2 error {ev.error_code})"))

    def _closed(self) -> None:
        self.open = False
        self.window.set()  # (a sender waiting for window finds the call ended)
        call = self.call
        if call is not None:
            call.end(
                ConnectionError("the receiver closed the connection before the call's end")
                if call.answered
                else _Unanswered("the receiver closed the connection")
            )

    def close(self) -> None:
        self.open = False
        self._task.cancel()
        self.writer.close()


class Exporter(Generic[T]):
    """Finished requests in (:meth:`add`, never blocks, never raises), OTLP requests out: every
    ``schedule_s``, or as soon as a batch's worth is waiting. ``encode`` turns one item into its
    encoded spans (about ``spans_per_item``), at export time. Past ``max_queue`` spans waiting
    (the receiver slow or down) new items are dropped and counted."""

    def __init__(
        self,
        settings: ExportSettings,
        resource: bytes,
        scope: bytes,
        encode: Callable[[T], Sequence[bytes]],
        spans_per_item: int = 1,
    ) -> None:
        self.settings = settings
        self._resource, self._scope = resource, scope
        self._encode = encode
        self._batch = max(1, settings.max_batch // spans_per_item)
        self._limit = max(1, settings.max_queue // spans_per_item)
        self._items: deque[T] = deque()
        self.exported = 0  # spans the receiver took
        self.failed = 0  # spans in requests that failed
        self.dropped = 0  # items (requests) whose spans were never sent: the queue was full
        self._last_error = 0.0
        self.sender: HttpSender | GrpcSender = (
            GrpcSender(settings) if settings.protocol == "grpc" else HttpSender(settings)
        )
        self._loop = asyncio.get_running_loop()
        self._task: asyncio.Task[None] | None = None
        self._timer = self._loop.call_later(settings.schedule_s, self._tick)
        self._closed = False

    def add(self, item: T) -> None:
        items = self._items
        if len(items) >= self._limit or self._closed:
            self.dropped += 1
            return
        items.append(item)
        if len(items) >= self._batch and self._task is None:
            self._start()

    def _tick(self) -> None:
        if self._items and self._task is None:
            self._start()
        if not self._closed:
            self._timer = self._loop.call_later(self.settings.schedule_s, self._tick)

    def _start(self) -> None:
        self._task = self._loop.create_task(self._drain(everything=False), name="tokengate-otlp-export")

    async def _drain(self, everything: bool) -> None:
        """Export full batches while they wait (and, on the schedule or at close, the rest)."""
        try:
            first = True
            while self._items and (first or everything or len(self._items) >= self._batch):
                first = False
                await self._export_batch()
        finally:
            self._task = None

    async def _export_batch(self) -> None:
        items, encode = self._items, self._encode
        spans: list[bytes] = []
        take = min(len(items), self._batch)
        for i in range(take):
            try:
                spans += encode(items.popleft())
            except Exception:  # a record the encoder cannot write: lose its spans, not the batch
                log.exception("encoding a request's spans failed")
            if i % _CHUNK == _CHUNK - 1:
                await asyncio.sleep(0)
        if not spans:
            return
        body = export_request(self._resource, self._scope, spans)
        try:
            await self.sender.send(body)
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

    async def close(self) -> None:
        """Send what is waiting (each export bounded by the export timeout), then close."""
        self._closed = True  # (what comes after is dropped and counted)
        self._timer.cancel()
        if self._task is not None:
            with contextlib.suppress(Exception):
                await self._task
        # As a task of its own, so that nothing else starts an export beside it on the connection.
        self._task = self._loop.create_task(self._drain(everything=True), name="tokengate-otlp-export")
        with contextlib.suppress(Exception):
            await self._task
        self.sender.close()


__all__ = ["ExportSettings", "Exporter", "GrpcSender", "HttpSender", "parse_pairs"]

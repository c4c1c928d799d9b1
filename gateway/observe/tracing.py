"""OpenTelemetry traces of each request: the server span, its admission (price, classify, queue
wait, decision) and the upstream call, following the GenAI semantic conventions; W3C trace context
taken from the client and sent upstream, so an engine started with ``--otlp-traces-endpoint``
continues the same trace.

Off by default (``tracing.enabled``), and then nothing here runs: no header read, no field set.
On, the request path pays for three random ids and a ``traceparent`` header when the request
starts; once it is over, its access record is kept until its batch is exported, and then its
spans are written from the times the record holds (``Record.queued_at``, ``upstream_at``, ...)
straight into OTLP's protobuf encoding (:mod:`gateway.observe.otlp`: a few µs a request, where the
OpenTelemetry SDK's encoder costs more than the request) and sent from the event loop
(:mod:`gateway.observe.otlp_export`).

    tracing:
      enabled: true
      protocol: grpc            # grpc | http/protobuf; default OTEL_EXPORTER_OTLP_TRACES_PROTOCOL,
                                #   OTEL_EXPORTER_OTLP_PROTOCOL, else grpc
      endpoint: http://collector:4317   # default: the OTEL_EXPORTER_OTLP_(TRACES_)ENDPOINT variables,
                                        #   else the exporter's own (localhost:4317 / :4318)
      sample_ratio: 0.1         # of traces started here (a root); default OTEL_TRACES_SAMPLER_ARG, else 1
      client_context: join      # join: a client's traceparent is the parent (and its sampled flag
                                #   decides); ignore: every request starts its own trace
      service_name: tokengate   # default OTEL_SERVICE_NAME, else tokengate

Headers, timeouts, compression and batching follow the standard ``OTEL_EXPORTER_OTLP_*`` and
``OTEL_BSP_*`` variables (:mod:`gateway.observe.otlp_export`). Prompt and completion contents are never
recorded. gRPC export needs ``h2`` (``pip install 'tokengate[otel]'``); HTTP/protobuf needs nothing.
"""

from __future__ import annotations

import functools
import logging
import os
import random
import re
import time
from collections.abc import Mapping
from dataclasses import dataclass
from time import perf_counter
from typing import Any, Literal
from urllib.parse import urlsplit

from gateway.observe import otlp
from gateway.observe.accesslog import Record
from gateway.observe.otlp_export import Exporter, ExportSettings, parse_pairs

log = logging.getLogger("tokengate.tracing")

Protocol = Literal["grpc", "http/protobuf"]
PROTOCOLS: tuple[Protocol, ...] = ("grpc", "http/protobuf")
ClientContext = Literal["join", "ignore"]

_TRACEPARENT = re.compile(r"^([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})(-.*)?$")
_MASK64 = (1 << 64) - 1


@dataclass(frozen=True, slots=True)
class TracingSettings:
    enabled: bool = False
    protocol: Protocol | None = None
    endpoint: str | None = None
    sample_ratio: float | None = None
    client_context: ClientContext = "join"
    service_name: str | None = None

    def resolved_protocol(self, env: Mapping[str, str]) -> Protocol:
        p = (
            self.protocol
            or env.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
            or env.get("OTEL_EXPORTER_OTLP_PROTOCOL")
            or "grpc"
        )
        return "http/protobuf" if p.strip().lower() == "http/protobuf" else "grpc"

    def resolved_ratio(self, env: Mapping[str, str]) -> float:
        if self.sample_ratio is not None:
            return self.sample_ratio
        sampler = env.get("OTEL_TRACES_SAMPLER", "").strip().lower()
        if sampler in ("always_off", "parentbased_always_off"):
            return 0.0
        if sampler in ("traceidratio", "parentbased_traceidratio"):
            try:
                return min(1.0, max(0.0, float(env.get("OTEL_TRACES_SAMPLER_ARG", "1"))))
            except ValueError:
                return 1.0
        return 1.0


@dataclass(slots=True)
class TraceContext:
    """One request's place in a trace: the ids of its spans, decided when it arrives."""

    trace_id: int
    parent_id: int | None  # the client's span, when it sent a traceparent we joined
    server_id: int
    upstream_id: int  # the parent of the engine's spans: what the upstream traceparent names
    sampled: bool
    tracestate: str | None = None

    @property
    def trace_hex(self) -> str:
        return f"{self.trace_id:032x}"

    def upstream_headers(self) -> list[tuple[str, str]]:
        out = [
            (
                "traceparent",
                f"00-{self.trace_id:032x}-{self.upstream_id:016x}-{'01' if self.sampled else '00'}",
            )
        ]
        if self.tracestate:
            out.append(("tracestate", self.tracestate))
        return out


def parse_traceparent(value: str) -> tuple[int, int, bool] | None:
    """(trace id, parent span id, sampled) of a W3C ``traceparent``; None when it is not one (a
    malformed or all-zero value starts a new trace, as the W3C spec says)."""
    m = _TRACEPARENT.match(value.strip())
    if m is None:
        return None
    version, trace, span, flags, rest = m.groups()
    if version == "ff" or (version == "00" and rest):
        return None
    trace_id, span_id = int(trace, 16), int(span, 16)
    if not trace_id or not span_id:
        return None
    return trace_id, span_id, bool(int(flags, 16) & 1)


def _operation(path: str) -> str:
    """GenAI ``gen_ai.operation.name`` of an OpenAI route."""
    if path.endswith("/chat/completions") or path.endswith("/responses"):
        return "chat"
    if path.endswith("/completions"):
        return "text_completion"
    if path.endswith("/embeddings"):
        return "embeddings"
    return "chat"


class Tracer:
    """Decides each request's trace when it arrives (:meth:`begin`) and, when it is over, encodes its
    spans and queues them for export (:meth:`finished`, a request hook)."""

    def __init__(self, settings: TracingSettings, env: Mapping[str, str] | None = None) -> None:
        env = os.environ if env is None else env
        self.settings = settings
        self._join = settings.client_context == "join"
        ratio = settings.resolved_ratio(env)
        self._bound = int(ratio * (1 << 64))  # a root is sampled when its id's low 64 bits are below
        seed = random.SystemRandom().getrandbits(64)
        self._rand = random.Random(seed).getrandbits
        # perf_counter -> epoch nanoseconds, for the spans' times
        self._epoch_ns = time.time_ns() - int(perf_counter() * 1e9)
        self._attrs = otlp.Attributes()
        self._statics: dict[tuple[Any, ...], tuple[bytes, bytes, bytes, bytes, bytes]] = {}
        self._admission_head = otlp.span_head(self._attrs, "tokengate.admission", otlp.INTERNAL)
        # The events of a granted admission (otlp.event), but their times: (tag and length, name).
        self._queued, self._granted = (
            (b"\x5a" + bytes((9 + len(n),)), n)
            for n in (self._attrs.name(b"\x12", "queued"), self._attrs.name(b"\x12", "granted"))
        )
        name = settings.service_name or env.get("OTEL_SERVICE_NAME") or "tokengate"
        resource = [*parse_pairs(env.get("OTEL_RESOURCE_ATTRIBUTES")), ("service.name", name)]
        export = ExportSettings.resolve(settings.resolved_protocol(env), settings.endpoint, env)
        # A finished request is kept as it is and encoded with its batch, at export time.
        self.exporter: Exporter[tuple[Record, TraceContext, float]] = Exporter(
            export,
            otlp.encode_resource(list(dict(resource).items())),
            otlp.encode_scope("tokengate", _version()),
            self._encode,
            spans_per_item=3,
        )

    def begin(self, traceparent: str | None, tracestate: str | None) -> TraceContext:
        rand = self._rand
        if traceparent is not None and self._join:
            parsed = parse_traceparent(traceparent)
            if parsed is not None:
                trace_id, parent, sampled = parsed
                state = tracestate if tracestate and len(tracestate) <= 512 else None
                return TraceContext(trace_id, parent, rand(64) or 1, rand(64) or 1, sampled, state)
        trace_id = rand(128) or 1
        return TraceContext(trace_id, None, rand(64) or 1, rand(64) or 1, (trace_id & _MASK64) < self._bound)

    def finished(self, rec: Record, end: float) -> None:
        ctx = rec.trace
        if ctx is None or not ctx.sampled:
            return
        self.exporter.add((rec, ctx, end))

    async def close(self) -> None:
        """Export what is still queued (bounded by the export timeout)."""
        await self.exporter.close()

    def _encode(self, item: tuple[Record, TraceContext, float]) -> list[bytes]:
        return self.spans(*item)

    # ---- spans ----

    def spans(self, rec: Record, ctx: TraceContext, end: float) -> list[bytes]:
        """The request's spans, encoded: server; admission when it asked the store; upstream when
        it reached a backend.

        What repeats from request to request (tenant, class, pool, backend, model, route, outcome:
        every string) is encoded once per combination and kept (:meth:`_static`); per request only
        the ids, times and numbers are written."""
        attrs, tag, epoch = self._attrs, otlp.SPAN_ATTRIBUTES, self._epoch_ns
        cached, real, text = attrs.cached, attrs.real, attrs.text
        tid = b"\x0a\x10" + ctx.trace_id.to_bytes(16, "big")
        server_id = ctx.server_id.to_bytes(8, "big")
        status = rec.status or 499
        failed = status >= 500
        granted = rec.granted
        upstream = rec.upstream_at is not None
        key = (rec.method, rec.path, rec.tenant, rec.tier, rec.klass, rec.outcome, rec.reason, rec.pool,
               rec.backend, granted, upstream, failed, rec.model, rec.stream, rec.backend_url,
               rec.response_model)  # fmt: skip
        static = self._statics.get(key)
        if static is None:
            static = self._static(rec, key)
        server_attrs, admission_attrs, upstream_attrs, server_head, upstream_head = static
        # (the server's and the admission's)
        shared = cached(tag, "tokengate.cost", rec.prefill + rec.decode) + cached(
            tag, "tokengate.reserved_output", rec.decode
        )
        waited = rec.queue_s
        if waited is not None:
            shared += real(tag, "tokengate.queue_wait_s", round(waited, 6))
        if rec.estimate_error is not None:
            shared += real(tag, "tokengate.estimate_error", round(rec.estimate_error, 4))
        error = otlp.ERROR_STATUS if failed else b""
        times, sampled, event_time = otlp.TIMES.pack, otlp.SAMPLED, otlp.EVENT_TIME.pack
        parent = b"" if ctx.parent_id is None else b"\x22\x08" + ctx.parent_id.to_bytes(8, "big")
        # Each span in one join: ids, head, times, attributes, events, status, flags (otlp.TIMES).
        out = [
            b"".join(
                (
                    tid,
                    b"\x12\x08",
                    server_id,
                    parent,
                    server_head,
                    times(0x39, epoch + int(rec.start * 1e9), 0x41, epoch + int(end * 1e9)),
                    server_attrs,
                    cached(tag, "http.response.status_code", status),
                    text(tag, "tokengate.request_id", rec.request_id),
                    shared,
                    error,
                    sampled,
                )
            )
        ]
        if rec.queued_at is not None:
            t0 = epoch + int(rec.queued_at * 1e9)
            t1 = epoch + int((rec.queued_at + (waited or 0.0)) * 1e9)
            if granted:
                (qh, qn), (gh, gn) = self._queued, self._granted
                events = b"".join((qh, event_time(0x09, t0), qn, gh, event_time(0x09, t1), gn))
                refused = b""
            else:
                refusal = rec.reason or "refused"
                events = otlp.event(attrs, "queued", t0) + otlp.event(
                    attrs, "refused", t1, (("error.type", refusal),)
                )
                refused = otlp.status(otlp.ERROR, refusal)
            out.append(
                b"".join(
                    (
                        tid,
                        b"\x12\x08",
                        (self._rand(64) or 1).to_bytes(8, "big"),
                        b"\x22\x08",
                        server_id,
                        self._admission_head,
                        times(0x39, t0, 0x41, t1),
                        admission_attrs,
                        shared,
                        events,
                        refused,
                        sampled,
                    )
                )
            )
        if upstream:
            at = rec.upstream_at
            assert at is not None
            up = [upstream_attrs]
            if rec.max_tokens is not None:
                up.append(cached(tag, "gen_ai.request.max_tokens", rec.max_tokens))
            if rec.response_id:
                up.append(text(tag, "gen_ai.response.id", rec.response_id))
            if rec.finish_reasons:
                up.append(cached(tag, "gen_ai.response.finish_reasons", rec.finish_reasons))
            if rec.prompt_tokens is not None:
                up.append(cached(tag, "gen_ai.usage.input_tokens", rec.prompt_tokens))
            if rec.completion_tokens is not None:
                up.append(cached(tag, "gen_ai.usage.output_tokens", rec.completion_tokens))
            if rec.ttft_s is not None:
                up.append(
                    real(tag, "gen_ai.response.time_to_first_chunk", max(0.0, rec.ttft_s - (at - rec.start)))
                )
            up_end = at + rec.backend_s if rec.backend_s is not None else end
            out.append(
                b"".join(
                    (
                        tid,
                        b"\x12\x08",
                        ctx.upstream_id.to_bytes(8, "big"),
                        b"\x22\x08",
                        server_id,
                        upstream_head,
                        times(0x39, epoch + int(at * 1e9), 0x41, epoch + int(max(up_end, at) * 1e9)),
                        b"".join(up),
                        error,
                        sampled,
                    )
                )
            )
        return out

    def _static(self, rec: Record, key: tuple[Any, ...]) -> tuple[bytes, bytes, bytes, bytes, bytes]:
        """The encoded attributes a request shares with every other of the same tenant, tier,
        class, route, outcome, pool, backend and model (per span: server, admission, upstream), and
        the names of its server and upstream spans."""
        attrs, tag = self._attrs, otlp.SPAN_ATTRIBUTES
        path = rec.path[:256]
        facts: list[tuple[str, Any]] = [
            ("tokengate.tenant", rec.tenant),
            ("tokengate.tier", rec.tier),
            ("tokengate.class", rec.klass),
            ("tokengate.outcome", rec.outcome),
        ]
        if rec.pool is not None:
            facts.append(("tokengate.pool", rec.pool))
        if rec.backend is not None:
            facts.append(("tokengate.backend", rec.backend))
        decision = "granted" if rec.granted else rec.reason
        if decision:
            facts.append(("tokengate.decision", decision))
        shared = attrs.encode(tag, facts)
        server = [("http.request.method", rec.method), ("url.path", path), ("http.route", path)]
        if rec.reason:
            server.append(("error.type", rec.reason))
        op = _operation(rec.path)
        model = rec.model or ""
        up: list[tuple[str, Any]] = [
            ("gen_ai.operation.name", op),
            ("gen_ai.provider.name", "openai"),
            ("gen_ai.request.model", model),
            ("gen_ai.request.stream", rec.stream),
        ]
        if rec.response_model:
            up.append(("gen_ai.response.model", rec.response_model))
        if rec.backend_url:
            host, port = _address(rec.backend_url)
            if host:
                up += [("server.address", host), ("server.port", port)]
        if (rec.status or 499) >= 500:
            up.append(("error.type", rec.reason or "upstream_error"))
        static = (
            attrs.encode(tag, server) + shared,
            shared,
            attrs.encode(tag, up) + shared,
            otlp.span_head(attrs, f"{rec.method} {path}", otlp.SERVER),
            otlp.span_head(attrs, f"{op} {model}".strip(), otlp.CLIENT),
        )
        statics = self._statics
        if len(statics) >= 4096:
            statics.clear()
        statics[key] = static
        return static


@functools.lru_cache(maxsize=256)
def _address(url: str) -> tuple[str | None, int]:
    u = urlsplit(url)
    return u.hostname, u.port or (443 if u.scheme == "https" else 80)


def _version() -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("tokengate")
    except PackageNotFoundError:  # (run from a source tree)
        return None


def otel_available(protocol: str = "grpc") -> bool:
    """Whether what the protocol's export needs is installed: ``h2`` for gRPC (``tokengate[otel]``);
    HTTP/protobuf needs nothing beyond the standard library."""
    if protocol != "grpc":
        return True
    try:
        import h2  # noqa: F401
    except ImportError:
        return False
    return True


__all__ = ["PROTOCOLS", "TraceContext", "Tracer", "TracingSettings", "otel_available", "parse_traceparent"]

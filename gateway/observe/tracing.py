"""OpenTelemetry traces of each request: the server span, its admission (price, classify, queue
wait, decision) and the upstream call, following the GenAI semantic conventions; W3C trace context
taken from the client and sent upstream, so an engine started with ``--otlp-traces-endpoint``
continues the same trace.

Off by default (``tracing.enabled``), and then nothing here runs: no import of the SDK, no header
read, no field set. On, the request path pays for two things only: three random ids and a
``traceparent`` header when the request starts. The spans are built once the request is over, from
the times its access record holds (``Record.queued_at``, ``upstream_at``, ...), and handed to the
SDK's batch processor, which encodes and exports them by OTLP in its own thread.

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

Headers, timeouts, compression and batching follow the exporter's and the batch processor's own
``OTEL_EXPORTER_OTLP_*`` and ``OTEL_BSP_*`` variables. Prompt and completion contents are never
recorded.
"""

from __future__ import annotations

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

from gateway.observe.accesslog import Record

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
    """Decides each request's trace when it arrives (:meth:`begin`) and exports its spans when it
    is over (:meth:`finished`, a request hook)."""

    def __init__(self, settings: TracingSettings, env: Mapping[str, str] | None = None) -> None:
        env = os.environ if env is None else env
        self.settings = settings
        self._join = settings.client_context == "join"
        ratio = settings.resolved_ratio(env)
        self._bound = int(ratio * (1 << 64))  # a root is sampled when its id's low 64 bits are below
        self._bits = random.SystemRandom().getrandbits(64) ^ time.perf_counter_ns()
        self._rand = random.Random(self._bits).getrandbits
        # perf_counter -> epoch nanoseconds, for the spans' times
        self._epoch_ns = time.time_ns() - int(perf_counter() * 1e9)
        self._processor, self._resource, self._scope = _pipeline(settings, env)

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
        for span in self._spans(rec, ctx, end):
            self._processor.on_end(span)

    def close(self) -> None:
        """Export what is still batched (bounded by the processor's export timeout)."""
        try:
            self._processor.shutdown()
        except Exception:
            log.exception("flushing the trace exporter failed")

    # ---- spans ----

    def _ns(self, t: float) -> int:
        return self._epoch_ns + int(t * 1e9)

    def _spans(self, rec: Record, ctx: TraceContext, end: float) -> list[Any]:
        from opentelemetry.sdk.trace import Event, ReadableSpan
        from opentelemetry.trace import SpanContext, SpanKind, Status, StatusCode, TraceFlags

        flags = TraceFlags(TraceFlags.SAMPLED)
        tid = ctx.trace_id

        def context(span_id: int) -> SpanContext:
            return SpanContext(tid, span_id, is_remote=False, trace_flags=flags)

        server_ctx = context(ctx.server_id)
        parent = (
            SpanContext(tid, ctx.parent_id, is_remote=True, trace_flags=flags)
            if ctx.parent_id is not None
            else None
        )
        failed = rec.status >= 500 or rec.status == 0
        decision = "granted" if rec.granted else rec.reason
        facts: dict[str, Any] = {
            "tokengate.tenant": rec.tenant,
            "tokengate.tier": rec.tier,
            "tokengate.class": rec.klass,
            "tokengate.cost": rec.prefill + rec.decode,
            "tokengate.reserved_output": rec.decode,
            "tokengate.request_id": rec.request_id,
            "tokengate.outcome": rec.outcome,
        }
        if rec.pool is not None:
            facts["tokengate.pool"] = rec.pool
        if rec.backend is not None:
            facts["tokengate.backend"] = rec.backend
        if rec.queue_s is not None:
            facts["tokengate.queue_wait_s"] = round(rec.queue_s, 6)
        if decision:
            facts["tokengate.decision"] = decision
        server_attrs: dict[str, Any] = {
            "http.request.method": rec.method,
            "url.path": rec.path[:256],
            "http.route": rec.path[:256],
            "http.response.status_code": rec.status or 499,
            **facts,
        }
        if rec.reason:
            server_attrs["error.type"] = rec.reason
        spans = [
            ReadableSpan(
                name=f"{rec.method} {rec.path[:256]}",
                context=server_ctx,
                parent=parent,
                resource=self._resource,
                attributes=server_attrs,
                kind=SpanKind.SERVER,
                status=Status(StatusCode.ERROR) if failed else Status(StatusCode.UNSET),
                start_time=self._ns(rec.start),
                end_time=self._ns(end),
                instrumentation_scope=self._scope,
            )
        ]
        if rec.queued_at is not None:
            waited = rec.queue_s or 0.0
            granted = rec.granted
            t0, t1 = self._ns(rec.queued_at), self._ns(rec.queued_at + waited)
            spans.append(
                ReadableSpan(
                    name="tokengate.admission",
                    context=context(self._rand(64) or 1),
                    parent=server_ctx,
                    resource=self._resource,
                    attributes={
                        **facts,
                        "tokengate.decision": "granted" if granted else (rec.reason or "refused"),
                    },
                    events=[
                        Event("queued", {"tokengate.cost": rec.prefill + rec.decode}, t0),
                        Event(
                            "granted" if granted else "refused",
                            {} if granted else {"error.type": rec.reason or "refused"},
                            t1,
                        ),
                    ],
                    kind=SpanKind.INTERNAL,
                    status=Status(StatusCode.UNSET) if granted else Status(StatusCode.ERROR, rec.reason),
                    start_time=t0,
                    end_time=t1,
                    instrumentation_scope=self._scope,
                )
            )
        if rec.upstream_at is not None:
            op = _operation(rec.path)
            model = rec.model or ""
            attrs: dict[str, Any] = {
                "gen_ai.operation.name": op,
                "gen_ai.provider.name": "openai",
                "gen_ai.request.model": model,
                "gen_ai.request.stream": rec.stream,
                **facts,
            }
            if rec.max_tokens is not None:
                attrs["gen_ai.request.max_tokens"] = rec.max_tokens
            if rec.response_model:
                attrs["gen_ai.response.model"] = rec.response_model
            if rec.response_id:
                attrs["gen_ai.response.id"] = rec.response_id
            if rec.finish_reasons:
                attrs["gen_ai.response.finish_reasons"] = rec.finish_reasons
            if rec.prompt_tokens is not None:
                attrs["gen_ai.usage.input_tokens"] = rec.prompt_tokens
            if rec.completion_tokens is not None:
                attrs["gen_ai.usage.output_tokens"] = rec.completion_tokens
            if rec.ttft_s is not None:
                attrs["gen_ai.response.time_to_first_chunk"] = max(
                    0.0, rec.ttft_s - (rec.upstream_at - rec.start)
                )
            if rec.backend_url:
                u = urlsplit(rec.backend_url)
                if u.hostname:
                    attrs["server.address"] = u.hostname
                    attrs["server.port"] = u.port or (443 if u.scheme == "https" else 80)
            up_failed = rec.status >= 500 or rec.status == 0
            if up_failed:
                attrs["error.type"] = rec.reason or "upstream_error"
            up_end = rec.upstream_at + rec.backend_s if rec.backend_s is not None else end
            spans.append(
                ReadableSpan(
                    name=f"{op} {model}".strip(),
                    context=context(ctx.upstream_id),
                    parent=server_ctx,
                    resource=self._resource,
                    attributes=attrs,
                    kind=SpanKind.CLIENT,
                    status=Status(StatusCode.ERROR) if up_failed else Status(StatusCode.UNSET),
                    start_time=self._ns(rec.upstream_at),
                    end_time=self._ns(max(up_end, rec.upstream_at)),
                    instrumentation_scope=self._scope,
                )
            )
        return spans


def _pipeline(settings: TracingSettings, env: Mapping[str, str]) -> tuple[Any, Any, Any]:
    """The SDK's batch processor over an OTLP exporter (gRPC or HTTP/protobuf), the resource and
    the instrumentation scope every span carries."""
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace.export import BatchSpanProcessor
    from opentelemetry.sdk.util.instrumentation import InstrumentationScope

    exporter: Any
    endpoint = settings.endpoint
    if settings.resolved_protocol(env) == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcExporter

        exporter = GrpcExporter(endpoint=endpoint) if endpoint else GrpcExporter()
    else:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpExporter

        if endpoint and not endpoint.rstrip("/").endswith("/v1/traces"):
            endpoint = endpoint.rstrip("/") + "/v1/traces"  # (the base URL, as the env variable takes it)
        exporter = HttpExporter(endpoint=endpoint) if endpoint else HttpExporter()
    name = settings.service_name or env.get("OTEL_SERVICE_NAME") or "tokengate"
    resource = Resource.create({"service.name": name})
    from importlib.metadata import PackageNotFoundError, version

    try:
        ours = version("tokengate")
    except PackageNotFoundError:  # (run from a source tree)
        ours = None
    return BatchSpanProcessor(exporter), resource, InstrumentationScope("tokengate", ours)


def otel_available() -> bool:
    """Whether the OpenTelemetry SDK and its OTLP exporters are installed (``tokengate[otel]``)."""
    try:
        import opentelemetry.exporter.otlp.proto.grpc.trace_exporter
        import opentelemetry.exporter.otlp.proto.http.trace_exporter
        import opentelemetry.sdk.trace  # noqa: F401
    except ImportError:
        return False
    return True


__all__ = ["PROTOCOLS", "TraceContext", "Tracer", "TracingSettings", "otel_available", "parse_traceparent"]

"""The hot path: one OpenAI API request from arrival to release, as raw ASGI, in the README's steps.

    authenticate -> read -> price -> classify -> admit -> forward -> release (in ``finally``)

Each step is one method over the request's :class:`~gateway.request.exchange.Exchange`. Release runs on every
path once a lease is granted. A client disconnect is noticed by a small watcher task that waits on
ASGI ``receive()`` and cancels the request task; the cancellation unwinds through the upstream read
(closing the aiohttp response, which closes the backend connection: that is how vLLM learns to abort)
and through ``store.acquire`` (which withdraws a waiting ticket). Drain and the shutdown deadline
cancel request tasks the same way, with another ``CancelReason``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
from collections.abc import Callable, MutableMapping
from dataclasses import dataclass, replace
from time import perf_counter
from typing import TYPE_CHECKING, Any

import aiohttp
import orjson
from yarl import URL

from budgets.quota import cost_micros
from budgets.types import AdmissionError, Demand, NeverFits, backend_pool, class_pool, tenant_pool
from classifiers import Cost, InvalidRequest
from classifiers.pricing import MAX_JSON_DEPTH
from classifiers.prompt_overhead import corrected
from gateway.config.schema import TenantConfig
from gateway.observe.accesslog import Record
from gateway.observe.tracing import Tracer
from gateway.process.signals import RequestSignals, request_signals
from gateway.request import server_tools, slots, usage
from gateway.request.auth import bearer_key, may_use, visible_models
from gateway.request.billing import UsageRecorder
from gateway.request.cache_salt import tenant_cache_salt
from gateway.request.errors import AnswerCut, ApiError, from_admission, show_value
from gateway.request.exchange import CancelReason, Exchange, Phase, Placement, Receive, RouteKind, Scope, Send
from gateway.request.held_bodies import HeldBodies
from gateway.request.media_fetch import MediaFetcher
from gateway.request.passthrough import PassthroughRoute
from gateway.request.quotas import NOT_RUN, QuotaGate, Usage
from gateway.request.requestid import from_client, new_id
from gateway.request.reservations import with_decode
from gateway.request.shadow import ShadowLimits
from gateway.request.tenant_connections import TenantConnections
from gateway.upstream.client import REQUEST_DROP, HeaderNames, classify_error
from gateway.upstream.pools import Backend, NoBackend
from gateway.upstream.relay import UPSTREAM_ERRORS, Grow, relay_raw, relay_sse, relay_whole, upstream_failed

if TYPE_CHECKING:
    from budgets.types import BudgetStore
    from gateway.config.schema import LimitsConfig
    from gateway.live import Live, LiveParts
    from gateway.observe.metrics import GatewayMetrics
    from gateway.observe.observer import Observer
    from gateway.request.leases import LeaseKeeper
    from gateway.upstream.pools import Router

log = logging.getLogger("tokengate.proxy")

_DRAINING = "The gateway is shutting down; retry on another replica"
# Connection options that name no forwarded header: "close", and headers never forwarded anyway.
_NOT_FORWARDED = frozenset({"close", *(name.decode("latin-1") for name in REQUEST_DROP)})
# A stream's lease grows once its output reaches this share of what the lease holds.
_GROW_AT = 0.9


class ClientGone(Exception):
    """The client disconnected before its request body was complete."""


class _ConnectFailed(Exception):
    """The request never reached this backend: another one of the pool may take it."""

    def __init__(self, failure: Any) -> None:
        self.failure = failure


@dataclass(frozen=True, slots=True)
class BodyDeadlines:
    total_s: float
    idle_s: float


async def _watch_disconnect(x: Exchange) -> None:
    while True:
        message = await x.receive()
        if message["type"] == "http.disconnect":
            x.disconnected()
            return


async def read_body(
    receive: Receive,
    content_length: int,
    limit: int,
    deadlines: BodyDeadlines,
    signals: RequestSignals | None = None,
) -> bytes:
    """The whole request body, refusing (413) as soon as it is known to exceed ``limit``.

    A body must arrive within ``deadlines.total_s`` of the headers, with no gap between two of its
    chunks longer than ``deadlines.idle_s`` (408 otherwise): a client dripping its body, or one whose
    ``Content-Length`` promises more than it sends, holds a connection for seconds, not for ever.
    When the server's ``signals`` say the body is already complete (it came with the headers, as
    almost every API request's does), it is taken without arming that deadline.
    """
    if content_length > limit:
        raise ApiError(
            413,
            f"Request body is {content_length} bytes, above the limit of {limit} bytes (limits.max_body_bytes)",
            code="request_too_large",
        )
    first: MutableMapping[str, Any] | None = None
    if signals is not None and signals.body_complete:
        # Buffered whole by the server: receive() returns it at once, in one message.
        first = await receive()
        if first["type"] == "http.disconnect":
            raise ClientGone
        if not first.get("more_body", False):
            whole: bytes = first.get("body", b"")
            if len(whole) > limit:
                raise _too_large(limit)
            return whole
    loop = asyncio.get_running_loop()
    start = loop.time()
    final = start + deadlines.total_s
    try:
        async with asyncio.timeout(min(final, start + deadlines.idle_s)) as deadline:
            message = first if first is not None else await receive()
            if message["type"] == "http.disconnect":
                raise ClientGone
            body: bytes = message.get("body", b"")
            if not message.get("more_body", False):
                if len(body) > limit:
                    raise _too_large(limit)
                return body
            chunks = [body]
            size = len(body)
            while True:
                deadline.reschedule(min(final, loop.time() + deadlines.idle_s))
                message = await receive()
                if message["type"] == "http.disconnect":
                    raise ClientGone
                chunk = message.get("body", b"")
                size += len(chunk)
                if size > limit:
                    raise _too_large(limit)
                chunks.append(chunk)
                if not message.get("more_body", False):
                    return b"".join(chunks)
    except TimeoutError:
        waited = loop.time() - start
        raise ApiError(
            408,
            f"The request body did not arrive in time ({waited:.1f} s; limits.body_timeout_s "
            f"{deadlines.total_s:g} s in all, limits.body_idle_timeout_s {deadlines.idle_s:g} s between chunks)",
            code="body_timeout",
        ) from None


def _sequences(cost: Cost) -> int:
    """How many sequences a request runs in the engine: its choices (times its prompts), read off
    its priced output; 1 for a request that generates nothing (embeddings)."""
    return max(1, cost.decode // cost.per_choice) if cost.per_choice > 0 else 1


def _serialized(body: dict[str, Any]) -> bytes:
    """``body`` as the backend will read it (``Proxy._payload``): each key once, as parsed. JSON the
    parser took but cannot write back (nested deeper than orjson's 254 levels, in a field pricing
    does not read) is a 400 here, before the request waits for anything, not a 500 at the send."""
    try:
        return orjson.dumps(body)
    except TypeError:
        raise ApiError(
            400,
            f"Request body is nested more than {MAX_JSON_DEPTH} levels deep; flatten it",
            code="invalid_json",
        ) from None


# A serialized body up to this size is kept to send as is; a larger one is made again at the send
# (~1 ms per MB), so that while it waits to be admitted a large body is held once (parsed), not twice.
_KEEP_SENT_BYTES = 64 * 1024


def _kept(sent: bytes) -> bytes:
    """``sent`` if it is worth keeping until the send, else b"" (``Proxy._payload`` makes it again)."""
    return sent if len(sent) <= _KEEP_SENT_BYTES else b""


def _too_large(limit: int) -> ApiError:
    return ApiError(
        413,
        f"Request body exceeds the limit of {limit} bytes (limits.max_body_bytes)",
        code="request_too_large",
    )


def _max_wait_header(value: bytes) -> float:
    try:
        seconds = float(value)
    except ValueError:
        seconds = -1.0
    if not seconds >= 0 or seconds == float("inf"):
        raise ApiError(
            400,
            "x-tokengate-max-queue-wait must be a non-negative number of seconds, got "
            f"{show_value(value.decode('latin-1'))}",
            param="x-tokengate-max-queue-wait",
            code="invalid_header",
        )
    return seconds


@dataclass(frozen=True)
class ProxyParts:
    """What the request path uses for the process's life (a reload changes none of it)."""

    store: BudgetStore
    keeper: LeaseKeeper
    metrics: GatewayMetrics
    observer: Observer
    router: Router  # reconfigures itself in place
    exchanges: set[Exchange]  # the requests in the gateway now (drain waits on them)
    hooks: list[Callable[[Record, float], None]]  # the same list: hooks added later are seen
    limits: LimitsConfig  # a restart-only section: one count for the process's life
    cooldown_s: float  # a backend's breaker cooldown: the Retry-After when none is healthy
    draining: Callable[[], bool]
    tracer: Tracer | None = None  # None: tracing off, and the request path reads no trace header
    quotas: QuotaGate | None = None  # None: no tenant has a quota, and the request path never asks
    shadow: ShadowLimits | None = None  # in-flight limits in shadow mode (watched, never enforced)
    billing: UsageRecorder | None = None  # None: no usage kept for billing (usage_log.enabled false)


# Read (and replaced by ours) while tracing is on; forwarded as they came while it is off.
_TRACE_HEADERS = frozenset({b"traceparent", b"tracestate"})


def _used(x: Exchange) -> Usage | None:
    """What a request used, as its quotas and the usage log count it: nothing when it never ran,
    None when it ran and its use is unknown, else the engine's usage."""
    rec = x.record
    if not rec.granted:
        return NOT_RUN
    if x.completion_tokens is None:
        return None  # unknown: what it reserved is charged
    prompt = rec.prompt_tokens
    if prompt is None:  # no usage: the priced prompt, unless nothing reached an engine
        prompt = 0 if x.completion_tokens == 0 and not x.started else rec.prefill
    return Usage(prompt, rec.cached_tokens or 0, x.completion_tokens)


class _CountFirst(Exception):
    """Admission refused a cost priced on an estimate as too big: count exactly, then decide."""


def _retrieved(future: asyncio.Future[Any]) -> None:
    """An exact count's end: its failure is not news (the engine judges an over-long prompt)."""
    if not future.cancelled():
        future.exception()


class Proxy:
    """Request handling; one instance per app, created at start-up (needs the session). It takes
    its parts from :class:`ProxyParts` and, on every swap, from the :class:`Live` parts."""

    def __init__(self, parts: ProxyParts, live: LiveParts, session: aiohttp.ClientSession) -> None:
        self.session = session
        self.store = parts.store
        self.keeper = parts.keeper
        self.metrics = parts.metrics
        self.exchanges = parts.exchanges
        self.hooks = parts.hooks
        self.observer = parts.observer
        self.router = parts.router
        self.cooldown_s = parts.cooldown_s
        self.draining = parts.draining
        self.tracer = parts.tracer
        self.quotas = parts.quotas
        self.shadow = parts.shadow
        self.billing = parts.billing
        self._drop = REQUEST_DROP if parts.tracer is None else REQUEST_DROP | _TRACE_HEADERS
        self._demand_pools: dict[tuple[str, str, str | None], tuple[str, ...]] = {}
        self._urls: dict[tuple[int, bytes], URL] = {}
        limits = parts.limits
        self.held = HeldBodies(limits.max_held_body_bytes, limits.max_held_body_bytes_per_tenant)
        self.connections = TenantConnections(limits.max_connections_per_tenant)
        self.media = MediaFetcher(lambda: self.pricer.settings.media_urls)
        self.bind(live.current)
        live.subscribe(self.bind)

    def bind(self, live: Live) -> None:
        """Take the live parts (again, after a reconfiguration). Requests in flight keep the
        references they already read; the next step of each reads the new ones."""
        cfg = live.config
        self.pools_config = cfg.pools
        self.auth = live.auth
        self.pricer = live.pricer
        self.classifier = live.classifier
        self.models = live.models
        self.overheads = live.prompt_overheads
        self.reservations = live.reservations
        self.max_body = cfg.limits.max_body_bytes
        self.refused_fields = frozenset(cfg.limits.refused_fields)
        self.private_headers = HeaderNames.of(cfg.limits.private_headers)
        self.body_deadlines = BodyDeadlines(cfg.limits.body_timeout_s, cfg.limits.body_idle_timeout_s)
        self.default_max_tokens = cfg.pricing.default_max_tokens
        self.enforce_max_tokens = cfg.enforce_max_tokens
        self.open_mode = cfg.open_mode
        self.trust_request_id = cfg.logging.trust_request_id
        if self.quotas is not None:
            self.quotas.bind(cfg.tenants, cfg.models)
        if self.shadow is not None:
            self.shadow.bind(live.tenants, cfg.tiers, live.layout)
        self._demand_pools.clear()  # pool names may have changed meaning
        self._urls.clear()  # backends may have moved

    # ---- the request, end to end ----

    async def handle(
        self,
        scope: Scope,
        receive: Receive,
        send: Send,
        kind: RouteKind,
        route: PassthroughRoute | None = None,
    ) -> None:
        task = asyncio.current_task()
        assert task is not None
        rec = Record(method=scope["method"], path=scope["path"], start=perf_counter(), request_id=new_id())
        x = Exchange(scope, receive, send, kind, route, rec, task)
        self.exchanges.add(x)
        try:
            await self._steps(x)
        except ApiError as exc:
            await self._fail(x, exc)
        except ClientGone:
            if not x.stream_complete:  # (after the stream's end it is the client's business)
                rec.status, rec.outcome, rec.reason = 499, "client_disconnect", "client_disconnect"
        except asyncio.CancelledError:
            reason = x.cancel_reason
            if reason is None:
                rec.status, rec.outcome, rec.reason = 499, "shutdown", "shutdown"
                raise  # not ours: the server is tearing the task down
            task.uncancel()
            if reason is CancelReason.DISCONNECT:
                if not x.stream_complete:  # (after the stream's end it is the client's business)
                    rec.status, rec.outcome, rec.reason = 499, "client_disconnect", "client_disconnect"
            elif reason is CancelReason.DRAINING:
                await self._fail(x, ApiError(503, _DRAINING, code="draining", retry_after_s=1.0))
            else:
                await self._fail(
                    x, ApiError(503, "The gateway shut down before the request completed", code="shutdown")
                )
                rec.outcome = "shutdown"
        except Exception as exc:
            log.exception("unexpected error on %s %s", rec.method, show_value(rec.path))
            rec.error = f"{exc.__class__.__name__}: {exc}"
            await self._fail(x, ApiError(500, "Internal gateway error", code="internal_error"))
            rec.outcome = "internal_error"
        finally:
            self.exchanges.discard(x)
            if x.held_body and x.tenant is not None:
                self.held.give_back(x.tenant.name, x.held_body)
                x.held_body = 0
            self._finish(x, perf_counter())

    async def _steps(self, x: Exchange) -> None:
        if x.kind is not RouteKind.PASSTHROUGH and x.record.method != "POST":
            raise ApiError(
                405,
                f"Method {x.record.method} not allowed on {x.record.path}; use POST",
                code="method_not_allowed",
            )
        self.authenticate(x)
        self._refuse_if_draining()
        tenant = x.tenant
        assert tenant is not None
        signals = request_signals(x.scope)
        if signals is not None:
            if signals.connection is not None and not self.open_mode:
                self.connections.claim(signals.connection, tenant.name)
            x.forwarder = signals.forwarder
        # The body's bytes are held from before it is read until the request ends: a 429 or 503 now,
        # while nothing is read or held, rather than a process out of memory.
        n = x.content_length
        expected = n if 0 <= n <= self.max_body else 0 if n > self.max_body else self.max_body  # (>: a 413)
        self.held.take(tenant.name, expected, open_mode=self.open_mode)
        x.held_body = expected
        await self.read(x, signals)
        self.held.resize(tenant.name, x.held_body, len(x.raw))
        x.held_body = min(x.held_body, len(x.raw))
        # A hang-up from here on cancels the request (and with it the upstream call): told by the
        # gateway's own HTTP server, else seen by a task waiting on receive().
        watcher = None
        if signals is not None:
            signals.on_disconnect = x.disconnected
        else:
            watcher = asyncio.create_task(_watch_disconnect(x))
        try:
            await self.price(x)
            if x.exact is not None and self._class_depends_on_count(x):
                await self._count_now(x)
            self.classify(x)
            if self.quotas is not None and self.quotas.configured:
                await self.reserve_quota(x)
            try:
                try:
                    await self.admit(x)
                except _CountFirst:  # too big on the estimate: the exact count decides
                    await self._count_now(x)
                    self.classify(x)
                    await self.admit(x)
                if x.exact is not None:
                    x.correction = asyncio.create_task(self._correct(x))
                try:
                    if self.shadow is not None and self.shadow.configured:
                        await self.watch_shadow(x)
                    await self.forward(x)
                finally:
                    await self.release(x)
            finally:
                if x.quota is not None:
                    await self.settle_quota(x)
        finally:
            # An exact count still being made finishes, unless the request was cancelled (its
            # client gone, a drain): it teaches the ratio and the estimate's error, at the cost of
            # one encode, as the request would have cost without estimates.
            if x.exact is not None and x.cancel_reason is not None:
                x.exact.cancel()
            x.done = True
            if signals is not None:
                signals.on_disconnect = None
            if watcher is not None:
                watcher.cancel()

    # ---- 1. authenticate ----

    def authenticate(self, x: Exchange) -> None:
        """API key -> tenant and tier; the headers to forward; the client's own limits."""
        key: str | None = None
        alt_key: str | None = None
        raw_auth: str | None = None
        tier_name: str | None = None
        max_wait_s: float | None = None
        encoded: bytes | None = None
        hop: set[str] | None = None  # headers the client's Connection header names: this hop's only
        traceparent: str | None = None
        tracestate: str | None = None
        fwd = x.headers
        drop = self._drop
        private = x.private_headers = self.private_headers
        for name, value in x.scope["headers"]:
            if name in drop:
                if name == b"connection":
                    named = {t.strip().lower() for t in value.decode("latin-1").split(",")}
                    hop = named if hop is None else hop | named
                elif name == b"authorization":
                    raw_auth = value.decode("latin-1")
                    key = bearer_key(raw_auth)
                elif name == b"content-length":
                    try:
                        x.content_length = int(value)
                    except ValueError:
                        raise ApiError(400, "Invalid Content-Length header", code="invalid_header") from None
                elif name == b"api-key" or name == b"x-api-key":
                    alt_key = value.decode("latin-1").strip()
                elif name == b"traceparent":  # (dropped only while tracing is on: ours goes instead)
                    traceparent = value.decode("latin-1")
                elif name == b"tracestate":
                    tracestate = value.decode("latin-1")
                continue
            if name.startswith(b"x-tokengate-"):
                if name == b"x-tokengate-tier":
                    tier_name = value.decode("latin-1").strip()
                elif name == b"x-tokengate-max-queue-wait":
                    max_wait_s = _max_wait_header(value)
                elif name == b"x-tokengate-oracle-output" and self.reservations.default.oracle_header:
                    # benchmarks only: read where reservation.oracle_header turns it on, else dropped
                    x.oracle_output = int(value) if value.isdigit() and len(value) < 10 else None
                continue
            if name in private:
                continue
            if name == b"x-request-id":
                adopted, x.record.client_request_id = from_client(value, self.trust_request_id)
                if adopted is not None:
                    x.record.request_id = adopted
                continue
            if name == b"content-type":
                if x.has_content_type:  # (engines' parsers refuse it, in their own words, or pick one)
                    raise ApiError(
                        400,
                        "The request has more than one Content-Type header; send one: "
                        "'Content-Type: application/json'",
                        code="invalid_header",
                    )
                x.has_content_type = True
            elif name == b"content-encoding" and value.strip().lower() not in (b"", b"identity"):
                encoded = value
            fwd.append((name.decode("latin-1"), value.decode("latin-1")))
        if self.tracer is not None:
            x.record.trace = self.tracer.begin(traceparent, tracestate)
        if hop and not hop <= _NOT_FORWARDED:  # (most clients send "keep-alive": nothing to do)
            fwd[:] = [(n, v) for n, v in fwd if n not in hop]  # (ASGI names are lower case)
            x.has_content_type = x.has_content_type and "content-type" not in hop

        tenant, x.api_key = self.auth.identify(key or alt_key)
        x.record.tenant = tenant.name
        tier = self.auth.tier_for(tenant, tier_name)
        x.record.tier = tier.name
        x.tenant, x.tier = tenant, tier
        if encoded is not None:
            # The price is read from the body: a compressed one would be priced at its compressed
            # size (a pass-through route) and then inflated by any backend that decodes it.
            raise ApiError(
                415,
                f"Content-Encoding {show_value(encoded.decode('latin-1'))} is not supported: send the"
                " request body uncompressed, without a Content-Encoding header",
                code="unsupported_content_encoding",
            )
        # A client may ask to wait less than its tier allows, never more.
        x.max_wait_s = tier.max_queue_wait_s if max_wait_s is None else min(max_wait_s, tier.max_queue_wait_s)
        if self.open_mode and raw_auth is not None:
            # An open gateway is a transparent proxy: a key the client sent is meant for the
            # backend (unless the backend has its own key configured, which replaces it).
            fwd.append(("Authorization", raw_auth))

    # ---- 2. read ----

    async def read(self, x: Exchange, signals: RequestSignals | None = None) -> None:
        x.raw = await read_body(x.receive, x.content_length, self.max_body, self.body_deadlines, signals)

    # ---- 3. price ----

    async def price(self, x: Exchange) -> None:
        """Parse and validate the body, and price it: ``x.model``, ``x.body``, ``x.cost``."""
        tenant = x.tenant
        assert tenant is not None
        default_max = tenant.default_max_tokens or self.default_max_tokens
        if x.kind is RouteKind.PASSTHROUGH:
            model, x.body = self._passthrough_model(x.raw)
            if x.body is not None:
                self._refuse_engine_fields(x.body)
                named = x.body.get("model")
                if isinstance(named, str) and not may_use(tenant, named):
                    raise self._unknown_model(named, tenant)  # (its models bound pass-through routes too)
                try:
                    self.pricer.check_passthrough_media(x.raw, x.body)
                except InvalidRequest as exc:
                    raise ApiError(400, exc.message, param=exc.param, code=exc.code) from None
                await self._inline_media(x, x.body)
                x.sent = _kept(_serialized(x.body))
            x.cost = await self.pricer.aprice_passthrough(
                x.raw,
                model=model,
                default_max_tokens=default_max,
                generates=x.route is not None and x.route.generates,
                context_length=self.models.context_length(model) if model else None,
                fair_key=tenant.name,
            )
            x.model = model or ""
            if x.body is not None:
                x.raw = b""  # (a JSON body goes as x.sent: see below)
            return
        try:
            body = orjson.loads(x.raw)
        except orjson.JSONDecodeError as exc:
            raise ApiError(400, f"Request body is not valid JSON: {exc}", code="invalid_json") from None
        # The client's bytes are not sent (the parsed body is, serialized again) nor read again:
        # dropped now, a large body waiting to be priced and admitted is held once, as parsed (with
        # _kept below), not three times (docs/security.md, section 3).
        x.raw = b""
        if not isinstance(body, dict):
            raise ApiError(400, "Request body must be a JSON object", code="invalid_json")
        self._refuse_engine_fields(body)
        model = body.get("model")
        if not isinstance(model, str) or not model:
            raise ApiError(
                400,
                "'model' must be a non-empty string naming the model",
                param="model",
                code="invalid_type" if model is not None else "missing_required_parameter",
            )
        if not self.router.known_model(model) or not may_use(tenant, model):
            # (one answer for both: which models exist for other tenants is not this one's to learn)
            raise self._unknown_model(model, tenant)
        x.body, x.model = body, model
        if x.record.trace is not None:
            rec = x.record
            rec.model = model
            limit = body.get("max_tokens", body.get("max_completion_tokens", body.get("max_output_tokens")))
            rec.max_tokens = limit if type(limit) is int else None
        if x.kind is RouteKind.RESPONSES:
            server_tools.check(tenant.server_tools, body)
        await self._inline_media(x, body)
        ctx = self.models.context_length(model)
        p = self.pricer
        try:
            if x.kind is RouteKind.EMBEDDING:
                x.cost = await p.aprice_embeddings(body, context_length=ctx, fair_key=tenant.name)
            else:
                price = (
                    p.aprice_chat
                    if x.kind is RouteKind.CHAT
                    else p.aprice_responses
                    if x.kind is RouteKind.RESPONSES
                    else p.aprice_completion
                )
                x.cost = await price(
                    body,
                    default_max_tokens=default_max,
                    max_tokens_limit=tenant.max_max_tokens,
                    context_length=ctx,
                    fair_key=tenant.name,  # long prompts are encoded fairly among tenants
                )
        except InvalidRequest as exc:
            raise ApiError(400, exc.message, param=exc.param, code=exc.code) from None
        if x.cost.exact is not None:
            x.exact, x.estimated_prefill = x.cost.exact, x.cost.prefill
            x.exact.add_done_callback(_retrieved)
        self._add_prompt_overhead(x)
        x.priced = x.cost
        # (after pricing: a priced field nested too deep gets pricing's 400, which names the field)
        x.sent = _kept(_serialized(body))

    # ---- 3b. estimates (pricing.estimate_above_chars) ----

    def _class_depends_on_count(self, x: Exchange) -> bool:
        """Whether the class rules could place the request otherwise with its exact count: classified
        at the estimate's low and high ends (its margin either way), the class differs."""
        classifier, cost, tenant = self.classifier, x.cost, x.tenant
        if classifier is None or cost is None or tenant is None or not classifier.counts_tokens:
            return False
        margin = 1.0 + self.pricer.settings.estimate_margin_percent / 100
        body = x.body or {}
        low = classifier.classify(
            cost=replace(cost, prefill=int(cost.prefill / margin**2)),
            model=x.model,
            tenant=tenant.name,
            body=body,
        )
        high = classifier.classify(
            cost=replace(cost, prefill=math.ceil(cost.prefill * margin)),
            model=x.model,
            tenant=tenant.name,
            body=body,
        )
        return low != high

    async def _exact_delta(self, x: Exchange) -> int | None:
        """Wait for the exact count: exact minus estimated prompt tokens; None if it never came (an
        encode failure: the engine, which counts for itself, decides)."""
        exact = x.exact
        assert exact is not None
        try:
            cost = await asyncio.shield(exact)  # (a cancelled waiter leaves the count to _steps)
        except InvalidRequest:
            x.exact = None
            return None
        x.exact = None
        if x.record.trace is not None and x.estimated_prefill:
            x.record.estimate_error = cost.prefill / x.estimated_prefill - 1.0
        return cost.prefill - x.estimated_prefill

    async def _count_now(self, x: Exchange) -> None:
        """Before admission: the exact count replaces the estimate (classify runs again on it)."""
        delta = await self._exact_delta(x)
        priced = x.priced
        assert priced is not None
        if delta:
            x.cost = x.priced = replace(priced, prefill=priced.prefill + delta)
        else:
            x.cost = priced
        x.reserved, x.record.slot_tokens = None, 0

    async def _correct(self, x: Exchange) -> None:
        """After admission, while the request runs: the exact count corrects the lease. More tokens
        than estimated grow it (never waiting: past the pools' capacity an overdraft, counted);
        fewer stay held until release, where the engine's usage settles what was used."""
        delta = await self._exact_delta(x)
        lease, cost, rec = x.lease, x.cost, x.record
        if not delta or lease is None or cost is None:
            return
        x.cost = replace(cost, prefill=cost.prefill + delta)
        rec.prefill += delta
        if delta < 0:
            return
        try:
            over = await self.store.extend(lease.id, delta)
        except Exception:  # (the store's own outage handling has logged it)
            over = None
        rec.overdraft += delta if over is None else over  # None: the store could not grow it now

    def _add_prompt_overhead(self, x: Exchange) -> None:
        """The model's prompt overhead (configured, else learned from the usage engines report) on
        the priced prompt: what the engine's chat template adds beyond the tokenizer's count. The
        one place a price is corrected; pricing's context-length check (inside the walks) saw the
        prompt as counted, and the engine checks what it really renders."""
        cost = x.cost
        assert cost is not None
        route = x.kind.value
        overhead = self.overheads.overhead(x.model, route, self.models.prompt_overhead(x.model))
        if overhead:
            prefill = corrected(cost.prefill, overhead)
            x.prompt_overhead = prefill - cost.prefill
            x.cost = replace(cost, prefill=prefill)

    async def _inline_media(self, x: Exchange, body: dict[str, Any]) -> None:
        """With ``pricing.media_urls.fetch``, the body's http(s) media fetched by the gateway and sent
        inline (gateway/request/media_fetch.py); the most the fetches can bring is held before they start
        (a 429 / 503 past the limits), then what they brought."""
        tenant = x.tenant
        assert tenant is not None
        before = x.held_body

        def hold(n: int) -> None:
            self.held.take(tenant.name, n, open_mode=self.open_mode)
            x.held_body += n

        inline = await self.media.inline(
            body, self.pricer.settings.max_items, hold, None if self.open_mode else tenant.name
        )
        held_for_media = x.held_body - before
        if held_for_media > inline:
            self.held.give_back(tenant.name, held_for_media - inline)
            x.held_body = before + inline

    def _refuse_engine_fields(self, body: dict[str, Any]) -> None:
        """A top-level field in ``limits.refused_fields`` (config.ENGINE_INTERNAL_FIELDS by default:
        what an engine trusts only from its own serving stack) is a 400, before anything is held."""
        if self.refused_fields.isdisjoint(body):
            return
        name = next(k for k in body if k in self.refused_fields)
        raise ApiError(
            400,
            f"{show_value(name)} is set by the serving stack, never by a client request; remove it "
            "(limits.refused_fields)",
            param=name,
            code="unsupported_parameter",
        )

    def _passthrough_model(self, raw: bytes) -> tuple[str | None, dict[str, Any] | None]:
        if raw[:3] == b"\xef\xbb\xbf" or raw[:2] in (b"\xff\xfe", b"\xfe\xff") or b"\x00" in raw[:4]:
            # Python's json (the engines' parser) reads JSON after a byte-order mark and in UTF-16 or
            # UTF-32, which orjson does not: such a body would go unchecked.
            raise ApiError(
                400,
                "Request body starts with a byte-order mark or is UTF-16/UTF-32: send JSON as UTF-8 "
                "without a byte-order mark",
                code="invalid_json",
            )
        if raw.lstrip()[:1] != b"{":  # (as pricing reads it: classifiers.pricing, pass-through)
            return None, None
        try:
            body = orjson.loads(raw)
        except orjson.JSONDecodeError as exc:
            # A body that looks like JSON is checked before it is forwarded. One that orjson refuses
            # but a laxer parser reads (Python's json, the engines': NaN, Infinity, 1e400, a lone
            # surrogate) would go unchecked: refused like a priced route's.
            raise ApiError(400, f"Request body is not valid JSON: {exc}", code="invalid_json") from None
        if not isinstance(body, dict):
            return None, None
        model = body.get("model")
        return (model if isinstance(model, str) and model and self.router.known_model(model) else None), body

    def _unknown_model(self, model: str, tenant: TenantConfig) -> ApiError:
        served = ", ".join(visible_models(tenant, self.router.served_models())) or "(none)"
        return ApiError(
            404,
            f"The model {show_value(model)} does not exist or is not available to this API key; "
            f"models: {served}",
            param="model",
            code="model_not_found",
        )

    # ---- 4. classify ----

    def classify(self, x: Exchange) -> None:
        """Class rules -> class and backend pool (the healthy primary, else the overflow pool)."""
        cost, tenant, tier = x.cost, x.tenant, x.tier
        assert cost is not None and tenant is not None and tier is not None
        primary: str | None = None
        overflow: str | None = None
        class_budget: int | None = None
        if x.kind is RouteKind.PASSTHROUGH:
            klass = "passthrough"
        elif self.classifier is not None:
            rc = self.classifier.classify(cost=cost, model=x.model, tenant=tenant.name, body=x.body or {})
            klass, overflow, class_budget = rc.name, rc.overflow_pool, rc.budget_tokens
            primary = rc.pool  # None: the pool that serves the model
        else:
            klass = "default"
        rec = x.record
        rec.klass, rec.prefill, rec.decode = klass, cost.prefill, cost.decode
        x.bound = self.metrics.bind(klass, tenant.name, tier.name)
        rec.stream = x.body is not None and x.kind is not RouteKind.EMBEDDING and bool(x.body.get("stream"))
        try:
            pool = (
                self.router.choose_pool(x.model, primary, overflow)
                if x.model
                else next(iter(self.router.pools))
            )
        except NoBackend as exc:
            if exc.unknown_model:
                raise ApiError(404, exc.message, param="model", code="model_not_found") from None
            raise ApiError(
                503, exc.message, code="no_healthy_backend", retry_after_s=self.cooldown_s
            ) from None
        rec.pool = pool
        key = (tenant.name, pool, klass if class_budget else None)
        pools = self._demand_pools.get(key)
        if pools is None:
            pools = (tenant_pool(tenant.name), backend_pool(pool))
            if class_budget:
                pools += (class_pool(klass),)
            self._demand_pools[key] = pools
        x.placement = Placement(klass, pool, pools)
        if cost.decode > 0:
            r = self.reservations.reserve(
                cost=cost, tenant=tenant.name, model=x.model, klass=klass, pool=pool, oracle=x.oracle_output
            )
            x.reserved = r
            if r.decode != cost.decode:
                x.cost = with_decode(cost, r.decode)
                rec.decode = r.decode
        # Each sequence holds at least its share of the engine's sequence slots (max_num_seqs):
        # otherwise a tenant's many tiny requests fill the slots within its token budget, and
        # everyone else's wait inside the engine, where the fair queue cannot see them.
        live = self.router.pools[pool]
        sequences = _sequences(cost)
        least = live.sequence_tokens * sequences
        held = x.cost or cost
        if least > held.total:
            rec.slot_tokens = least - held.total
            x.cost = held = with_decode(held, least - held.prefill)
            rec.decode = held.decode
        # The engine holds each sequence in whole KV blocks: so does the price (block_size 1: as is).
        block = live.block_tokens * sequences
        if block > sequences and cost.decode > 0 and held.total % block:
            x.cost = with_decode(held, -(-held.total // block) * block - held.prefill)
            rec.decode = x.cost.decode

    # ---- 5. admit ----

    async def reserve_quota(self, x: Exchange) -> None:
        """Reserve the request's price in every quota of its tenant (a 429 at once when one is full:
        only time frees a window, so it never queues for one)."""
        cost, tenant = x.cost, x.tenant
        assert cost is not None and tenant is not None and self.quotas is not None
        # The output it asked for; not the share of the engine's sequence slots held beside it in
        # the pools (slot_tokens: KV room, not usage).
        decode = cost.decode - x.record.slot_tokens
        x.quota, x.ratelimit = await self.quotas.reserve(
            tenant.name, x.model, cost.prefill, decode, x.api_key
        )

    async def settle_quota(self, x: Exchange) -> None:
        """Exactly once per reservation: what the request used (nothing, if it never ran)."""
        hold, x.quota = x.quota, None
        assert hold is not None and self.quotas is not None
        used = _used(x)
        await self.quotas.settle(hold, used)

    async def admit(self, x: Exchange) -> None:
        """Take the cost from every pool at once, now or after waiting in the queue."""
        cost, placement, tenant, tier = x.cost, x.placement, x.tenant, x.tier
        assert cost is not None and placement is not None and tenant is not None and tier is not None
        # A tenant with a budget holds its request's whole output limit there even when the
        # request reserves less (learned reservations): what it may run to stays within its
        # budget, however low its past has trained the estimate (budgets.types.Demand).
        r = x.reserved
        limit = r.limit if r is not None and r.reduced and tenant.enforced_budget is not None else 0
        demand = Demand(tenant.name, tier.name, placement.pools, cost.prefill, cost.decode, limit)
        self._refuse_if_draining()
        x.phase = Phase.QUEUED
        rec = x.record
        rec.queued_at = t_queue = perf_counter()
        try:
            x.lease = await self.store.acquire(demand, x.max_wait_s)
            rec.granted = True
        except AdmissionError as exc:
            if isinstance(exc, NeverFits) and x.exact is not None:
                raise _CountFirst from None
            if isinstance(exc, NeverFits) and rec.slot_tokens:
                asked = cost.decode - rec.slot_tokens
                if cost.prefill + asked <= exc.limit:  # only the slot floor made it too big
                    pool_cfg = next((p for p in self.pools_config if p.name == placement.pool), None)
                    live = self.router.pools.get(placement.pool)
                    per_seq = live.sequence_tokens if live is not None else cost.prefill + cost.decode
                    message = slots.refusal(exc, pool_cfg, per_seq, cost.prefill, asked)
                    raise ApiError(413, message, code="cost_exceeds_capacity") from None
            raise from_admission(exc) from None
        finally:
            rec.queue_s = perf_counter() - t_queue
        self.keeper.add(x.lease.id)
        self.observer.admitted(rec)

    async def watch_shadow(self, x: Exchange) -> None:
        """A granted request in the gauges of the limits in shadow mode: counted where one of them
        would have kept it waiting (it runs all the same)."""
        lease, tenant, tier = x.lease, x.tenant, x.tier
        assert lease is not None and tenant is not None and tier is not None and self.shadow is not None
        d = lease.demand
        r = x.reserved  # what the budget would hold: the whole output limit (admit)
        private = d.prefill + max(d.decode, r.limit if r is not None and r.reduced else 0)
        x.shadow = await self.shadow.hold(tenant.name, tier.name, d.pools, d.cost, private)

    def _refuse_if_draining(self) -> None:
        # Checked on arrival and again just before queueing: drain may begin while a body is read.
        if self.draining():
            raise ApiError(503, _DRAINING, code="draining", retry_after_s=1.0)

    # ---- 6. forward ----

    async def forward(self, x: Exchange) -> None:
        """The freest healthy backend of the pool; a connect failure (the request never arrived) is
        retried on the pool's next one. Records the completion tokens the backend reported."""
        placement, cost = x.placement, x.cost
        assert placement is not None and cost is not None
        pool = self.router.pools.get(placement.pool)  # None: removed by a reconfiguration meanwhile
        model = x.model or None
        backend = pool.pick(model) if pool is not None else None
        if pool is None or backend is None:
            raise ApiError(
                503,
                f"No healthy backend in pool {placement.pool!r}",
                code="no_healthy_backend",
                retry_after_s=1.0,
            )
        x.phase = Phase.UPSTREAM
        tried: list[Backend] = []
        while True:
            x.record.backend = backend.name
            with backend.occupy(cost.total):
                try:
                    if backend.gate is not None:
                        await self._enter_gate(x, backend)
                    await self._exchange_with(x, backend)
                    return
                except _ConnectFailed as exc:
                    tried.append(backend)
                    nxt = pool.pick(model, exclude=tried)
                    if nxt is None:
                        x.completion_tokens = 0  # it never reached a backend: nothing was served
                        raise upstream_failed(x, exc.failure) from None
                    log.warning(
                        "upstream connect failed, retrying on the next backend: %s", exc.failure.detail
                    )
                finally:
                    if x.gate is not None:
                        x.gate.release()  # no first token (non-streaming, error, retry): now
                        x.gate = None
            backend = nxt

    async def _enter_gate(self, x: Exchange, backend: Backend) -> None:
        """Wait at the backend's prefill gate; the wait counts as queue wait at the gateway."""
        gate, cost = backend.gate, x.cost
        assert gate is not None and cost is not None
        x.gate = gate_pass = await gate.enter(cost.prefill)
        if gate_pass.waited_s:
            rec = x.record
            rec.queue_s = (rec.queue_s or 0.0) + gate_pass.waited_s

    async def _exchange_with(self, x: Exchange, backend: Backend) -> None:
        rec = x.record
        payload = self._payload(x, backend)
        rec.upstream_at = t_up = perf_counter()
        if rec.trace is not None:
            rec.backend_url = backend.spec.url
        if x.forwarder is not None:  # another front end sends it (Envoy): the same request, its client
            headers = self._request_headers(x, backend)
            try:
                answered = await x.forwarder.forward(x, backend, payload, headers, self._growth(x))
            except BaseException:
                if x.stream_complete:  # the client hung up after the stream's end: complete
                    usage.settle(x, backend)
                raise
            if answered is not None and not x.stream_complete:
                usage.reported(x, answered)
            usage.settle(x, backend)
            return
        try:
            resp = await self.session.request(
                x.scope["method"],
                self._upstream_url(backend, x.scope),
                data=payload,
                headers=self._request_headers(x, backend),
                timeout=backend.request_timeout,
            )
        except UPSTREAM_ERRORS as exc:
            failure = classify_error(exc, pool=rec.pool or "?", backend=backend.name)
            if failure.connect_failure:
                if backend.record_connect_failure():
                    log.warning(
                        "backend %s marked unhealthy after %d connect failures",
                        backend.name,
                        backend.consecutive_failures,
                    )
                raise _ConnectFailed(failure) from None
            raise upstream_failed(x, failure) from None
        if backend.record_success():
            log.warning("backend %s is healthy again (a request got through)", backend.name)
        backend.progressed = True  # (the answer's headers: the health checker sees it is alive)
        complete = False
        try:
            status = resp.status
            if status >= 400:
                x.completion_tokens = 0  # refused or failed: the backend generated nothing
            try:
                if x.kind is RouteKind.PASSTHROUGH and status < 500:
                    await relay_raw(x, resp, backend, t_up)
                    answered = None
                elif (
                    x.kind is not RouteKind.EMBEDDING
                    and status == 200
                    and resp.content_type == "text/event-stream"
                ):
                    answered = await relay_sse(x, resp, backend, t_up, self._growth(x))
                else:
                    answered = await relay_whole(x, resp, backend, t_up)
            except UPSTREAM_ERRORS as exc:
                failure = classify_error(exc, pool=rec.pool or "?", backend=backend.name)
                raise upstream_failed(x, failure) from None
            complete = True
        finally:
            if complete:
                resp.release()
            else:
                # Closing (not releasing) drops the connection: the backend sees the disconnect
                # and aborts the generation.
                resp.close()
                if x.stream_complete:  # the client hung up after the stream's end: complete
                    usage.settle(x, backend)
        if answered is not None and not x.stream_complete:  # (a stream's was taken as it came)
            usage.reported(x, answered)
        usage.settle(x, backend)

    def _growth(self, x: Exchange) -> Grow | None:
        """The lease-growth hook for a stream that reserved less than its limit (else None)."""
        r = x.reserved
        if r is None or not r.reduced or not self.reservations.default.grow or x.lease is None:
            return None
        if x.cost is None or x.cost.decode >= r.limit:  # (held at least a sequence's share: no growth)
            return None
        x.grow_at = _GROW_AT * x.cost.decode
        return self._grow

    async def _grow(self, x: Exchange) -> None:
        """Extend the lease before the stream outgrows it: by ``grow_factor``, up to the limit. Never
        waits for room: past the pools' capacity it is an overdraft (counted), not a queue."""
        r, lease, rec, cost = x.reserved, x.lease, x.record, x.cost
        assert r is not None and lease is not None and cost is not None
        held = cost.decode + x.extended_tokens  # (the reservation, or a sequence's share above it)
        target = min(r.limit, math.ceil(held * self.reservations.default.grow_factor))
        extra = target - held
        if extra <= 0:
            x.grow_at = float("inf")
            return
        over = await self.store.extend(lease.id, extra)
        if over is None:  # the store cannot grow it now (Redis down): the whole growth is unbacked
            over = extra
        else:
            x.extended_tokens += extra
            rec.extended = x.extended_tokens
        rec.overdraft += over
        b = x.bound
        if b is not None:
            b.extensions.inc()
            if over:
                b.overdrafts.inc()
                b.overdraft_tokens.inc(over)
        x.grow_at = _GROW_AT * target if target < r.limit else float("inf")

    def _payload(self, x: Exchange, backend: Backend) -> bytes:
        """The bytes to send: a JSON body as it was parsed (and priced), never the client's bytes,
        so that the backend reads exactly the request that was priced: a key the client sent twice
        reaches it once, with the value the gateway read (the last), whatever its own parser would
        keep (``x.sent``, serialized once when the body was priced: ~0.2 µs for a 1 KB body). Sets
        whether the client asked for usage. ``x.body`` stays as the client sent it (a retry builds
        its payload again)."""
        body, kind = x.body, x.kind
        if body is None:  # not JSON (a pass-through upload): sent as it came
            x.client_wants_usage = False
            return x.raw
        # No two tenants share the engine's prefix cache where the backend keeps them apart.
        tenant = x.tenant
        salt = (
            tenant_cache_salt(tenant.name, body.get("cache_salt"))
            if tenant is not None and backend.spec.cache_salt == "tenant"
            else None
        )
        if kind is RouteKind.PASSTHROUGH:
            x.client_wants_usage = False
            reprioritize = "priority" in body and x.tier is not None
            if not reprioritize and salt is None:
                return x.sent or orjson.dumps(body)
            out = dict(body)
            if reprioritize and x.tier is not None:
                # A client's own priority never reaches the engine: the tier's where the backend
                # takes one, else none (never added where the client sent none).
                if backend.spec.accepts_priority:
                    out["priority"] = x.tier.rank
                else:
                    del out["priority"]
            if salt is not None:
                out["cache_salt"] = salt
            return orjson.dumps(out)
        assert x.cost is not None and x.tier is not None
        changes: dict[str, Any] = {}
        # The engine's scheduling priority is the tier's (accepts_priority) or nobody's: a client's
        # own "priority" would jump the queue of an engine scheduling by it.
        drop_priority = False
        if backend.spec.accepts_priority:
            if body.get("priority") != x.tier.rank:
                changes["priority"] = x.tier.rank
        elif "priority" in body:
            drop_priority = True
        if salt is not None:
            changes["cache_salt"] = salt
        wants_usage = True
        if kind is RouteKind.EMBEDDING:
            wants_usage = False
        elif kind is RouteKind.RESPONSES:
            # The Responses API always reports usage (in response.completed) and has no
            # stream_options; its output limit is max_output_tokens, for one sequence.
            if self.enforce_max_tokens and body.get("max_output_tokens") is None:
                changes["max_output_tokens"] = max(x.cost.per_choice, 1)
        else:
            if body.get("stream") is True:
                opts = body.get("stream_options")
                wants_usage = isinstance(opts, dict) and opts.get("include_usage") is True
                if not wants_usage:
                    opts = dict(opts) if isinstance(opts, dict) else {}
                    opts["include_usage"] = True
                    changes["stream_options"] = opts
            if (
                self.enforce_max_tokens
                and body.get("max_tokens") is None
                and body.get("max_completion_tokens") is None
            ):
                changes["max_tokens"] = max(x.cost.per_choice, 1)
        x.client_wants_usage = wants_usage
        if not changes and not drop_priority:
            return x.sent or orjson.dumps(body)
        out = {**body, **changes}
        if drop_priority:
            del out["priority"]
        return orjson.dumps(out)

    def _request_headers(self, x: Exchange, backend: Backend) -> list[tuple[str, str]]:
        headers = x.headers
        named = backend.spec.tenant_header
        if named is not None and x.tenant is not None:  # (set by the gateway, never by the client)
            headers = [h for h in headers if h[0] != named]
            headers.append((named, x.tenant.name))
        auth = backend.auth_header
        if auth is not None:
            headers = [h for h in headers if h[0] != "Authorization"] if self.open_mode else headers.copy()
            headers.append(auth)
        if not x.has_content_type and x.kind is not RouteKind.PASSTHROUGH:
            headers = [*headers, ("Content-Type", "application/json")]
        # The backend's logs can then be joined with ours (under the header it reads, or none).
        rid = backend.spec.request_id_header
        if rid == "x-request-id":  # (a client's x-request-id never goes upstream: authenticate)
            headers = [*headers, (rid, x.record.request_id)]
        elif rid is not None:
            headers = [*(h for h in headers if h[0] != rid), (rid, x.record.request_id)]
        trace = x.record.trace
        if trace is not None:
            headers = [*headers, *trace.upstream_headers()]
        return headers

    def _upstream_url(self, backend: Backend, scope: Scope) -> URL:
        """The backend's base URL + the request's raw path (checked by ``gateway.request.paths``), sent as is."""
        raw_path: bytes = scope.get("raw_path") or scope["path"].encode()
        qs: bytes = scope.get("query_string") or b""
        if not qs:
            key = (id(backend), raw_path)
            url = self._urls.get(key)
            if url is None:
                url = URL(backend.spec.url + raw_path.decode("ascii"), encoded=True)
                if len(self._urls) < 4096:  # the priced routes; pass-through paths may be many
                    self._urls[key] = url
            return url
        return URL(backend.spec.url + raw_path.decode("ascii") + "?" + qs.decode("latin-1"), encoded=True)

    # ---- 7. release ----

    async def release(self, x: Exchange) -> None:
        """Exactly once per granted lease, whatever happened upstream (``finally`` in ``_steps``)."""
        lease = x.lease
        if lease is None:
            return
        correction = x.correction
        if correction is not None and not correction.done():
            correction.cancel()  # no growth after release (what it grew, the release returns)
            with contextlib.suppress(asyncio.CancelledError):
                await correction
        self.keeper.discard(lease.id)
        await self.store.release(lease.id, x.completion_tokens)
        if self.billing is not None:
            self._bill(x)
        if x.shadow is not None:
            hold, x.shadow = x.shadow, None
            assert self.shadow is not None
            await self.shadow.release(hold)
        if x.reserved is not None:
            self.reservations.observe(x.reserved, x.record.completion_tokens)

    def _bill(self, x: Exchange) -> None:
        """Count a request that ran into the usage log (once: from its release)."""
        assert self.billing is not None
        rec, tenant = x.record, x.tenant
        if tenant is None:
            return
        used = _used(x)
        estimated = used is None
        if used is None:  # what its quotas settle to: the price and the reservation
            used = Usage(rec.prefill, 0, max(0, rec.decode - rec.slot_tokens))
        model = x.model or ""
        price = self.quotas.price_of(model) if self.quotas is not None and model else None
        cost = cost_micros(used.prompt, used.cached, used.output, price) if price is not None else 0
        self.billing.record(
            tenant.name, x.api_key, model, used.prompt, used.cached, used.output, cost, estimated
        )

    # ---- answers and bookkeeping ----

    async def _fail(self, x: Exchange, exc: ApiError) -> None:
        rec = x.record
        if rec.error is None:  # an upstream failure already recorded the operator's version
            rec.error = exc.message
        if rec.reason is None:
            rec.reason = exc.code or exc.type
        if rec.outcome == "ok":
            rec.outcome = "upstream_error" if exc.status in (502, 504) else "rejected"
            if exc.status == 500:
                rec.outcome = "internal_error"
        if x.started:
            x.done = True
            if not x.sse:  # a JSON body or a file failed half way: cut it, never end it as whole
                raise AnswerCut(exc.message)
            # Headers are out (a stream failed half way): end it with an SSE error event.
            await x.send(
                {"type": "http.response.body", "body": b"data: " + exc.body() + b"\n\n", "more_body": False}
            )
            return
        rec.status = exc.status
        body = exc.body()
        headers = exc.headers()
        headers.append((b"content-length", str(len(body)).encode()))
        headers.append((b"x-request-id", rec.request_id.encode()))
        if x.ratelimit:  # (a quota's own refusal carries them in exc.headers())
            headers.extend(x.ratelimit)
        if rec.klass != "unclassified":
            headers.append((b"x-tokengate-class", rec.klass.encode()))
            headers.append((b"x-tokengate-cost", str(rec.prefill + rec.decode).encode()))
        x.done = True
        x.started = True
        await x.send({"type": "http.response.start", "status": exc.status, "headers": headers})
        await x.send({"type": "http.response.body", "body": body, "more_body": False})

    def _finish(self, x: Exchange, end: float) -> None:
        """Metrics, the access line and the hooks. Never raises: bookkeeping must not fail a request
        (or hide its release) whatever a client or backend put into the record."""
        rec = x.record
        try:
            b = x.bound or self.metrics.bind(rec.klass, rec.tenant, rec.tier)
            b.outcomes[rec.outcome].inc()
            b.e2e.observe(end - rec.start)
            if rec.queue_s is not None:
                b.queue_wait.observe(rec.queue_s)
            if rec.ttft_s is not None:
                b.ttft.observe(rec.ttft_s)
            if rec.backend_s is not None:
                b.backend.observe(rec.backend_s)
            if x.reserved is not None and rec.completion_tokens is not None and not rec.usage_estimated:
                self.metrics.observe_reservation(  # (the slot share was held too: no overdraft within it)
                    b, x.reserved.decode, x.extended_tokens + rec.slot_tokens, rec.completion_tokens
                )
            if not rec.usage_estimated and (
                rec.prompt_tokens is not None or rec.completion_tokens is not None
            ):
                self.metrics.observe_usage(
                    b,
                    est_prompt=rec.prefill,
                    est_output=rec.decode - rec.slot_tokens,
                    prompt=rec.prompt_tokens,
                    output=rec.completion_tokens,
                )
            if (
                rec.prompt_tokens is not None
                and not rec.usage_estimated
                and 200 <= rec.status < 300
                and x.kind is not RouteKind.PASSTHROUGH
                and x.model
            ):  # learn what the engine counts beyond the priced prompt (before its correction)
                self.overheads.observe(
                    x.model, x.kind.value, rec.prefill - x.prompt_overhead, rec.prompt_tokens, rec.prefill
                )
        except Exception:
            log.exception("recording metrics for %s %s failed", rec.method, show_value(rec.path))
        rec.emit(end)
        for hook in self.hooks:
            try:
                hook(rec, end)
            except Exception:
                log.exception("request hook %r failed", hook)


__all__ = ["BodyDeadlines", "ClientGone", "Proxy", "read_body"]

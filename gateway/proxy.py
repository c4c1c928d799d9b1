"""The hot path: one OpenAI API request from arrival to release, as raw ASGI.

authenticate -> read body (bounded) -> price -> class -> pool -> admit (maybe queue) ->
pick backend -> forward (aiohttp) -> relay (SSE chunk by chunk) -> release exactly once.

Release happens in ``finally`` blocks on every path. A client disconnect is noticed by a small
watcher task that waits on ASGI ``receive()`` and cancels the request task; the cancellation
unwinds through the upstream read (closing the aiohttp response, which closes the backend
connection: that is how vLLM learns to abort) and through ``store.acquire`` (which withdraws a
waiting ticket). Drain and the shutdown deadline cancel request tasks the same way, with a
different ``cancel_reason``.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass
from time import perf_counter
from typing import TYPE_CHECKING, Any

import aiohttp
import orjson
from yarl import URL

from budgets.types import AdmissionError, Demand, Lease, backend_pool, class_pool, tenant_pool
from classifiers import InvalidRequest, show_value
from gateway.accesslog import Record
from gateway.auth import bearer_key
from gateway.errors import ApiError, from_admission
from gateway.metrics import Bound
from gateway.passthrough import PassthroughRoute
from gateway.sse import UsageRelay, usage_counts
from gateway.upstream.client import REQUEST_DROP, UpstreamFailure, classify_error, response_headers
from gateway.upstream.pools import Backend, NoBackend

if TYPE_CHECKING:
    from gateway.app import Gateway

Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]

log = logging.getLogger("tokengate.proxy")

CHAT, COMPLETION, EMBEDDING, PASSTHROUGH, RESPONSES = 0, 1, 2, 3, 4
HOME_POOL = "\x00home"  # the Classifier's default pool: "the model's own pool"

PRE, QUEUED, UPSTREAM = 0, 1, 2

_JSON_CT = (b"content-type", b"application/json")
_SSE_CT = b"text/event-stream"


class ClientGone(Exception):
    """The client disconnected before its request body was complete."""


@dataclass(slots=True, eq=False)
class Flight:
    """A request inside the gateway, as drain and the disconnect watcher see it."""

    task: asyncio.Task[Any]
    phase: int = PRE
    cancel_reason: str | None = None  # "disconnect" | "draining" | "shutdown"
    done: bool = False  # the final response message is being sent: never cancel now
    started: bool = False  # response headers sent
    bound: Bound | None = None  # metrics children, once the class is known

    def cancel(self, reason: str) -> None:
        if not self.done and self.cancel_reason is None:
            self.cancel_reason = reason
            self.task.cancel()


async def _watch_disconnect(receive: Receive, flight: Flight) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            flight.cancel("disconnect")
            return


async def read_body(receive: Receive, content_length: int, limit: int, deadlines: BodyDeadlines) -> bytes:
    """The whole request body, refusing (413) as soon as it is known to exceed ``limit``.

    A body must arrive within ``deadlines.total_s`` of the headers, with no gap between two of its
    chunks longer than ``deadlines.idle_s`` (408 otherwise): a client dripping its body, or one whose
    ``Content-Length`` promises more than it sends, holds a connection for seconds, not for ever.
    """
    if content_length > limit:
        raise ApiError(
            413,
            f"Request body is {content_length} bytes, above the limit of {limit} bytes (limits.max_body_bytes)",
            code="request_too_large",
        )
    loop = asyncio.get_running_loop()
    start = loop.time()
    final = start + deadlines.total_s
    try:
        async with asyncio.timeout(min(final, start + deadlines.idle_s)) as deadline:
            message = await receive()
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


@dataclass(frozen=True, slots=True)
class BodyDeadlines:
    total_s: float
    idle_s: float


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
            f"x-tokengate-max-queue-wait must be a non-negative number of seconds, got {show_value(value.decode('latin-1'))}",
            param="x-tokengate-max-queue-wait",
            code="invalid_header",
        )
    return seconds


def _upstream_failed(rec: Record, failure: UpstreamFailure) -> ApiError:
    """The tenant's answer to an upstream failure; the details go to the operator's log only."""
    rec.error = failure.detail
    log.warning("upstream failure on pool %s: %s", rec.pool, failure.detail)
    return ApiError(failure.status, failure.public, code=failure.code)


def _upstream_message(data: bytes) -> str:
    try:
        obj = orjson.loads(data)
        msg = (
            obj["error"]["message"]
            if isinstance(obj.get("error"), dict)
            else obj.get("message") or obj.get("detail")
        )
        if msg:
            return str(msg)[:500]
    except (orjson.JSONDecodeError, AttributeError, KeyError, TypeError):
        pass
    return data[:200].decode("utf-8", "replace")


class Proxy:
    """Request handling; one instance per app, created at start-up (needs the session)."""

    def __init__(self, gw: Gateway, session: aiohttp.ClientSession) -> None:
        cfg = gw.config
        self.gw = gw
        self.session = session
        self.auth = gw.auth
        self.router = gw.router
        self.pricer = gw.pricer
        self.classifier = gw.classifier
        self.models = gw.models
        self.store = gw.store
        self.keeper = gw.keeper
        self.metrics = gw.metrics
        self.flights = gw.flights
        self.hooks = gw.request_hooks  # the same list: hooks added later are seen
        self.observer = gw.observer
        self.max_body = cfg.limits.max_body_bytes
        self.body_deadlines = BodyDeadlines(cfg.limits.body_timeout_s, cfg.limits.body_idle_timeout_s)
        self.default_max_tokens = cfg.pricing.default_max_tokens
        self.enforce_max_tokens = cfg.enforce_max_tokens
        self.open_mode = cfg.open_mode
        self._demand_pools: dict[tuple[str, str, str | None], tuple[str, ...]] = {}
        self._urls: dict[tuple[int, bytes], URL] = {}
        # Per-backend constants, computed once.
        self._timeouts: dict[int, aiohttp.ClientTimeout] = {}
        self._auth_header: dict[int, tuple[str, str] | None] = {}
        for b in self.router.backends:
            t = b.spec.timeouts
            self._timeouts[id(b)] = aiohttp.ClientTimeout(
                total=None, sock_connect=t.connect_s, sock_read=t.read_s
            )
            self._auth_header[id(b)] = (
                ("Authorization", f"Bearer {b.spec.api_key}") if b.spec.api_key else None
            )

    # ---- entry points ----

    async def handle(
        self, scope: Scope, receive: Receive, send: Send, kind: int, route: PassthroughRoute | None = None
    ) -> None:
        rec = Record(method=scope["method"], path=scope["path"], start=perf_counter())
        task = asyncio.current_task()
        assert task is not None
        flight = Flight(task)
        self.flights.add(flight)
        try:
            if kind != PASSTHROUGH and rec.method != "POST":
                raise ApiError(
                    405, f"Method {rec.method} not allowed on {rec.path}; use POST", code="method_not_allowed"
                )
            await self._serve(scope, receive, send, kind, rec, flight, route)
        except ApiError as exc:
            await self._fail(send, flight, rec, exc)
        except ClientGone:
            rec.status, rec.outcome = 499, "client_disconnect"
        except asyncio.CancelledError:
            reason = flight.cancel_reason
            if reason is None:
                rec.status, rec.outcome = 499, "shutdown"
                raise  # not ours: the server is tearing the task down
            task.uncancel()
            if reason == "disconnect":
                rec.status, rec.outcome = 499, "client_disconnect"
            elif reason == "draining":
                await self._fail(
                    send,
                    flight,
                    rec,
                    ApiError(
                        503,
                        "The gateway is shutting down; retry on another replica",
                        code="draining",
                        retry_after_s=1.0,
                    ),
                )
            else:
                await self._fail(
                    send,
                    flight,
                    rec,
                    ApiError(503, "The gateway shut down before the request completed", code="shutdown"),
                )
                rec.outcome = "shutdown"
        except Exception as exc:
            log.exception("unexpected error on %s %s", rec.method, rec.path)
            rec.error = f"{exc.__class__.__name__}: {exc}"
            await self._fail(
                send, flight, rec, ApiError(500, "Internal gateway error", code="internal_error")
            )
            rec.outcome = "internal_error"
        finally:
            self.flights.discard(flight)
            self._finish(rec, flight, perf_counter())

    def _finish(self, rec: Record, flight: Flight, end: float) -> None:
        """Metrics, the access line and the hooks. Never raises: bookkeeping must not fail a request
        (or hide its release) whatever a client or backend put into the record."""
        try:
            b = flight.bound or self.metrics.bind(rec.klass, rec.tenant, rec.tier)
            b.outcomes[rec.outcome].inc()
            b.e2e.observe(end - rec.start)
            if rec.queue_s is not None:
                b.queue_wait.observe(rec.queue_s)
            if rec.ttft_s is not None:
                b.ttft.observe(rec.ttft_s)
            if rec.backend_s is not None:
                b.backend.observe(rec.backend_s)
            if rec.prompt_tokens is not None or rec.completion_tokens is not None:
                self.metrics.observe_usage(
                    b,
                    est_prompt=rec.prefill,
                    est_output=rec.decode,
                    prompt=rec.prompt_tokens,
                    output=rec.completion_tokens,
                )
        except Exception:
            log.exception("recording metrics for %s %s failed", rec.method, show_value(rec.path))
        rec.emit(end)
        for hook in self.hooks:
            try:
                hook(rec, end)
            except Exception:
                log.exception("request hook %r failed", hook)

    async def _fail(self, send: Send, flight: Flight, rec: Record, exc: ApiError) -> None:
        if rec.error is None:  # an upstream failure already recorded the operator's version
            rec.error = exc.message
        if rec.outcome == "ok":
            rec.outcome = "upstream_error" if exc.status in (502, 504) else "rejected"
            if exc.status == 500:
                rec.outcome = "internal_error"
        if flight.started:
            # Headers are out (a stream failed half way): end it with an SSE error event.
            flight.done = True
            await send(
                {
                    "type": "http.response.body",
                    "body": b"data: " + exc.body() + b"\n\n",
                    "more_body": False,
                }
            )
            return
        rec.status = exc.status
        body = exc.body()
        headers = exc.headers()
        headers.append((b"content-length", str(len(body)).encode()))
        if rec.klass != "unclassified":
            headers.append((b"x-tokengate-class", rec.klass.encode()))
            headers.append((b"x-tokengate-cost", str(rec.prefill + rec.decode).encode()))
        flight.done = True
        flight.started = True
        await send({"type": "http.response.start", "status": exc.status, "headers": headers})
        await send({"type": "http.response.body", "body": body, "more_body": False})

    # ---- the request ----

    def _refuse_if_draining(self) -> None:
        # Checked on arrival and again just before queueing: drain may begin while a body is read.
        if self.gw.draining:
            raise ApiError(
                503,
                "The gateway is shutting down; retry on another replica",
                code="draining",
                retry_after_s=1.0,
            )

    async def _serve(
        self,
        scope: Scope,
        receive: Receive,
        send: Send,
        kind: int,
        rec: Record,
        flight: Flight,
        route: PassthroughRoute | None,
    ) -> None:
        key: str | None = None
        alt_key: str | None = None
        raw_auth: str | None = None
        tier_name: str | None = None
        max_wait_s: float | None = None
        content_length = -1
        has_ct = False
        fwd: list[tuple[str, str]] = []
        drop = REQUEST_DROP
        for name, value in scope["headers"]:
            if name in drop:
                if name == b"authorization":
                    raw_auth = value.decode("latin-1")
                    key = bearer_key(raw_auth)
                elif name == b"content-length":
                    try:
                        content_length = int(value)
                    except ValueError:
                        raise ApiError(400, "Invalid Content-Length header", code="invalid_header") from None
                elif name == b"api-key" or name == b"x-api-key":
                    alt_key = value.decode("latin-1").strip()
                continue
            if name.startswith(b"x-tokengate-"):
                if name == b"x-tokengate-tier":
                    tier_name = value.decode("latin-1").strip()
                elif name == b"x-tokengate-max-queue-wait":
                    max_wait_s = _max_wait_header(value)
                continue
            if name == b"content-type":
                has_ct = True
            fwd.append((name.decode("latin-1"), value.decode("latin-1")))

        tenant = self.auth.authenticate(key or alt_key)
        rec.tenant = tenant.name
        tier = self.auth.tier_for(tenant, tier_name)
        rec.tier = tier.name
        if self.open_mode and raw_auth is not None:
            # An open gateway is a transparent proxy: a key the client sent is meant for the
            # backend (unless the backend has its own key configured, which replaces it).
            fwd.append(("Authorization", raw_auth))

        self._refuse_if_draining()

        raw = await read_body(receive, content_length, self.max_body, self.body_deadlines)
        watcher = asyncio.create_task(_watch_disconnect(receive, flight))
        try:
            # A client may ask to wait less than its tier allows, never more.
            wait_s = tier.max_queue_wait_s if max_wait_s is None else min(max_wait_s, tier.max_queue_wait_s)
            await self._priced(scope, send, kind, rec, flight, raw, fwd, has_ct, tenant, tier, wait_s, route)
        finally:
            flight.done = True
            watcher.cancel()

    async def _priced(
        self,
        scope: Scope,
        send: Send,
        kind: int,
        rec: Record,
        flight: Flight,
        raw: bytes,
        fwd: list[tuple[str, str]],
        has_ct: bool,
        tenant: Any,
        tier: Any,
        max_wait_s: float,
        route: PassthroughRoute | None,
    ) -> None:
        body: Any = None
        if kind == PASSTHROUGH:
            model, body = self._passthrough_model(raw)
            cost = self.pricer.price_passthrough(
                raw,
                model=model,
                default_max_tokens=tenant.default_max_tokens or self.default_max_tokens,
                generates=route is not None and route.generates,
                context_length=self.models.context_length(model) if model else None,
            )
            prefill, decode = cost.prefill, cost.decode
            klass, primary, overflow, class_budget = "passthrough", None, None, None
            if model is None:
                model = ""
        else:
            try:
                body = orjson.loads(raw)
            except orjson.JSONDecodeError as exc:
                raise ApiError(400, f"Request body is not valid JSON: {exc}", code="invalid_json") from None
            if not isinstance(body, dict):
                raise ApiError(400, "Request body must be a JSON object", code="invalid_json")
            model = body.get("model")
            if not isinstance(model, str) or not model:
                raise ApiError(
                    400,
                    "'model' must be a non-empty string naming the model",
                    param="model",
                    code="invalid_type" if model is not None else "missing_required_parameter",
                )
            if not self.router.known_model(model):
                raise self._unknown_model(model)
            ctx = self.models.context_length(model)
            try:
                if kind == CHAT:
                    cost = self.pricer.price_chat(
                        body,
                        default_max_tokens=tenant.default_max_tokens or self.default_max_tokens,
                        max_tokens_limit=tenant.max_max_tokens,
                        context_length=ctx,
                    )
                elif kind == RESPONSES:
                    cost = self.pricer.price_responses(
                        body,
                        default_max_tokens=tenant.default_max_tokens or self.default_max_tokens,
                        max_tokens_limit=tenant.max_max_tokens,
                        context_length=ctx,
                    )
                elif kind == COMPLETION:
                    cost = self.pricer.price_completion(
                        body,
                        default_max_tokens=tenant.default_max_tokens or self.default_max_tokens,
                        max_tokens_limit=tenant.max_max_tokens,
                        context_length=ctx,
                    )
                else:
                    cost = self.pricer.price_embeddings(body, context_length=ctx)
            except InvalidRequest as exc:
                raise ApiError(400, exc.message, param=exc.param, code=exc.code) from None
            prefill, decode = cost.prefill, cost.decode
            if self.classifier is not None:
                rc = self.classifier.classify(cost=cost, model=model, tenant=tenant.name, body=body)
                klass, overflow, class_budget = rc.name, rc.overflow_pool, rc.budget_tokens
                primary = None if rc.pool == HOME_POOL else rc.pool
            else:
                klass, primary, overflow, class_budget = "default", None, None, None
        rec.klass, rec.prefill, rec.decode = klass, prefill, decode
        flight.bound = self.metrics.bind(klass, tenant.name, tier.name)
        rec.stream = bool(body.get("stream")) if kind != PASSTHROUGH and kind != EMBEDDING else False

        try:
            pool_name = self.router.choose_pool(model, primary, overflow) if model else self._default_pool()
        except NoBackend as exc:
            if exc.unknown_model:
                raise ApiError(404, exc.message, param="model", code="model_not_found") from None
            raise ApiError(
                503, exc.message, code="no_healthy_backend", retry_after_s=self.gw.config.health.cooldown_s
            ) from None
        rec.pool = pool_name

        pools_key = (tenant.name, pool_name, klass if class_budget else None)
        pools = self._demand_pools.get(pools_key)
        if pools is None:
            pools = (tenant_pool(tenant.name), backend_pool(pool_name))
            if class_budget:
                pools += (class_pool(klass),)
            self._demand_pools[pools_key] = pools
        demand = Demand(tenant.name, tier.name, pools, prefill, decode)

        self._refuse_if_draining()
        flight.phase = QUEUED
        t_queue = perf_counter()
        try:
            lease = await self.store.acquire(demand, max_wait_s)
        except AdmissionError as exc:
            rec.queue_s = perf_counter() - t_queue
            raise from_admission(exc) from None
        except asyncio.CancelledError:
            rec.queue_s = perf_counter() - t_queue
            raise
        rec.queue_s = perf_counter() - t_queue
        self.keeper.add(lease.id)
        self.observer.admitted(rec)
        actual_decode: int | None = None
        try:
            actual_decode = await self._forward(
                scope, send, kind, rec, flight, body, raw, fwd, has_ct, model, pool_name, tier, lease, decode
            )
        finally:
            self.keeper.discard(lease.id)
            await self.store.release(lease.id, actual_decode)

    def _passthrough_model(self, raw: bytes) -> tuple[str | None, Any]:
        if raw[:1] != b"{":
            return None, None
        try:
            body = orjson.loads(raw)
        except orjson.JSONDecodeError:
            return None, None
        model = body.get("model") if isinstance(body, dict) else None
        return (model if isinstance(model, str) and model and self.router.known_model(model) else None), body

    def _default_pool(self) -> str:
        return next(iter(self.router.pools))

    def _unknown_model(self, model: str) -> ApiError:
        served = ", ".join(self.router.served_models()) or "(none)"
        return ApiError(
            404,
            f"The model {show_value(model)} does not exist or is not served here; served models: {served}",
            param="model",
            code="model_not_found",
        )

    # ---- upstream ----

    def _payload(
        self, kind: int, body: Any, raw: bytes, decode: int, backend: Backend, tier: Any
    ) -> tuple[bytes, bool]:
        """(bytes to send, client_wants_usage). Re-serialize only when something must change.

        ``body`` is left as the client sent it (a retry on another backend builds its payload again).
        """
        if kind == PASSTHROUGH or kind == EMBEDDING:
            return raw, False
        changes: dict[str, Any] = {}
        wants_usage = True
        if kind == RESPONSES:
            # The Responses API always reports usage (in response.completed) and has no
            # stream_options; its output limit is max_output_tokens, for one sequence.
            if self.enforce_max_tokens and body.get("max_output_tokens") is None:
                changes["max_output_tokens"] = max(decode, 1)
        elif body.get("stream") is True:
            opts = body.get("stream_options")
            wants_usage = isinstance(opts, dict) and opts.get("include_usage") is True
            if not wants_usage:
                opts = dict(opts) if isinstance(opts, dict) else {}
                opts["include_usage"] = True
                changes["stream_options"] = opts
        if (
            kind != RESPONSES
            and self.enforce_max_tokens
            and body.get("max_tokens") is None
            and body.get("max_completion_tokens") is None
        ):
            changes["max_tokens"] = max(decode // self._sequences(kind, body), 1)
        if backend.spec.accepts_priority and body.get("priority") != tier.rank:
            changes["priority"] = tier.rank
        if not changes:
            return raw, wants_usage
        return orjson.dumps({**body, **changes}), wants_usage

    def _request_headers(
        self, backend: Backend, fwd: list[tuple[str, str]], has_ct: bool, kind: int
    ) -> list[tuple[str, str]]:
        headers = fwd
        auth = self._auth_header[id(backend)]
        if auth is not None:
            headers = [h for h in fwd if h[0] != "Authorization"] if self.open_mode else fwd.copy()
            headers.append(auth)
        if not has_ct and kind != PASSTHROUGH:
            headers = [*headers, ("Content-Type", "application/json")]
        return headers

    @staticmethod
    def _sequences(kind: int, body: Any) -> int:
        n = body.get("n") or 1
        if kind == CHAT:
            return int(n)
        best_of = body.get("best_of") or 1
        prompt = body.get("prompt")
        prompts = 1
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
            prompts = len(prompt)
        return max(int(n), int(best_of)) * prompts

    async def _forward(
        self,
        scope: Scope,
        send: Send,
        kind: int,
        rec: Record,
        flight: Flight,
        body: Any,
        raw: bytes,
        fwd: list[tuple[str, str]],
        has_ct: bool,
        model: str,
        pool_name: str,
        tier: Any,
        lease: Lease,
        decode: int,
    ) -> int | None:
        pool = self.router.pools[pool_name]
        backend = pool.pick(model or None)
        if backend is None:
            raise ApiError(
                503, f"No healthy backend in pool {pool_name!r}", code="no_healthy_backend", retry_after_s=1.0
            )
        rec.backend = backend.name
        cost = lease.demand.cost
        backend.in_flight_tokens += cost
        backend.in_flight_requests += 1
        flight.phase = UPSTREAM
        resp: aiohttp.ClientResponse | None = None
        complete = False
        tried: list[Backend] = []
        try:
            while True:
                payload, wants_usage = self._payload(kind, body, raw, decode, backend, tier)
                headers = self._request_headers(backend, fwd, has_ct, kind)
                url = self._upstream_url(backend, scope)
                t_up = perf_counter()
                try:
                    resp = await self.session.request(
                        scope["method"],
                        url,
                        data=payload,
                        headers=headers,
                        timeout=self._timeouts[id(backend)],
                    )
                    break
                except (TimeoutError, aiohttp.ClientError, OSError) as exc:
                    failure = classify_error(exc, pool=pool_name, backend=backend.name)
                    if failure.connect_failure and backend.record_connect_failure():
                        log.warning(
                            "backend %s marked unhealthy after %d connect failures",
                            backend.name,
                            backend.consecutive_failures,
                        )
                    # A connect failure means the request never reached the backend: try the
                    # pool's next healthy backend. Anything later may have started generating.
                    tried.append(backend)
                    nxt = pool.pick(model or None, exclude=tried) if failure.connect_failure else None
                    if nxt is None:
                        raise _upstream_failed(rec, failure) from None
                    log.warning("upstream connect failed, retrying on the next backend: %s", failure.detail)
                    backend.in_flight_tokens -= cost
                    backend.in_flight_requests -= 1
                    backend = nxt
                    backend.in_flight_tokens += cost
                    backend.in_flight_requests += 1
                    rec.backend = backend.name
            backend.record_success()
            status = resp.status
            is_sse = kind != EMBEDDING and status == 200 and resp.content_type == "text/event-stream"
            try:
                if is_sse and kind != PASSTHROUGH:
                    usage = await self._relay_sse(send, rec, flight, resp, wants_usage, t_up)
                elif kind == PASSTHROUGH and status < 500:
                    usage = None
                    await self._relay_raw(send, rec, flight, resp, t_up)
                else:
                    usage = await self._relay_whole(send, rec, flight, resp, backend, t_up)
            except (TimeoutError, aiohttp.ClientError, OSError) as exc:
                failure = classify_error(exc, pool=pool_name, backend=backend.name)
                raise _upstream_failed(rec, failure) from None
            complete = True
            prompt, completion = usage_counts(usage)
            rec.prompt_tokens, rec.completion_tokens = prompt, completion
            return completion
        finally:
            backend.in_flight_tokens -= cost
            backend.in_flight_requests -= 1
            if resp is not None:
                if complete:
                    resp.release()
                else:
                    # Closing (not releasing) drops the connection: the backend sees the
                    # disconnect and aborts the generation.
                    resp.close()

    def _upstream_url(self, backend: Backend, scope: Scope) -> URL:
        """The backend's base URL + the request's raw path (checked by ``gateway.paths``), sent as is."""
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

    def _headers(self, rec: Record, resp: aiohttp.ClientResponse) -> list[tuple[bytes, bytes]]:
        headers = response_headers(resp.raw_headers)
        headers.append((b"x-tokengate-class", rec.klass.encode()))
        headers.append((b"x-tokengate-cost", str(rec.prefill + rec.decode).encode()))
        headers.append((b"x-tokengate-queue-ms", f"{(rec.queue_s or 0.0) * 1000.0:.1f}".encode()))
        return headers

    async def _relay_whole(
        self,
        send: Send,
        rec: Record,
        flight: Flight,
        resp: aiohttp.ClientResponse,
        backend: Backend,
        t_up: float,
    ) -> Any:
        data = await resp.read()
        rec.backend_s = perf_counter() - t_up
        status = resp.status
        if status >= 500:
            rec.error = f"{backend.name}: HTTP {status}: {_upstream_message(data)}"
            log.warning("upstream error on pool %s: %s", rec.pool, rec.error)
            raise ApiError(
                502, f"The backend for pool {rec.pool!r} failed with HTTP {status}", code="upstream_error"
            )
        usage = None
        if 200 <= status < 300 and b'"usage"' in data and "Content-Encoding" not in resp.headers:
            try:
                obj = orjson.loads(data)
                usage = obj.get("usage") if isinstance(obj, dict) else None
            except orjson.JSONDecodeError:
                pass
        headers = self._headers(rec, resp)
        headers.append((b"content-length", str(len(data)).encode()))
        rec.status = status
        if status >= 400:
            rec.outcome = "backend_4xx"
        flight.started = True
        flight.done = True
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": data, "more_body": False})
        return usage

    async def _relay_sse(
        self,
        send: Send,
        rec: Record,
        flight: Flight,
        resp: aiohttp.ClientResponse,
        wants_usage: bool,
        t_up: float,
    ) -> Any:
        relay = UsageRelay(drop_usage=not wants_usage)
        rec.status = 200
        flight.started = True
        await send({"type": "http.response.start", "status": 200, "headers": self._headers(rec, resp)})
        content = resp.content
        first = True
        try:
            while True:
                chunk = await content.readany()
                if not chunk:
                    break
                if first:
                    rec.ttft_s = perf_counter() - rec.start
                    first = False
                out = relay.feed(chunk)
                if out:
                    await send({"type": "http.response.body", "body": out, "more_body": True})
        except (TimeoutError, aiohttp.ClientError, OSError) as exc:
            rec.backend_s = perf_counter() - t_up
            rec.outcome = "upstream_error"
            failure = classify_error(exc, pool=rec.pool or "?", backend=rec.backend or "?")
            raise _upstream_failed(rec, failure) from None
        rec.backend_s = perf_counter() - t_up
        tail = relay.flush()
        flight.done = True
        await send({"type": "http.response.body", "body": tail, "more_body": False})
        return relay.usage

    async def _relay_raw(
        self, send: Send, rec: Record, flight: Flight, resp: aiohttp.ClientResponse, t_up: float
    ) -> None:
        """Pass-through routes: any answer, relayed chunk by chunk without looking inside."""
        rec.status = resp.status
        if resp.status >= 400:
            rec.outcome = "backend_4xx"
        flight.started = True
        await send(
            {"type": "http.response.start", "status": resp.status, "headers": self._headers(rec, resp)}
        )
        content = resp.content
        while True:
            chunk = await content.readany()
            if not chunk:
                break
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        rec.backend_s = perf_counter() - t_up
        flight.done = True
        await send({"type": "http.response.body", "body": b"", "more_body": False})

"""The gateway ASGI app: hot OpenAI routes as raw ASGI, everything else through Starlette.

``build_app(config)`` returns a :class:`Gateway`, an ASGI callable with its own lifespan: at
start-up it opens the shared aiohttp session, starts the store, the lease heartbeat and the
health checker; at shutdown it drains (stop admitting, finish in-flight up to the drain timeout,
then cancel) and releases whatever is left.

The OpenAI routes bypass Starlette's routing and Request/Response objects because they are the
hot path (one dict lookup instead of a regex scan per route); ops routes (/metrics, /healthz,
/readyz) and any later admin API are ordinary Starlette routes.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import Callable, Mapping
from time import perf_counter
from typing import TYPE_CHECKING, Any

import aiohttp
import orjson
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from budgets.types import BudgetStore
from classifiers import Pricer
from gateway.admin.api import AdminApi, AdminParts
from gateway.admin.control import ConfigSource, Control, state_store_for
from gateway.admin.tokens import Role, load_tokens
from gateway.config.schema import GatewayConfig, TenantConfig
from gateway.config.stores import build_store, quota_ledger, usage_log
from gateway.live import LiveParts, build_live
from gateway.observe import Observer, ReservationSources, ScrapeTarget, StatsSources, observe_routes
from gateway.observe.accesslog import Record
from gateway.observe.metrics import CONTENT_TYPE, GatewayMetrics
from gateway.observe.quota_use import QuotaUse
from gateway.observe.stats import BackendHealth, config_view
from gateway.observe.tracing import Tracer
from gateway.request.auth import visible_models
from gateway.request.billing import UsageRecorder
from gateway.request.errors import ApiError, error_body, show_value
from gateway.request.exchange import CancelReason, Exchange, Phase, Receive, RouteKind, Scope, Send
from gateway.request.leases import LeaseKeeper
from gateway.request.paths import path_problem
from gateway.request.proxy import Proxy, ProxyParts
from gateway.request.quotas import QuotaGate
from gateway.request.requestid import from_client, new_id
from gateway.request.shadow import ShadowLimits, shadow_view
from gateway.upstream.client import make_session
from gateway.upstream.health import HealthChecker, HealthSettings
from gateway.upstream.pools import BreakerSettings, Router

if TYPE_CHECKING:
    from gateway.extproc.server import ExtprocServer

log = logging.getLogger("tokengate")

_ROUTES = {
    "/v1/chat/completions": RouteKind.CHAT,
    "/v1/completions": RouteKind.COMPLETION,
    "/v1/embeddings": RouteKind.EMBEDDING,
    "/v1/responses": RouteKind.RESPONSES,
}
# The hot routes by raw path: one dict lookup, and a path that matches needs no further checks.
_RAW_ROUTES = {path.encode(): kind for path, kind in _ROUTES.items()}


# Served on the API port for load balancers; everything else operational is on the ops listener.
_OPEN_OPS = frozenset({"/healthz", "/readyz"})


class OpsApp:
    """The ops listener's ASGI app (an object: servers tell ASGI 3 apps by their ``__call__``)."""

    def __init__(self, serve: Callable[[Scope, Receive, Send], Any]) -> None:
        self.serve = serve

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self.serve(scope, receive, send)


def _header(scope: Scope, name: bytes) -> str | None:
    for k, v in scope["headers"]:
        if k == name:
            return str(v.decode("latin-1"))
    return None


# Sections that shape the process itself: a reload keeps their running values until a restart.
RESTART_ONLY = (
    "listen",
    "usage_log",
    "extproc",
    "tracing",
    "workers",
    "store",
    "limits",
    "upstream",
    "leases",
    "health",
    "metrics",
    "observability",
    "embedded_backend",
    "admin",
    "ops",
    "gc",
)


def _breaker(config: GatewayConfig) -> BreakerSettings:
    return BreakerSettings(
        failure_threshold=config.health.failure_threshold, cooldown_s=config.health.cooldown_s
    )


async def _send_error(send: Send, exc: ApiError) -> None:
    body = exc.body()
    headers = exc.headers()
    headers.append((b"content-length", str(len(body)).encode()))
    await send({"type": "http.response.start", "status": exc.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


class Gateway:
    def __init__(
        self,
        config: GatewayConfig,
        *,
        store: BudgetStore | None = None,
        clock: Callable[[], float] | None = None,
        raw: Mapping[str, Any] | None = None,
    ) -> None:
        """``raw``: the config as read from its file (what admin changes are written over); None when
        the config did not come from a file or mapping (the admin API then cannot change it)."""
        if not config.pools:
            raise ValueError(
                "no backend pools configured: configure `pools`, or run `tokengate serve`, which starts "
                "the embedded reference backend when there are none"
            )
        # The live parts: rebuilt by `apply` (reload, admin API) while requests flow, swapped as one.
        self._expiries: Mapping[str, float] = {}
        self.live = LiveParts(build_live(config, None, self._expiries, self._kv_usage))
        # Everything else lives as long as the process (the router reconfigures itself in place).
        self.router = Router(config.pools, _breaker(config))
        self.store: BudgetStore = store or build_store(config.store, self.live.current.layout, clock)
        self.metrics = GatewayMetrics(
            tenants=[t.name for t in self.tenants], top_tenants=config.metrics.top_tenants
        )
        self.keeper = LeaseKeeper(self.store, config.leases.ttl_s)
        self.quotas = QuotaGate(
            quota_ledger(self.store, config.leases.ttl_s), on_refused=self.metrics.quota_refused
        )
        self.shadow = ShadowLimits(self.quotas, on_over=self.metrics.shadow_over)
        self.quota_use = QuotaUse(
            self.quotas.ledger, lambda: self.live.current.tenants, label=self.metrics.tenant_label
        )
        self.metrics.registry.register(self.quota_use)
        u = config.usage_log
        self.billing = (
            UsageRecorder(usage_log(self.store), keep_s=u.keep_days * 86_400, flush_s=u.flush_s)
            if u.enabled
            else None
        )
        h = config.health
        self.health = HealthChecker(
            list(self.router.backends),
            HealthSettings(
                interval_s=h.interval_s,
                unhealthy_interval_s=h.unhealthy_interval_s,
                probe_timeout_s=h.probe_timeout_s,
            ),
        )
        self.exchanges: set[Exchange] = set()  # requests in the gateway right now (drain waits on them)
        # Called once per finished request with its record and perf_counter end time (cheap,
        # synchronous, on the event loop; exceptions are logged and ignored).
        self.request_hooks: list[Callable[[Record, float], None]] = []
        self.tracer: Tracer | None = None  # tracing.enabled: built at start-up (its exporter's thread)
        # Request-class observability: per-class windows, HOL fingerprint, pool shape, and each
        # engine's own load scraped from its /metrics (routing reads it through Backend.load).
        self.observer = Observer(
            config.observability, targets=self._scrape_targets(), store_health=self.store.healthy
        )
        for collector in self.observer.collectors():
            self.metrics.registry.register(collector)
        self._attach_loads()
        self.request_hooks.append(self.observer.finished)
        stats_sources = StatsSources(
            self.observer,
            snapshot=self.store.snapshot,
            config_view=lambda: config_view(self.config.classes, self.config.pools),
            backend_health=lambda: [
                BackendHealth(
                    b.pool, b.name, b.state, b.consecutive_failures, b.usage_reported, b.usage_missing
                )
                for b in self.router.backends
            ],
            backends=lambda: self.router.backends,
            reservations=ReservationSources(
                ratio=self.metrics.reservation_ratio,
                overdrafts=self.metrics.overdrafts,
                overdraft_tokens=self.metrics.overdraft_tokens,
                extensions=self.metrics.extensions,
                flush=self.metrics.flush,
                used_tokens=self._used_tokens,
                # Through self: a reconfiguration replaces the Reservations object.
                learned=lambda: self.live.current.reservations.learned(),
                tight_pools=lambda: self.live.current.reservations.tight_pools(),
            ),
            held_bodies=self._held_bodies,
            # Through self: a reconfiguration may replace the Pricer.
            encode_backlog=lambda: self.pricer.encode_backlog(),
            estimates=lambda: self.pricer.estimates(),
            store=self.store.describe,
            prompt_overheads=self._prompt_overheads,
            tenant_connections=self._tenant_connections,
            limits=self._limits,
        )
        self.draining = False
        self._drained = False
        self.session: aiohttp.ClientSession | None = None
        self._proxy: Proxy | None = None
        self.extproc: ExtprocServer | None = None  # Envoy's external processor, when enabled
        self._discovery: asyncio.Task[None] | None = None
        self._applying = asyncio.Lock()
        # Where `reload` reads the config from, and what `tokengate serve` adds to it; set by the server.
        self.source = ConfigSource()
        self.tokens = load_tokens(config.admin.tokens_file)
        self.control = Control(self.apply, self.source, state_store_for(config), raw)
        self.admin_api = AdminApi(
            AdminParts(
                self.control,
                self.tokens,
                self.live,
                self.router,
                self.store,
                self.exchanges,
                self.quotas,
                self.billing,
            )
        )
        self.request_hooks.append(self.admin_api.recent)
        self.ops_app = OpsApp(self.serve_ops)  # the ASGI app of the ops listener
        self.ops = Starlette(
            routes=[
                Route("/metrics", self._metrics, methods=["GET"]),
                Route("/healthz", self._healthz, methods=["GET"]),
                Route("/readyz", self._readyz, methods=["GET"]),
                *observe_routes(stats_sources),
                *self.admin_api.routes(),
            ],
            exception_handlers={HTTPException: self._http_error, Exception: self._server_error},
        )

    # ---- configuration, live ----

    @property
    def config(self) -> GatewayConfig:
        return self.live.current.config

    @property
    def tenants(self) -> tuple[TenantConfig, ...]:
        return self.live.current.tenants

    @property
    def pricer(self) -> Pricer:
        return self.live.current.pricer

    @property
    def config_path(self) -> str | None:
        return self.source.path

    @config_path.setter
    def config_path(self, path: str | None) -> None:
        self.source.path = path

    def _kv_usage(self, pool: str) -> float | None:
        return self.observer.loads.kv_usage(pool)

    def _scrape_targets(self) -> list[ScrapeTarget]:
        return [
            ScrapeTarget(b.pool, b.name, b.spec.capacity_tokens, b.spec.url + "/metrics")
            for b in self.router.backends
        ]

    def _attach_loads(self) -> None:
        for b in self.router.backends:
            b.load = self.observer.loads.get(b.name)

    async def apply(
        self, config: GatewayConfig, key_expiries: Mapping[str, float] | None = None
    ) -> list[str]:
        """Switch to ``config`` without a restart, while requests flow; returns what it could not apply.

        Tenants, keys, tiers, pools and their backends, classes, models, pricing, pass-through routes
        and fairness apply at once: a lowered budget makes new requests wait while running ones
        finish, a raised one wakes waiting requests, a removed tenant's new requests are refused.
        Sections that shape the process itself (``RESTART_ONLY``: listen, workers, store, limits,
        upstream, leases, health, metrics, observability, embedded_backend, admin, ops, gc) keep their
        running values until a restart; their names are returned (and logged).
        """
        if not config.pools:
            raise ValueError("no backend pools configured: a running gateway keeps at least one pool")
        async with self._applying:
            old = self.config
            kept = [name for name in RESTART_ONLY if getattr(config, name) != getattr(old, name)]
            if kept:
                config = dataclasses.replace(config, **{name: getattr(old, name) for name in kept})
                log.warning("config change needs a restart to take effect: %s", ", ".join(kept))
            if key_expiries is not None:
                self._expiries = key_expiries
            live = build_live(config, self.live.current, self._expiries, self._kv_usage)
            changed = self.router.reconfigure(config.pools, _breaker(config))
            self.metrics.set_tenants([t.name for t in live.tenants])
            self.health.set_backends(list(self.router.backends))
            await self.observer.retarget(self._scrape_targets())
            self._attach_loads()
            await self.store.apply_layout(live.layout)
            self.live.swap(live)  # the one place the running config changes
            if any(not b.spec.models for b in changed.added) and self.session is not None:
                await self.health.discover_models()
            log.info(
                "configuration applied: %d tenants, %d pools (%d backends added, %d removed)",
                len(live.tenants),
                len(self.router.pools),
                len(changed.added),
                len(changed.removed),
            )
            return kept

    async def reload(self) -> list[str]:
        """Re-read the config file and apply it (with the admin API's changes over it); a bad file
        raises ConfigError and changes nothing."""
        return await self.control.reload()

    # ---- lifecycle ----

    async def startup(self) -> None:
        self.session = make_session(
            max_connections=self.config.upstream.max_connections, keepalive_s=self.config.upstream.keepalive_s
        )
        await self.store.start()
        await self.quotas.start()
        self.quota_use.start()
        if self.billing is not None:
            self.billing.start()
        await self.control.start()
        self.keeper.start()
        await self.health.start()
        await self.observer.start()
        # Off the hot path and best effort: /v1/models lists what model-agnostic backends serve.
        self._discovery = asyncio.create_task(self.health.discover_models(), name="tokengate-discovery")
        if self.config.tracing.enabled:
            self.tracer = Tracer(self.config.tracing)
            self.request_hooks.append(self.tracer.finished)
        parts = ProxyParts(
            store=self.store,
            keeper=self.keeper,
            metrics=self.metrics,
            observer=self.observer,
            router=self.router,
            exchanges=self.exchanges,
            hooks=self.request_hooks,
            limits=self.config.limits,
            cooldown_s=self.config.health.cooldown_s,
            draining=lambda: self.draining,
            tracer=self.tracer,
            quotas=self.quotas,
            shadow=self.shadow,
            billing=self.billing,
        )
        self._proxy = Proxy(parts, self.live, self.session)
        if self.config.extproc.enabled:
            await self._start_extproc()

    async def _start_extproc(self) -> None:
        """Envoy's external processor on its own gRPC port, over this app (gateway.extproc)."""
        try:
            from gateway.extproc.server import ExtprocServer
        except ImportError as exc:
            raise RuntimeError(
                f"extproc needs grpcio and protobuf ({exc.name} is missing): pip install 'tokengate[extproc]'"
            ) from None
        self.extproc = ExtprocServer(self.config.extproc, self, self.config.limits.max_body_bytes)
        await self.extproc.start()

    async def shutdown(self) -> None:
        await self.drain(self.config.drain_timeout_s)
        if self.extproc is not None:
            await self.extproc.stop()
        if self._discovery is not None:
            self._discovery.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._discovery
        leaked = await self.keeper.close()
        if leaked:
            log.warning("released %d leases still held at shutdown", leaked)
        await self.quota_use.close()
        if self.billing is not None:
            await self.billing.close()
        await self.quotas.close()
        await self.health.close()
        await self.observer.close()
        await self.control.close()
        if self.session is not None:
            await self.session.close()
        if self._proxy is not None:
            await self._proxy.media.close()
        await self.store.close()
        self.pricer.close()
        if self.tracer is not None:  # (after the drain: the last requests' spans go too)
            await self.tracer.close()

    async def drain(self, timeout_s: float) -> None:
        """Stop admitting (503), fail queued requests, let in-flight ones finish up to ``timeout_s``,
        then cancel the rest (their ``finally`` blocks release their leases). Idempotent."""
        if self._drained:
            return
        self._drained = True
        self.draining = True
        self.metrics.draining.set(1)
        for x in list(self.exchanges):
            if x.phase <= Phase.QUEUED:
                x.cancel(CancelReason.DRAINING)
        deadline = time.monotonic() + timeout_s
        # Polling during a drain costs nothing that matters; an Event would cost every request.
        while self.exchanges and time.monotonic() < deadline:  # noqa: ASYNC110
            await asyncio.sleep(0.01)
        if self.exchanges:
            log.warning("drain timeout: cancelling %d in-flight requests", len(self.exchanges))
            for x in list(self.exchanges):
                x.cancel(CancelReason.SHUTDOWN)
            end = time.monotonic() + 5.0
            while self.exchanges and time.monotonic() < end:  # noqa: ASYNC110
                await asyncio.sleep(0.01)

    # ---- ASGI ----

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            raw_path: bytes = scope.get("raw_path") or scope["path"].encode()
            kind = _RAW_ROUTES.get(raw_path)
            if kind is None:
                problem = path_problem(raw_path)
                if problem is not None:
                    await self._refuse(
                        scope, send, ApiError(400, f"Invalid request path: {problem}", code="invalid_path")
                    )
                    return
                # A harmless escape (/v1/chat/completion%73) names the same route: price it as one.
                kind = _ROUTES.get(scope["path"])
            path = scope["path"]
            if kind is not None:
                assert self._proxy is not None, "the app's lifespan has not run"
                await self._proxy.handle(scope, receive, send, kind)
            elif path.startswith("/v1/"):
                if path == "/v1/models" or path.startswith("/v1/models/"):
                    await self._models(scope, send, path)
                    return
                route = self.live.current.passthrough.match(scope["method"], path)
                if route is None:
                    await self._refuse(scope, send, self._unrouted(scope["method"], path))
                    return
                assert self._proxy is not None, "the app's lifespan has not run"
                await self._proxy.handle(scope, receive, send, RouteKind.PASSTHROUGH, route)
            elif path in _OPEN_OPS:
                await self.ops(scope, receive, send)
            elif self.config.ops.port is None:
                await self._guarded_ops(scope, receive, send, on_api_port=True)
            else:
                await self._refuse(scope, send, self._not_here(scope["method"], path))
        elif scope["type"] == "lifespan":
            await self._lifespan(receive, send)

    async def serve_ops(self, scope: Scope, receive: Receive, send: Send) -> None:
        """The ops listener's app (``ops.host:ops.port``): metrics, stats, insights, dashboard, admin,
        health. Its lifespan is the gateway's own (run by the API listener)."""
        if scope["type"] == "lifespan":
            while (await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        if scope["type"] != "http":
            return
        problem = path_problem(scope.get("raw_path") or scope["path"].encode())
        if problem is not None:
            await _send_error(send, ApiError(400, f"Invalid request path: {problem}", code="invalid_path"))
            return
        await self._guarded_ops(scope, receive, send, on_api_port=False)

    async def _guarded_ops(self, scope: Scope, receive: Receive, send: Send, *, on_api_port: bool) -> None:
        """Operator data is never readable with a tenant key. On the ops listener (loopback by default)
        /metrics is open unless ``ops.metrics_auth``; /stats, /insights and /dashboard need a read or
        admin token once tokens exist. On the API port everything needs a token (none configured: 404).
        The admin API checks its own tokens."""
        path = scope["path"]
        if not path.startswith("/admin/") and path not in _OPEN_OPS:
            needed = Role.METRICS if path == "/metrics" else Role.READ
            open_here = not on_api_port and (needed is Role.METRICS and not self.config.ops.metrics_auth)
            if not open_here and (on_api_port or self.tokens.enabled or needed is Role.METRICS):
                if on_api_port and not self.tokens.enabled and not self.tokens.metrics_token_set:
                    await _send_error(send, self._not_here(scope["method"], path))
                    return
                caller = self.tokens.caller(_header(scope, b"authorization"))
                if caller is None or not caller.role.allows(needed):
                    await _send_error(
                        send,
                        ApiError(
                            401,
                            f"{path} is operator data: send a {'metrics, ' if needed is Role.METRICS else ''}"
                            "read or admin token as 'Authorization: Bearer <token>'",
                            code="invalid_admin_token",
                        ),
                    )
                    return
        await self.ops(scope, receive, send)

    def _not_here(self, method: str, path: str) -> ApiError:
        ops = self.config.ops
        where = (
            f"the ops listener ({ops.host}:{ops.port})"
            if ops.port is not None
            else "an admin or read-only token"
        )
        return ApiError(
            404,
            f"Route {show_value(method)} {show_value(path)} is not served on the API port; operator routes "
            f"(/metrics, /stats, /insights, /dashboard, /admin) need {where}",
            code="unknown_route",
        )

    def _unrouted(self, method: str, path: str) -> ApiError:
        return ApiError(
            404,
            f"Route {show_value(method)} {show_value(path)} is not served by this gateway: it forwards the priced "
            "OpenAI routes (chat/completions, completions, embeddings, responses), GET /v1/models, and the "
            "routes an operator allows in passthrough.routes",
            code="unknown_route",
        )

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                try:
                    await self.startup()
                except Exception as exc:
                    log.exception("start-up failed")
                    await send({"type": "lifespan.startup.failed", "message": str(exc)})
                    return
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                try:
                    await self.shutdown()
                except Exception as exc:
                    log.exception("shutdown failed")
                    await send({"type": "lifespan.shutdown.failed", "message": str(exc)})
                    return
                await send({"type": "lifespan.shutdown.complete"})
                return

    def _record(self, scope: Scope) -> Record:
        """The access record of an answer the proxy does not make (models, refusals), with its request id."""
        rec = Record(method=scope["method"], path=scope["path"], start=perf_counter(), request_id=new_id())
        for name, value in scope["headers"]:
            if name == b"x-request-id":
                adopted, rec.client_request_id = from_client(value, self.config.logging.trust_request_id)
                if adopted is not None:
                    rec.request_id = adopted
        return rec

    async def _refuse(self, scope: Scope, send: Send, exc: ApiError) -> None:
        """An error answer on the API port outside the proxy: with a request id and an access line."""
        rec = self._record(scope)
        rec.status, rec.outcome, rec.reason, rec.error = exc.status, "rejected", exc.code, exc.message
        body = exc.body()
        headers = exc.headers()
        headers.append((b"content-length", str(len(body)).encode()))
        headers.append((b"x-request-id", rec.request_id.encode()))
        try:
            await send({"type": "http.response.start", "status": exc.status, "headers": headers})
            await send({"type": "http.response.body", "body": body})
        finally:
            rec.emit(perf_counter())

    async def _models(self, scope: Scope, send: Send, path: str) -> None:
        """``GET /v1/models`` (the list) and ``GET /v1/models/{id}`` (one), answered here: only the
        served models the key's tenant may use (its ``models`` globs), so no tenant reads the names
        of another's models (a customer's fine-tune or adapter)."""
        rec = self._record(scope)
        try:
            if scope["method"] != "GET":
                raise ApiError(405, f"Use GET {path}", code="method_not_allowed")
            key = None
            for name, value in scope["headers"]:
                if name == b"authorization":
                    scheme, _, rest = value.decode("latin-1").partition(" ")
                    key = rest.strip() if scheme.lower() == "bearer" else None
                    break
                if name in (b"api-key", b"x-api-key"):
                    key = value.decode("latin-1").strip()
            tenant = self.live.current.auth.authenticate(key)
            rec.tenant = tenant.name
            visible = visible_models(tenant, self.router.served_models())
            if path == "/v1/models":
                body = orjson.dumps({"object": "list", "data": [_model_object(m) for m in visible]})
            elif (wanted := path[len("/v1/models/") :]) in visible:
                body = orjson.dumps(_model_object(wanted))
            else:
                raise ApiError(
                    404,
                    f"The model {show_value(wanted)} does not exist or is not available to this API "
                    f"key; models: {', '.join(visible) or '(none)'}",
                    param="model",
                    code="model_not_found",
                )
            status, headers = 200, [(b"content-type", b"application/json")]
        except ApiError as exc:
            status, headers, body = exc.status, exc.headers(), exc.body()
            rec.outcome, rec.reason, rec.error = "rejected", exc.code, exc.message
        rec.status = status
        headers.append((b"content-length", str(len(body)).encode()))
        headers.append((b"x-request-id", rec.request_id.encode()))
        try:
            await send({"type": "http.response.start", "status": status, "headers": headers})
            await send({"type": "http.response.body", "body": body})
        finally:
            rec.emit(perf_counter())

    # ---- ops routes (Starlette) ----

    async def _metrics(self, request: Request) -> Response:
        snapshot = await self.store.snapshot()
        self.metrics.in_flight_requests.set(len(self.exchanges))
        if self._proxy is not None:
            self.metrics.held_body_bytes.set(self._proxy.held.total)
        self.metrics.encode_backlog_chars.set(sum(self.pricer.encode_backlog().values()))
        self.metrics.set_prompt_overheads(self._prompt_overheads())
        self.metrics.update_state(snapshot, self.router.backends, [t.name for t in self.config.tiers])
        used = self._used_tokens()
        for pool in self.router.pools:
            self.metrics.pool_used.labels(pool).set(used.get(pool, 0))
        return Response(self.metrics.render(), media_type=CONTENT_TYPE)

    def _prompt_overheads(self) -> dict[str, object]:
        """The learned prompt overheads with the model settings that apply them (/stats, /metrics)."""
        live = self.live.current
        return live.prompt_overheads.snapshot(live.models.prompt_overhead)

    def _limits(self) -> dict[str, Any]:
        use = self.quota_use
        return {
            "shadow": shadow_view(self.shadow, self.live.current.tenants),
            "quotas": use.rows,
            "quotas_read_at": use.read_at,
            "quotas_error": use.error,
        }

    def _tenant_connections(self) -> tuple[dict[str, int], int]:
        most = self.config.limits.max_connections_per_tenant
        return ({}, most) if self._proxy is None else (dict(self._proxy.connections.by_tenant), most)

    def _held_bodies(self) -> tuple[int, int, dict[str, int]]:
        if self._proxy is None:
            return 0, self.config.limits.max_held_body_bytes, {}
        held = self._proxy.held
        return held.total, held.most, dict(held.by_tenant)

    def _used_tokens(self) -> dict[str, int]:
        """Per backend pool, the tokens requests in flight really occupy now: the prompt plus the
        output streamed so far (a non-streamed answer is counted at its reservation: unseen)."""
        used: dict[str, int] = {}
        for x in self.exchanges:
            if x.lease is None or x.placement is None or x.cost is None:
                continue
            output = x.streamed_tokens if x.record.stream else x.cost.decode
            used[x.placement.pool] = used.get(x.placement.pool, 0) + x.cost.prefill + output
        return used

    async def _healthz(self, request: Request) -> Response:
        return Response(b'{"status":"ok"}', media_type="application/json")

    async def _readyz(self, request: Request) -> Response:
        problems = []
        if self.draining:
            problems.append("draining")
        try:
            if not await self.store.healthy():
                problems.append("budget store unhealthy")
        except Exception as exc:
            problems.append(f"budget store error: {exc}")
        backends = list(self.router.backends)
        if not any(b.available and (b.confirmed or b.spec.probe is None) for b in backends):
            # A backend that never answered does not count: at start-up every backend is
            # optimistically "healthy" until failures open its breaker. One without a probe counts
            # while its breaker is closed (only requests can confirm it, and they follow readiness).
            # Counts only: /readyz is open on the API port, and backend addresses are for the
            # operator (/stats, doctor).
            down = sum(1 for b in backends if not b.healthy)
            unknown = sum(1 for b in backends if b.healthy and not b.confirmed and b.spec.probe is not None)
            problems.append(
                f"no healthy backend ({len(backends)} configured: {down} down, {unknown} never answered)"
            )
        if problems:
            return Response(
                orjson.dumps({"status": "not ready", "problems": problems}),
                status_code=503,
                media_type="application/json",
            )
        return Response(b'{"status":"ready"}', media_type="application/json")

    async def _http_error(self, request: Request, exc: Any) -> Response:
        status = getattr(exc, "status_code", 500)
        if status == 404:
            message = f"Unknown route {request.method} {request.url.path}"
            code = "unknown_route"
        elif status == 405:
            message = f"Method {request.method} not allowed on {request.url.path}"
            code = "method_not_allowed"
        else:
            message, code = str(getattr(exc, "detail", "error")), None
        err = ApiError(status, message, code=code)
        return Response(
            error_body(err.message, err.type, None, code), status_code=status, media_type="application/json"
        )

    async def _server_error(self, request: Request, exc: Exception) -> Response:
        log.exception("unexpected error on %s %s", request.method, request.url.path, exc_info=exc)
        return Response(
            error_body("Internal gateway error", "server_error", None, "internal_error"),
            status_code=500,
            media_type="application/json",
        )


def build_app(
    config: GatewayConfig,
    *,
    store: BudgetStore | None = None,
    clock: Callable[[], float] | None = None,
    raw: Mapping[str, Any] | None = None,
) -> Gateway:
    return Gateway(config, store=store, clock=clock, raw=raw)


def _model_object(model: str) -> dict[str, object]:
    return {"id": model, "object": "model", "created": 0, "owned_by": "tokengate"}

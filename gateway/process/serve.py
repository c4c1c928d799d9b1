"""``tokengate serve``: run the gateway (and, with no pools configured, the embedded backends).

The uvicorn server is subclassed only to drain before uvicorn's own shutdown: on SIGTERM/SIGINT
the gateway stops admitting (503 for new requests, queued ones fail fast), lets in-flight
requests finish up to ``drain_timeout_s``, cancels the rest (releasing their tokens), and only
then lets uvicorn close connections and run the lifespan shutdown.

The API port is bound before anything starts, so a busy port is one clear error and exit status 2,
not a traceback after "Application startup complete". Once the gateway accepts requests it logs
where to try it (the API, an example request, the dashboard, ``tokengate doctor``).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import os
import shlex
import signal
import socket
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import uvicorn

from gateway.app import Gateway, build_app
from gateway.config.fields import ConfigError
from gateway.config.loader import load_raw, parse_config
from gateway.config.schema import GatewayConfig, GcConfig
from gateway.observe import accesslog
from gateway.observe.accesslog import LineHandler
from gateway.process.embedded import Embedded, start_embedded, with_embedded_pool
from gateway.process.http_server import GuardedHttpToolsProtocol, connection_limits, guarded_protocol
from gateway.process.logs import LogFormat, dumps, formatter

log = logging.getLogger("tokengate")


def freeze_startup_heap() -> None:
    """Keep what start-up built out of every later full garbage collection.

    The modules, the config, the tokenizer tables and the app are ~60,000 container objects that
    live as long as the process; a full collection traversed all of them each time, a ~45 ms stall
    of the event loop every few thousand requests under load (docs/benchmarks.md, "Garbage
    collection"). Frozen objects are still freed by reference counting when they go; only a cycle
    among them would never be collected (start-up objects do not become garbage cycles: a config
    reload builds new objects, which are not frozen).
    """
    gc.collect()
    gc.freeze()


def tune_collector(settings: GcConfig) -> None:
    """The collector's thresholds from the config (``gc``; see GcConfig for why not Python's)."""
    gc.set_threshold(settings.threshold0, settings.threshold1, settings.threshold2)


class DrainingServer(uvicorn.Server):
    def __init__(
        self, config: uvicorn.Config, gateway: Gateway, on_started: Callable[[], None] | None = None
    ) -> None:
        super().__init__(config)
        self.gateway = gateway
        self.on_started = on_started

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        if self.started:
            tune_collector(self.gateway.config.gc)
            freeze_startup_heap()
        if self.started and self.on_started is not None:
            self.on_started()

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        await self.gateway.drain(self.gateway.config.drain_timeout_s)
        await super().shutdown(sockets)


LOG_FORMAT_ENV = "TOKENGATE_LOG_FORMAT"
LOG_LEVEL_ENV = "TOKENGATE_LOG_LEVEL"
ACCESS_LOG_ENV = "TOKENGATE_ACCESS_LOG"


def setup_logging(level: str, access_log: bool, fmt: LogFormat = "json") -> None:
    """Every log line in one format: the root logger (ours, uvicorn's, the libraries') on stderr,
    the access log on stdout through its own buffered handler. Call before uvicorn is configured,
    and give uvicorn ``log_config=None`` so it keeps these handlers."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(formatter(fmt))
    root = logging.getLogger()
    for old in root.handlers[:]:
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper())
    # uvicorn's lines ("Started server process", errors) reach the root handler.
    for name in ("uvicorn", "uvicorn.error", "uvicorn.asgi"):
        lg = logging.getLogger(name)
        lg.handlers.clear()
        lg.propagate = True
    uv_access = logging.getLogger("uvicorn.access")  # off: the access line below replaces it
    uv_access.handlers.clear()
    uv_access.propagate = False
    uv_access.setLevel(logging.CRITICAL)
    # httpx logs every health probe at INFO.
    logging.getLogger("httpx").setLevel(logging.WARNING)
    accesslog.set_format(fmt)
    access = logging.getLogger("tokengate.access")
    access.propagate = False
    for old in access.handlers[:]:
        access.removeHandler(old)
        old.close()
    if access_log:
        access.addHandler(LineHandler(sys.stdout))
        access.setLevel(logging.INFO)
    else:
        access.setLevel(logging.WARNING)
    # Worker processes (--workers N) set themselves up the same way (app_from_env).
    os.environ[LOG_FORMAT_ENV] = fmt
    os.environ[LOG_LEVEL_ENV] = level
    os.environ[ACCESS_LOG_ENV] = "1" if access_log else "0"


def bind_listener(host: str, port: int, what: str, hint: str) -> socket.socket:
    """A listening TCP socket on host:port, or OSError with a message that says what to change."""
    # proto=IPPROTO_TCP: asyncio only sets TCP_NODELAY on accepted sockets whose proto says TCP.
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
        sock.listen(2048)
    except OSError as exc:
        sock.close()
        raise OSError(f"{what}: cannot listen on {host}:{port} ({exc.strerror or exc}); {hint}") from None
    return sock


def _uvicorn_config(app: Gateway, log_level: str) -> uvicorn.Config:
    return uvicorn.Config(
        app,
        log_level=log_level,
        log_config=None,  # setup_logging's handlers stay
        access_log=False,  # our own structured line replaces it
        lifespan="on",
        http=guarded_protocol(connection_limits(app.config)),
        # Drain has already run when uvicorn waits; this only bounds stragglers.
        timeout_graceful_shutdown=5,
        server_header=False,
    )


async def serve_async(
    config: GatewayConfig,
    *,
    host: str,
    port: int,
    log_level: str = "info",
    config_path: str | None = None,
    raw: Mapping[str, Any] | None = None,
    log_format: LogFormat = "json",
) -> None:
    """``raw``: the file's YAML as read (admin changes are written over it); ``{}`` without a file."""
    api_sock = bind_listener(
        host, port, "tokengate serve", "stop what uses it, or choose another port (--port, or listen.port)"
    )
    embedded: Embedded | None = None
    prepare: Callable[[GatewayConfig], GatewayConfig] = _unchanged
    try:
        if not config.pools:
            started = await start_embedded(config)
            embedded = started

            def prepare(c: GatewayConfig) -> GatewayConfig:
                # Every later config (reload, admin change) without pools of its own keeps the embedded ones.
                return c if c.pools else with_embedded_pool(c, started)

            log.info(
                "no pools configured: embedded simulated backends %s (model %s)",
                ", ".join(f"{b.pool} on {b.url}" for b in started.backends),
                started.model,
            )
        app = build_app(prepare(config), raw={} if raw is None else raw)
        app.source.path = config_path
        app.source.prepare = prepare
        _reload_on_sighup(app)
        ops = await _start_ops_listener(app, log_level)
        api = api_sock.getsockname()
        ops_at = ops.address if ops is not None else None
        server = DrainingServer(
            _uvicorn_config(app, log_level),
            app,
            on_started=lambda: _announce(app, (api[0], api[1]), ops_at, embedded, log_format),
        )
        try:
            await server.serve(sockets=[api_sock])
        finally:
            if ops is not None:
                await ops.stop()
    finally:
        api_sock.close()
        if embedded is not None:
            await embedded.stop()


def _url_host(host: str) -> str:
    if host in ("0.0.0.0", "", "::"):
        return "127.0.0.1"
    return f"[{host}]" if ":" in host else host


@dataclass(frozen=True)
class StartupInfo:
    """What the start-up lines say: where to send requests, what to try, where to look."""

    api: str  # the OpenAI base URL, .../v1
    dashboard: str
    doctor: str  # the command
    curl: str  # an example request
    open_tenant: bool
    lines: list[str]


def startup_info(
    app: Gateway, api: tuple[str, int], ops: tuple[str, int] | None, embedded: Embedded | None
) -> StartupInfo:
    cfg = app.config
    base = f"http://{_url_host(api[0])}:{api[1]}"
    ops_base = f"http://{_url_host(ops[0])}:{ops[1]}" if ops is not None else base
    models = app.router.served_models()
    model = models[0] if models else "MODEL"
    body = dumps({"model": model, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 8})
    key = "" if cfg.open_mode else " -H 'authorization: Bearer YOUR-KEY'"
    curl = (
        f"curl -si {base}/v1/chat/completions -H 'content-type: application/json'{key} -d {shlex.quote(body)}"
    )
    doctor = f"tokengate doctor {ops_base}"
    lines = [f"tokengate is ready: OpenAI API on {base}/v1"]
    if cfg.open_mode:
        lines.append("  tenants:   none configured: one open tenant takes any API key or none (drop-in use)")
    else:
        lines.append(f"  tenants:   {len(cfg.tenants)} configured; requests need one of their API keys")
    if embedded is not None:
        pools = ", ".join(f"pool {b.pool} on {b.url}" for b in embedded.backends)
        lines.append(f"  backends:  embedded simulated backends serving {embedded.model}: {pools}")
    if cfg.classes:
        lines.append(f"  classes:   {'; '.join(_rule_words(r.to_config()) for r in cfg.classes)}")
    lines.append(f"  try:       {curl}")
    if ops is not None:
        lines.append(f"  dashboard: {ops_base}/dashboard   (per-class latency, pools, queues, split advice)")
    else:
        lines.append(f"  dashboard: {ops_base}/dashboard   (a read or admin token: ops.port is null)")
    lines.append(f"  doctor:    {doctor}")
    return StartupInfo(base + "/v1", ops_base + "/dashboard", doctor, curl, cfg.open_mode, lines)


def _announce(
    app: Gateway,
    api: tuple[str, int],
    ops: tuple[str, int] | None,
    embedded: Embedded | None,
    fmt: LogFormat,
) -> None:
    """Where to try the gateway, once it accepts requests: plain lines in text, one record in JSON."""
    info = startup_info(app, api, ops, embedded)
    if fmt == "text":
        print("\n".join(info.lines), file=sys.stderr, flush=True)
        return
    log.info(
        "tokengate is ready: OpenAI API on %s, dashboard on %s",
        info.api,
        info.dashboard,
        extra={
            "fields": {
                "api": info.api,
                "open_tenant": info.open_tenant,
                "try": info.curl,
                "dashboard": info.dashboard,
                "doctor": info.doctor,
            }
        },
    )


def _rule_words(rule: Mapping[str, Any]) -> str:
    when = rule.get("when") or {}
    cond = ", ".join(f"{k} {v}" for k, v in when.items()) if when else "everything else"
    return f"{rule.get('name')} ({cond}) -> pool {rule.get('pool') or 'of the model'}"


@dataclass
class _OpsListener:
    server: uvicorn.Server
    task: asyncio.Task[None]
    address: tuple[str, int]

    async def stop(self) -> None:
        self.server.should_exit = True
        with contextlib.suppress(asyncio.CancelledError):
            await self.task


async def _start_ops_listener(app: Gateway, log_level: str) -> _OpsListener | None:
    """The ops listener on ``ops.host:ops.port`` (same process, same loop); None when ops.port is null."""
    ops = app.config.ops
    if ops.port is None:
        log.warning(
            "ops.port is null: /metrics, /stats, /insights, /dashboard and /admin are on the API port (token required)"
        )
        return None
    sock = bind_listener(
        ops.host,
        ops.port,
        "ops listener",
        "set ops.port to a free port (0 = any), or null to serve operator routes on the API port",
    )
    config = uvicorn.Config(
        app.ops_app,
        log_level=log_level,
        log_config=None,
        access_log=False,
        lifespan="off",
        http=guarded_protocol(connection_limits(app.config)),
        server_header=False,
    )
    server = uvicorn.Server(config)
    task = asyncio.get_running_loop().create_task(_serve_quietly(server, sock), name="tokengate-ops-listener")
    bound = sock.getsockname()
    log.info("ops listener on http://%s:%d (/metrics /stats /insights /dashboard /admin)", bound[0], bound[1])
    return _OpsListener(server, task, (bound[0], bound[1]))


async def _serve_quietly(server: uvicorn.Server, sock: socket.socket) -> None:
    """``Server.serve`` without its signal handlers (the API server drains) and without a second
    "Started server process" line (the API server logs it once for the process)."""
    config = server.config
    if not config.loaded:
        config.load()
    server.lifespan = config.lifespan_class(config)
    await server.startup(sockets=[sock])
    if not server.should_exit:
        await server.main_loop()
    if server.started:
        await server.shutdown(sockets=[sock])


def _unchanged(config: GatewayConfig) -> GatewayConfig:
    return config


def _reload_on_sighup(app: Gateway) -> None:
    """SIGHUP re-reads the config file and applies it live; a bad file is logged and changes nothing."""
    tasks: set[asyncio.Task[None]] = set()

    async def reload() -> None:
        try:
            kept = await app.reload()
        except (ConfigError, ValueError) as exc:
            log.error("reload refused, the running configuration is unchanged: %s", exc)
            return
        log.info("reloaded %s%s", app.config_path, f" (needs a restart: {', '.join(kept)})" if kept else "")

    def on_hup() -> None:
        task = asyncio.get_running_loop().create_task(reload())
        tasks.add(task)
        task.add_done_callback(tasks.discard)

    with contextlib.suppress(NotImplementedError, RuntimeError):  # no signals off the main thread
        asyncio.get_running_loop().add_signal_handler(signal.SIGHUP, on_hup)


def serve(
    config: GatewayConfig,
    *,
    host: str,
    port: int,
    log_level: str = "info",
    config_path: str | None = None,
    raw: Mapping[str, Any] | None = None,
    log_format: LogFormat = "json",
) -> int:
    import uvloop

    uvloop.run(
        serve_async(
            config,
            host=host,
            port=port,
            log_level=log_level,
            config_path=config_path,
            raw=raw,
            log_format=log_format,
        )
    )
    return 0


CONFIG_ENV = "TOKENGATE_CONFIG"


def app_from_env() -> Gateway:
    """uvicorn factory for ``--workers N``: each worker loads the config named in the environment
    and sets up its logging as the parent did (a spawned worker does not inherit it)."""

    path = os.environ.get(CONFIG_ENV) or None
    fmt = os.environ.get(LOG_FORMAT_ENV, "json")
    setup_logging(
        os.environ.get(LOG_LEVEL_ENV, "info"),
        os.environ.get(ACCESS_LOG_ENV, "1") == "1",
        "text" if fmt == "text" else "json",
    )
    raw = load_raw(path) if path else {}
    config = parse_config(raw)
    # The worker's protocol class is named by import string (a class made at run time cannot cross
    # into a spawned worker); this worker process serves one config, so it sets the limits here.
    GuardedHttpToolsProtocol.limits = connection_limits(config)
    app = build_app(config, raw=raw)
    app.source.path = path
    tune_collector(config.gc)
    freeze_startup_heap()  # before the app's own start-up (uvicorn runs it next), not after
    return app


def serve_workers(
    config_path: str | None, *, host: str, port: int, workers: int, log_level: str = "info"
) -> int:
    """Several worker processes (needs a shared store; checked by the caller). Each worker drains
    in its lifespan shutdown, after uvicorn's graceful wait (bounded by the drain timeout)."""
    from gateway.config.loader import load_config

    config = load_config(config_path)
    # uvicorn binds in the supervisor after its own start-up lines; a busy port is said here first.
    bind_listener(host, port, "tokengate serve", "stop what uses it, or choose another port").close()
    if config_path:
        os.environ[CONFIG_ENV] = os.path.abspath(config_path)
    uvicorn.run(
        "gateway.process.serve:app_from_env",
        factory=True,
        host=host,
        port=port,
        workers=workers,
        log_level=log_level,
        log_config=None,
        access_log=False,
        lifespan="on",
        http="gateway.process.http_server:GuardedHttpToolsProtocol",
        loop="uvloop",
        timeout_graceful_shutdown=int(config.drain_timeout_s) + 1,
        server_header=False,
    )
    return 0

"""``tokengate serve``: run the gateway (and, with no pools configured, the embedded backend).

The uvicorn server is subclassed only to drain before uvicorn's own shutdown: on SIGTERM/SIGINT
the gateway stops admitting (503 for new requests, queued ones fail fast), lets in-flight
requests finish up to ``drain_timeout_s``, cancels the rest (releasing their tokens), and only
then lets uvicorn close connections and run the lifespan shutdown.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import socket
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import uvicorn

from gateway.accesslog import LineHandler
from gateway.app import Gateway, build_app
from gateway.config import GatewayConfig
from gateway.config_loader import load_raw, parse_config
from gateway.embedded import start_embedded, with_embedded_pool
from gateway.fields import ConfigError
from gateway.http_server import GuardedHttpToolsProtocol, connection_limits, guarded_protocol

log = logging.getLogger("tokengate")


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, gateway: Gateway) -> None:
        super().__init__(config)
        self.gateway = gateway

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        await self.gateway.drain(self.gateway.config.drain_timeout_s)
        await super().shutdown(sockets)


def setup_logging(level: str, access_log: bool) -> None:
    logging.basicConfig(level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # httpx logs every health probe at INFO.
    logging.getLogger("httpx").setLevel(logging.WARNING)
    access = logging.getLogger("tokengate.access")
    access.propagate = False
    access.handlers.clear()
    if access_log:
        access.addHandler(LineHandler(sys.stdout))
        access.setLevel(logging.INFO)
    else:
        access.setLevel(logging.WARNING)


def _uvicorn_config(app: Gateway, host: str, port: int, log_level: str) -> uvicorn.Config:
    return uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level=log_level,
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
) -> None:
    """``raw``: the file's YAML as read (admin changes are written over it); ``{}`` without a file."""
    embedded = None
    prepare: Callable[[GatewayConfig], GatewayConfig] = _unchanged
    if not config.pools:
        started = await start_embedded(config)
        embedded = started

        def prepare(c: GatewayConfig) -> GatewayConfig:
            # Every later config (reload, admin change) without pools of its own keeps the embedded one.
            return c if c.pools else with_embedded_pool(c, started)

        log.info(
            "no pools configured: embedded reference backend on %s (model %s)", started.url, started.model
        )
    try:
        app = build_app(prepare(config), raw={} if raw is None else raw)
        app.config_path = config_path
        app.prepare = prepare
        _reload_on_sighup(app)
        ops = await _start_ops_listener(app, log_level)
        server = DrainingServer(_uvicorn_config(app, host, port, log_level), app)
        try:
            await server.serve()
        finally:
            if ops is not None:
                await ops.stop()
    finally:
        if embedded is not None:
            await embedded.stop()


@dataclass
class _OpsListener:
    server: uvicorn.Server
    task: asyncio.Task[None]

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
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((ops.host, ops.port))
    except OSError as exc:
        sock.close()
        raise OSError(
            f"ops listener: cannot listen on {ops.host}:{ops.port} ({exc.strerror}); set ops.port to a free port "
            "(0 = any), or null to serve operator routes on the API port"
        ) from None
    config = uvicorn.Config(
        app.ops_app,
        log_level=log_level,
        access_log=False,
        lifespan="off",
        http=guarded_protocol(connection_limits(app.config)),
        server_header=False,
    )
    server = uvicorn.Server(config)
    server.capture_signals = contextlib.nullcontext  # type: ignore[method-assign,assignment]  # the API server drains
    task = asyncio.get_running_loop().create_task(server.serve(sockets=[sock]), name="tokengate-ops-listener")
    bound = sock.getsockname()
    log.info("ops listener on http://%s:%d (/metrics /stats /insights /dashboard /admin)", bound[0], bound[1])
    return _OpsListener(server, task)


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
) -> int:
    import uvloop

    uvloop.run(
        serve_async(config, host=host, port=port, log_level=log_level, config_path=config_path, raw=raw)
    )
    return 0


CONFIG_ENV = "TOKENGATE_CONFIG"


def app_from_env() -> Gateway:
    """uvicorn factory for ``--workers N``: each worker loads the config named in the environment."""
    import os

    path = os.environ.get(CONFIG_ENV) or None
    raw = load_raw(path) if path else {}
    config = parse_config(raw)
    # The worker's protocol class is named by import string (a class made at run time cannot cross
    # into a spawned worker); this worker process serves one config, so it sets the limits here.
    GuardedHttpToolsProtocol.limits = connection_limits(config)
    app = build_app(config, raw=raw)
    app.config_path = path
    return app


def serve_workers(
    config_path: str | None, *, host: str, port: int, workers: int, log_level: str = "info"
) -> int:
    """Several worker processes (needs a shared store; checked by the caller). Each worker drains
    in its lifespan shutdown, after uvicorn's graceful wait (bounded by the drain timeout)."""
    import os

    from gateway.config_loader import load_config

    config = load_config(config_path)
    if config_path:
        os.environ[CONFIG_ENV] = os.path.abspath(config_path)
    uvicorn.run(
        "gateway.serve:app_from_env",
        factory=True,
        host=host,
        port=port,
        workers=workers,
        log_level=log_level,
        access_log=False,
        lifespan="on",
        http="gateway.http_server:GuardedHttpToolsProtocol",
        loop="uvloop",
        timeout_graceful_shutdown=int(config.drain_timeout_s) + 1,
        server_header=False,
    )
    return 0

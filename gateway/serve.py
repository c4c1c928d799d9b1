"""``tokengate serve``: run the gateway (and, with no pools configured, the embedded backend).

The uvicorn server is subclassed only to drain before uvicorn's own shutdown: on SIGTERM/SIGINT
the gateway stops admitting (503 for new requests, queued ones fail fast), lets in-flight
requests finish up to ``drain_timeout_s``, cancels the rest (releasing their tokens), and only
then lets uvicorn close connections and run the lifespan shutdown.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import sys

import uvicorn

from gateway.accesslog import LineHandler
from gateway.app import Gateway, build_app
from gateway.config import GatewayConfig
from gateway.embedded import start_embedded, with_embedded_pool
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


async def serve_async(config: GatewayConfig, *, host: str, port: int, log_level: str = "info") -> None:
    embedded = None
    if not config.pools:
        embedded = await start_embedded(config)
        config = with_embedded_pool(config, embedded)
        log.info(
            "no pools configured: embedded reference backend on %s (model %s)", embedded.url, embedded.model
        )
    try:
        app = build_app(config)
        server = DrainingServer(_uvicorn_config(app, host, port, log_level), app)
        await server.serve()
    finally:
        if embedded is not None:
            await embedded.stop()


def serve(config: GatewayConfig, *, host: str, port: int, log_level: str = "info") -> int:
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop ships with uvicorn[standard]
        asyncio.run(serve_async(config, host=host, port=port, log_level=log_level))
    else:
        uvloop.run(serve_async(config, host=host, port=port, log_level=log_level))
    return 0


CONFIG_ENV = "TOKENGATE_CONFIG"


def app_from_env() -> Gateway:
    """uvicorn factory for ``--workers N``: each worker loads the config named in the environment."""
    import os

    from gateway.config_loader import load_config

    config = load_config(os.environ.get(CONFIG_ENV) or None)
    # The worker's protocol class is named by import string (a class made at run time cannot cross
    # into a spawned worker); this worker process serves one config, so it sets the limits here.
    GuardedHttpToolsProtocol.limits = connection_limits(config)
    return build_app(config)


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

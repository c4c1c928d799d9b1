"""The embedded default backend: the simulated reference backend in the gateway's own process.

When no ``pools`` are configured, ``tokengate serve`` serves
``backends.reference.server.build_app`` with a second ``uvicorn.Server`` on the same event loop
and points a pool ``default`` at it, so the gateway works with nothing else running.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import socket
from dataclasses import dataclass
from typing import Any

import uvicorn

from gateway.config import GatewayConfig
from gateway.upstream.pools import BackendPoolSpec, BackendSpec


@dataclass
class EmbeddedBackend:
    url: str
    model: str
    capacity_tokens: int
    server: uvicorn.Server
    task: asyncio.Task[None]

    async def stop(self) -> None:
        self.server.should_exit = True
        with contextlib.suppress(asyncio.CancelledError):
            await self.task


def _bind(host: str, port: int) -> socket.socket:
    # proto=IPPROTO_TCP: asyncio only sets TCP_NODELAY on accepted sockets whose proto says TCP
    # (a proto-0 listener costs every keep-alive response a 40 ms delayed-ACK stall).
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise OSError(
            f"embedded backend: cannot listen on {host}:{port} ({exc.strerror}); set embedded_backend.port "
            "to a free port (0 = any) or configure pools"
        ) from None
    return sock


async def start_embedded(config: GatewayConfig, *, log_level: str = "warning") -> EmbeddedBackend:
    from backends.engine.factory import DEFAULT_SIM_KV_TOKENS
    from backends.reference.server import BackendSettings, build_app

    emb = config.embedded_backend
    sock = _bind(emb.host, emb.port)
    port = sock.getsockname()[1]
    settings: Any = BackendSettings(host=emb.host, port=port, **dict(emb.settings))
    if emb.capacity_tokens is not None:
        capacity = emb.capacity_tokens
    elif settings.num_blocks:
        capacity = settings.num_blocks * settings.block_size
    else:
        capacity = DEFAULT_SIM_KV_TOKENS
    server = uvicorn.Server(
        uvicorn.Config(
            build_app(settings),
            log_level=log_level,
            access_log=False,
            lifespan="on",
            timeout_graceful_shutdown=2,
        )
    )
    # The gateway's own server handles the signals; this one is stopped after it.
    server.capture_signals = contextlib.nullcontext  # type: ignore[method-assign,assignment]
    task = asyncio.create_task(server.serve(sockets=[sock]), name="tokengate-embedded-backend")
    while not server.started:
        if task.done():
            task.result()
            raise RuntimeError("embedded backend exited during start-up")
        await asyncio.sleep(0.01)
    return EmbeddedBackend(f"http://{emb.host}:{port}", settings.model, capacity, server, task)


def with_embedded_pool(config: GatewayConfig, backend: EmbeddedBackend) -> GatewayConfig:
    """``config`` with a pool ``default`` pointing at the embedded backend."""
    pool = BackendPoolSpec(
        "default",
        (
            BackendSpec(
                url=backend.url,
                capacity_tokens=backend.capacity_tokens,
                models=(backend.model,),
                name="embedded",
            ),
        ),
    )
    return dataclasses.replace(config, pools=(pool,))

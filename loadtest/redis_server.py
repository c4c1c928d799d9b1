"""A throw-away ``redis-server`` on a free port in a temp dir, for the benchmarks and the tests.

Never relies on a Redis already running on the machine. Persistence is off, so ``restart`` is a
cold start with an empty dataset (the failure the Redis store must survive). The server gets
SIGKILL when the process that started it dies, however it dies, and runs in its own session so a
terminal's Ctrl-C reaches only its parent (which may still need Redis while it shuts down).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any
from urllib.parse import quote

from loadtest.processes import die_with_parent, free_port

REDIS_SERVER = shutil.which("redis-server") or "/usr/bin/redis-server"


def ping(port: int, timeout_s: float = 0.2) -> bool:
    """True when a Redis answers PING on 127.0.0.1:``port`` (raw RESP: no client library state); one
    that asks for a password first (``requirepass``) is up too."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=timeout_s) as s:
            s.sendall(b"*1\r\n$4\r\nPING\r\n")
            return s.recv(16).startswith((b"+PONG", b"-NOAUTH"))
    except OSError:
        return False


def used_cpu_seconds(client: Any) -> float:
    """A Redis's own CPU time so far, through a redis-py client: ``INFO cpu`` used_cpu_sys +
    used_cpu_user (what a benchmark charges to Redis per request)."""
    info = client.info("cpu")
    return float(info["used_cpu_sys"]) + float(info["used_cpu_user"])


def add_redis_option(
    parser: argparse.ArgumentParser, help: str = "a redis-server setting (repeatable)"
) -> None:
    """A benchmark's ``--redis-option NAME=VALUE`` (repeatable; ``config_args`` reads what it gathered)."""
    parser.add_argument("--redis-option", action="append", metavar="NAME=VALUE", help=help)


def config_args(options: Sequence[str] | None) -> list[str]:
    """``NAME=VALUE`` settings (a benchmark's ``--redis-option``) as redis-server arguments."""
    out: list[str] = []
    for option in options or ():
        name, sep, value = option.partition("=")
        if not sep or not name:
            raise ValueError(f"--redis-option {option!r}: expected NAME=VALUE")
        out += [f"--{name}", value]
    return out


class RedisServer:
    """One redis-server process: ``start``, ``kill`` (SIGKILL), ``restart`` (same port, empty data),
    ``stop`` (kill and remove its directory)."""

    def __init__(
        self,
        port: int | None = None,
        workdir: Path | None = None,
        extra_args: Sequence[str] = (),
        executable: str = REDIS_SERVER,
    ) -> None:
        self.port = port or free_port()
        self.executable = executable
        self.extra_args = list(extra_args)  # more config directives, e.g. ("--rename-command", "FCALL", "")
        self._own_dir = workdir is None
        self.workdir = workdir or Path(tempfile.mkdtemp(prefix="tg-redis-"))
        self.proc: subprocess.Popen[bytes] | None = None
        self._client: Any = None  # redis-py, only for cpu_seconds

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def start(self, timeout_s: float = 10.0) -> RedisServer:
        if self.running:
            return self
        args = [
            self.executable,
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
            *self.extra_args,
        ]
        self.proc = subprocess.Popen(
            args,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            preexec_fn=functools.partial(die_with_parent, signal.SIGKILL),
            start_new_session=True,
        )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                log = (self.workdir / "redis.log").read_text(errors="replace")[-2000:]
                raise RuntimeError(f"redis-server exited with {self.proc.returncode}: {log}")
            if ping(self.port):
                return self
            time.sleep(0.02)
        self.kill()
        raise RuntimeError(f"redis-server did not answer on port {self.port} within {timeout_s}s")

    def kill(self) -> None:
        """SIGKILL, no shutdown save: the dataset is gone."""
        self._close_client()
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

    def cpu_seconds(self) -> float:
        """Redis's own CPU time so far (see ``used_cpu_seconds``)."""
        if self._client is None:
            import redis

            self._client = redis.Redis.from_url(self.url)
        return used_cpu_seconds(self._client)

    def _close_client(self) -> None:
        if self._client is not None:
            with contextlib.suppress(Exception):
                self._client.close()
            self._client = None


class SentinelGroup:
    """A primary, its replica and three sentinels watching them, on free loopback ports: Redis's own
    failover, for real. ``url`` is the store's ``redis+sentinel://`` URL; ``kill_primary`` SIGKILLs
    the primary (the sentinels promote the replica), ``failover`` asks them to switch roles with both
    alive (the old primary comes back as a replica, refusing writes with READONLY). With ``password``
    the data nodes ask for it (``requirepass``, and the replica gives it to its primary); with
    ``sentinel_password`` so do the sentinels."""

    MASTER = "tgmaster"

    def __init__(
        self,
        down_after_ms: int = 300,
        failover_timeout_ms: int = 2000,
        password: str | None = None,
        sentinel_password: str | None = None,
    ) -> None:
        self.password, self.sentinel_password = password, sentinel_password
        auth = ["--requirepass", password, "--masterauth", password] if password else []
        self.primary = RedisServer(extra_args=auth)
        self.replica = RedisServer(extra_args=auth)
        self.sentinel_ports = [free_port() for _ in range(3)]
        self._sentinels: list[subprocess.Popen[bytes]] = []
        self._dir = Path(tempfile.mkdtemp(prefix="tg-sentinel-"))
        self._down_after_ms = down_after_ms
        self._failover_timeout_ms = failover_timeout_ms

    @property
    def url(self) -> str:
        hosts = ",".join(f"127.0.0.1:{p}" for p in self.sentinel_ports)
        auth = f":{quote(self.password, safe='')}@" if self.password else ""
        query = (
            f"?sentinel_password={quote(self.sentinel_password, safe='')}" if self.sentinel_password else ""
        )
        return f"redis+sentinel://{auth}{hosts}/{self.MASTER}/0{query}"

    def start(self, timeout_s: float = 15.0) -> SentinelGroup:
        self.primary.start()
        self.replica.extra_args += ["--replicaof", "127.0.0.1", str(self.primary.port)]
        self.replica.start()
        for port in self.sentinel_ports:
            conf = self._dir / f"sentinel-{port}.conf"
            conf.write_text(
                f"port {port}\nbind 127.0.0.1\nprotected-mode no\ndaemonize no\n"
                f"dir {self._dir}\nlogfile {self._dir / f'sentinel-{port}.log'}\n"
                f"sentinel monitor {self.MASTER} 127.0.0.1 {self.primary.port} 2\n"
                f"sentinel down-after-milliseconds {self.MASTER} {self._down_after_ms}\n"
                f"sentinel failover-timeout {self.MASTER} {self._failover_timeout_ms}\n"
                f"sentinel parallel-syncs {self.MASTER} 1\n"
                + (f'sentinel auth-pass {self.MASTER} "{self.password}"\n' if self.password else "")
                + (f'requirepass "{self.sentinel_password}"\n' if self.sentinel_password else "")
            )
            self._sentinels.append(
                subprocess.Popen(
                    [REDIS_SERVER, str(conf), "--sentinel"],
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                    preexec_fn=functools.partial(die_with_parent, signal.SIGKILL),
                    start_new_session=True,
                )
            )
        deadline = time.monotonic() + timeout_s
        while not all(ping(p) for p in self.sentinel_ports) or self._replicas_known() < 3:
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError("the sentinels did not come up watching the primary and its replica")
            time.sleep(0.05)
        return self

    def primary_port(self) -> int | None:
        """The port the sentinels give for the master now (None: none answered)."""
        for port in self.sentinel_ports:
            reply = _command(
                port, "SENTINEL", "get-master-addr-by-name", self.MASTER, password=self.sentinel_password
            )
            if isinstance(reply, list) and len(reply) == 2:
                return int(reply[1])
        return None

    def kill_primary(self) -> int:
        """SIGKILL the node that is primary now; returns its port."""
        port = self.primary_port()
        node = self.primary if port == self.primary.port else self.replica
        node.kill()
        return node.port

    def failover(self, timeout_s: float = 10.0) -> None:
        """A manual failover (``SENTINEL FAILOVER``): the replica is promoted, the primary demoted.
        A sentinel promotes only a replica whose last report shows it in sync; one that has not
        heard such a report yet answers NOGOODSLAVE, so that is asked again (bounded)."""
        deadline = time.monotonic() + timeout_s
        while True:
            reply = _command(
                self.sentinel_ports[0], "SENTINEL", "failover", self.MASTER, password=self.sentinel_password
            )
            if reply == "OK":
                return
            if "NOGOODSLAVE" not in str(reply) or time.monotonic() > deadline:
                raise RuntimeError(f"SENTINEL FAILOVER: {reply!r}")
            time.sleep(0.1)

    def wait_primary_change(self, old_port: int, timeout_s: float = 15.0) -> int:
        """Wait until the sentinels name another primary that answers as one; returns its port."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            port = self.primary_port()
            if port is not None and port != old_port:
                role = _command(port, "ROLE", password=self.password)
                if isinstance(role, list) and role and role[0] == "master":
                    return port
            time.sleep(0.05)
        raise RuntimeError(f"no failover away from port {old_port} within {timeout_s}s")

    def stop(self) -> None:
        for proc in self._sentinels:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)
        self._sentinels.clear()
        self.primary.stop()
        self.replica.stop()
        shutil.rmtree(self._dir, ignore_errors=True)

    def _replicas_known(self) -> int:
        """How many sentinels see the replica in sync with the primary (and so could promote it)."""
        known = 0
        for port in self.sentinel_ports:
            reply = _command(port, "SENTINEL", "replicas", self.MASTER, password=self.sentinel_password)
            for replica in reply if isinstance(reply, list) else ():
                fields = dict(zip(replica[::2], replica[1::2], strict=False))
                if fields.get("master-link-status") == "ok" and fields.get("flags") == "slave":
                    known += 1
                    break
        return known


def _command(port: int, *args: str, timeout_s: float = 1.0, password: str | None = None) -> Any:
    """One command to 127.0.0.1:``port`` and its reply (None when nothing answered), after an AUTH
    with ``password`` when given."""
    import hiredis

    def encode(cmd: Sequence[str]) -> bytes:
        return f"*{len(cmd)}\r\n".encode() + b"".join(
            f"${len(a.encode())}\r\n".encode() + a.encode() + b"\r\n" for a in cmd
        )

    payload = (encode(("AUTH", password)) if password else b"") + encode(args)
    replies: list[Any] = []
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=timeout_s) as s:
            s.sendall(payload)
            reader = hiredis.Reader(encoding="utf-8")
            while True:
                data = s.recv(65536)
                if not data:
                    return None
                reader.feed(data)
                while (reply := reader.gets()) is not False:
                    replies.append(reply)
                if len(replies) == (2 if password else 1):
                    return replies[-1]
    except OSError:
        return None


class RedisCluster:
    """A Redis Cluster of ``masters`` primaries (no replicas) on free loopback ports, slots spread
    evenly by ``redis-cli --cluster create``. ``url`` is the store's ``redis+cluster://`` URL."""

    def __init__(self, masters: int = 3) -> None:
        self.nodes = [
            RedisServer(
                port=_cluster_port(),
                extra_args=["--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
                            "--cluster-node-timeout", "2000"],
            )
            for _ in range(masters)
        ]  # fmt: skip

    @property
    def url(self) -> str:
        return "redis+cluster://" + ",".join(f"127.0.0.1:{n.port}" for n in self.nodes)

    def start(self, timeout_s: float = 30.0) -> RedisCluster:
        for node in self.nodes:
            node.start()
        cli = shutil.which("redis-cli") or "/usr/bin/redis-cli"
        if len(self.nodes) == 1:  # redis-cli wants three masters: give the one node every slot
            slots = [str(s) for s in range(16384)]
            reply = _command(self.nodes[0].port, "CLUSTER", "ADDSLOTS", *slots, timeout_s=10)
            if reply != "OK":
                raise RuntimeError(f"CLUSTER ADDSLOTS: {reply!r}")
        else:
            subprocess.run(
                [cli, "--cluster", "create", *(f"127.0.0.1:{n.port}" for n in self.nodes),
                 "--cluster-replicas", "0", "--cluster-yes"],
                check=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, timeout=timeout_s,
            )  # fmt: skip
        deadline = time.monotonic() + timeout_s
        while not all(self._ok(n.port) for n in self.nodes):
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError("the cluster did not reach cluster_state:ok")
            time.sleep(0.05)
        return self

    def owner(self, slot: int) -> RedisServer:
        """The node that serves ``slot`` now, as the first node sees it."""
        for start, end, primary, *_ in _command(self.nodes[0].port, "CLUSTER", "SLOTS"):
            if start <= slot <= end:
                return next(n for n in self.nodes if n.port == int(primary[1]))
        raise RuntimeError(f"no node serves slot {slot}")

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()

    @staticmethod
    def _ok(port: int) -> bool:
        info = _command(port, "CLUSTER", "INFO")
        return isinstance(info, str) and "cluster_state:ok" in info


def _cluster_port() -> int:
    """A free port whose cluster bus port (10,000 above it) is free too, so at most 55,535."""
    import random

    for _ in range(200):
        port = random.randrange(20_000, 45_000)
        if all(_bindable(p) for p in (port, port + 10_000)):
            return port
    raise RuntimeError("no free port pair for a cluster node")


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True

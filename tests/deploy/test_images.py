"""The Dockerfile, .dockerignore and the files the images carry (deploy/docker), checked as files;
the compose test builds and runs them."""

from __future__ import annotations

import fnmatch
import importlib.util
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
import yaml

from gateway.config.loader import load_config, parse_config
from tests.deploy import stack as st

ROOT = st.ROOT
DOCKERFILE = (ROOT / "Dockerfile").read_text()
DOCKERIGNORE = [
    line.strip()
    for line in (ROOT / ".dockerignore").read_text().splitlines()
    if line.strip() and not line.startswith("#")
]


def stages() -> dict[str, str]:
    """Stage name -> its instructions."""
    parts = re.split(r"^FROM\s+", DOCKERFILE, flags=re.M)[1:]
    out = {}
    for part in parts:
        head = part.splitlines()[0]
        m = re.search(r"\bAS\s+(\S+)", head, re.I)
        assert m, f"unnamed stage: FROM {head}"
        out[m.group(1)] = part
    return out


def render_module() -> ModuleType:
    spec = importlib.util.spec_from_file_location("render_config", ROOT / "deploy/docker/render_config.py")
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def sent_to_build(rel: str) -> bool:
    """Whether .dockerignore lets ``rel`` into the build context (last matching rule wins)."""
    included = True
    for rule in DOCKERIGNORE:
        negate = rule.startswith("!")
        pattern = rule[1:] if negate else rule
        pattern = pattern.removeprefix("**/")
        parts = rel.split("/")
        hit = any(
            fnmatch.fnmatch("/".join(parts[:i]), pattern) or fnmatch.fnmatch(parts[i - 1], pattern)
            for i in range(1, len(parts) + 1)
        )
        if hit:
            included = negate
    return included


def test_the_gateway_image_is_the_default_target_and_reference_adds_pinned_torch() -> None:
    s = stages()
    assert list(s)[-1] == "gateway", "the last stage is what `docker build .` builds"
    assert {"build", "runtime", "reference", "gateway"} <= set(s)
    assert "torch" not in s["build"] and "torch" not in s["gateway"]
    ref = s["reference-build"]
    spec = re.search(r"ARG TORCH_SPEC=(\S+)", ref)
    assert spec and spec.group(1) == "torch==2.13.0+cpu"
    assert "ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu" in ref


def test_every_stage_starts_from_slim_debian_and_runs_as_a_non_root_user() -> None:
    assert re.search(r"^ARG BASE_IMAGE=debian:bookworm-slim$", DOCKERFILE, re.M)
    for name, body in stages().items():
        assert body.split()[0] in ("${BASE_IMAGE}", "build", "runtime"), name
    runtime = stages()["runtime"]
    assert re.search(r"^USER 10001:10001$", runtime, re.M)
    assert re.search(r"^ENTRYPOINT \[\"tokengate-entrypoint\"\]$", runtime, re.M)
    for target in ("gateway", "reference"):
        body = stages()[target]
        assert re.search(r"^HEALTHCHECK .* CMD \[\"tokengate-healthcheck\"\]$", body, re.M), target
        assert "TOKENGATE_HEALTHCHECK_URL=" in body


def test_the_entrypoint_execs_tokengate_so_sigterm_reaches_it() -> None:
    entry = (ROOT / "deploy/docker/entrypoint.sh").read_text()
    assert re.search(r'^exec tokengate "\$@"$', entry, re.M)
    assert subprocess.run(["sh", "-n", str(ROOT / "deploy/docker/entrypoint.sh")]).returncode == 0


def test_the_build_context_has_what_the_dockerfile_copies_and_the_hash_covers_it() -> None:
    copied = re.findall(r"^COPY (?!--from)(\S+)", DOCKERFILE, re.M)
    assert copied
    for src in copied:
        assert (ROOT / src).exists(), src
        assert sent_to_build(src), f"{src} is excluded by .dockerignore"
        assert any(src == i or src.startswith(i + "/") for i in (*st.BUILD_INPUTS, *st.PACKAGES)), (
            f"{src} is not in the compose test's image hash"
        )
    for name in ("tests", ".venv", ".git", "docs", "examples", "gateway/__pycache__"):
        assert not sent_to_build(name), f"{name} should stay out of the build context"


def test_the_images_default_config_listens_on_every_interface_with_the_embedded_backend() -> None:
    config = load_config(ROOT / "deploy/docker/config.yaml")
    assert config.listen.host == "0.0.0.0" and config.ops.host == "0.0.0.0"
    assert not config.pools  # embedded backend: `docker run -p 8080:8080 tokengate` works alone


def test_a_config_template_gets_environment_values_as_quoted_strings() -> None:
    render = render_module().render
    template = "store: {kind: redis, url: ${TOKENGATE_REDIS_URL}}\npools: {p: {backends: [{url: http://b:8000, capacity_tokens: 10, api_key: ${KEY}}]}}\n"
    hostile = 'x" , kind: memory, y: "#'
    text = render(template, {"TOKENGATE_REDIS_URL": "redis://:p@ss:w#rd@redis:6379/0", "KEY": hostile})
    data = yaml.safe_load(text)
    assert data["store"] == {"kind": "redis", "url": "redis://:p@ss:w#rd@redis:6379/0"}
    assert data["pools"]["p"]["backends"][0]["api_key"] == hostile
    parse_config(data)


def test_a_config_template_with_an_unset_variable_is_refused_naming_it(tmp_path: Path) -> None:
    template = tmp_path / "t.yaml"
    template.write_text("store: {kind: redis, url: ${TOKENGATE_REDIS_URL}}\n")
    r = subprocess.run(
        [
            sys.executable,
            str(ROOT / "deploy/docker/render_config.py"),
            str(template),
            str(tmp_path / "out.yaml"),
        ],
        capture_output=True,
        text=True,
        env={"PATH": "/usr/bin:/bin"},
    )
    assert r.returncode == 2
    assert "TOKENGATE_REDIS_URL" in r.stderr
    assert not (tmp_path / "out.yaml").exists()


@pytest.mark.parametrize("url", ["http://127.0.0.1:1/healthz"])
def test_the_healthcheck_fails_when_nothing_answers(url: str) -> None:
    r = subprocess.run(
        [sys.executable, str(ROOT / "deploy/docker/healthcheck.py"), url], capture_output=True, text=True
    )
    assert r.returncode == 1 and "unhealthy" in r.stderr


def test_every_stage_carries_the_label_the_compose_test_prunes_by() -> None:
    """The compose test prunes this project's dangling images (earlier builds' stages, ~1.4 GB
    each) by their label; a stage without it would fill the disk build after build."""
    for name, body in stages().items():
        head = body.splitlines()[0]
        inherited = head.split()[0] in stages()  # FROM <another stage>: its labels come along
        assert inherited or f"LABEL {st.IMAGE_LABEL}" in body, f"stage {name} lacks LABEL {st.IMAGE_LABEL}"

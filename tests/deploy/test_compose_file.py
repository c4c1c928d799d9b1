"""compose.yaml and the files it mounts agree with each other and with tokengate (fast: no engine
runs a container here; `compose config` renders the file with the engine's own compose)."""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import pytest
import yaml

from gateway.config.loader import load_config
from gateway.config.schema import GatewayConfig
from tests.deploy import stack as st

ROOT = st.ROOT
COMPOSE = yaml.safe_load(st.COMPOSE_FILE.read_text())
SERVICES: dict[str, dict[str, Any]] = COMPOSE["services"]
PROM = yaml.safe_load((ROOT / "deploy" / "prometheus" / "prometheus.yml").read_text())
HAPROXY = (ROOT / "deploy" / "compose" / "haproxy.cfg").read_text()
GATEWAY_CONFIGS = sorted((ROOT / "deploy" / "compose").glob("gateway*.yaml"))


def gateways() -> list[str]:
    return sorted(s for s in SERVICES if re.fullmatch(r"gateway-\d+", s))


def backend_port(service: str) -> int:
    cmd = SERVICES[service]["command"]
    return int(cmd[cmd.index("--port") + 1])


def mounted(service: str, target: str) -> Path:
    """The host file compose mounts at ``target`` in ``service`` (env defaults applied)."""
    for v in SERVICES[service]["volumes"]:
        src, dst = re.sub(r"\$\{[A-Z_]+:-([^}]*)\}", r"\1", v).split(":")[:2]
        if dst == target:
            return (ROOT / src).resolve()
    raise AssertionError(f"{service}: nothing mounted at {target}")


@pytest.mark.parametrize("profile", [None, "gpu"])
def test_compose_config_renders_the_file_with_the_engines_compose(profile: str | None) -> None:
    cmd = st.compose_command()
    if cmd is None:
        message = (
            "no docker compose / podman-compose: make deploy-tools (scripts/container_setup.sh --tools-only)"
        )
        if os.environ.get("CI") == "true":
            pytest.fail(message)
        pytest.skip(message)
    env = {**os.environ, "TOKENGATE_ENV_FILE": str(ROOT / "deploy/compose/tokengate.env.example")}
    r = subprocess.run(
        [*cmd, *(["--profile", profile] if profile else []), "config"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert r.returncode == 0, r.stderr
    rendered = yaml.safe_load(r.stdout)
    expected = {s for s, spec in SERVICES.items() if not spec.get("profiles") or profile in spec["profiles"]}
    assert set(rendered["services"]) == expected
    lb_ports = json.dumps(rendered["services"]["lb"]["ports"])
    assert "8080" in lb_ports


def test_two_or_more_gateway_replicas_share_one_redis_and_one_config() -> None:
    assert len(gateways()) >= 2
    for g in gateways():
        assert SERVICES[g]["image"] == st.TOKENGATE_IMAGE
        assert SERVICES[g]["build"]["target"] == "gateway"
        assert mounted(g, "/etc/tokengate/config.yaml") == ROOT / "deploy/compose/gateway.yaml"
        assert SERVICES[g]["stop_signal"] == "SIGTERM"
    config = load_config(ROOT / "deploy/compose/gateway.yaml")
    assert config.store.kind == "redis" and config.store.redis is not None
    assert urlparse(config.store.redis.url).hostname == "redis" and "redis" in SERVICES
    assert config.store.redis.replicas == len(gateways())
    # SIGTERM drains for drain_timeout_s; compose must wait longer before it kills.
    grace = int(SERVICES[gateways()[0]]["stop_grace_period"].rstrip("s"))
    assert config.drain_timeout_s < grace


@pytest.mark.parametrize("path", GATEWAY_CONFIGS, ids=lambda p: p.name)
def test_each_compose_gateway_config_validates_and_listens_on_every_interface(path: Path) -> None:
    config: GatewayConfig = load_config(path)
    assert config.listen.host == "0.0.0.0" and config.listen.port == 8080
    assert config.ops.host == "0.0.0.0" and config.ops.port == 9091
    for pool in config.pools:
        for b in pool.backends:
            host = urlparse(b.url).hostname
            assert host in SERVICES, f"{path.name}: {b.url} is no compose service"
            assert urlparse(b.url).port == backend_port(str(host))


def test_the_load_balancer_is_the_only_published_api_port_and_checks_every_replica() -> None:
    servers = re.findall(r"^\s*server\s+(\S+)\s+(\S+):(\d+)", HAPROXY, re.M)
    assert sorted(name for name, _, _ in servers) == gateways()
    assert all(host == name and port == "8080" for name, host, port in servers)
    assert "option httpchk GET /readyz" in HAPROXY
    assert "retry-on conn-failure" in HAPROXY
    assert mounted("lb", "/usr/local/etc/haproxy/haproxy.cfg") == ROOT / "deploy/compose/haproxy.cfg"
    published = {s: spec.get("ports", []) for s, spec in SERVICES.items() if spec.get("ports")}
    assert any(":8080" in p for p in published["lb"])
    # Replicas publish no API port of their own (one ops port, gateway-1's, for the dashboard).
    for g in gateways():
        assert not any(p.endswith(":8080") for p in published.get(g, []))


def test_prometheus_scrapes_every_replicas_ops_port_and_every_sim_backend() -> None:
    jobs = {j["job_name"]: j for j in PROM["scrape_configs"]}
    targets = {t for c in jobs["tokengate"]["static_configs"] for t in c["targets"]}
    assert targets == {f"{g}:9091" for g in gateways()}
    engines = {t for c in jobs["engines"]["static_configs"] for t in c["targets"]}
    sim = [s for s, spec in SERVICES.items() if s.startswith("backend-") and "profiles" not in spec]
    assert engines == {f"{s}:{backend_port(s)}" for s in sim}
    assert mounted("prometheus", "/etc/prometheus") == ROOT / "deploy/prometheus"
    for rule in PROM["rule_files"]:
        assert (ROOT / "deploy/prometheus" / rule).is_file()


def test_grafana_provisions_the_compose_prometheus_and_the_per_class_dashboard() -> None:
    prov = mounted("grafana", "/etc/grafana/provisioning")
    ds = yaml.safe_load((prov / "datasources" / "prometheus.yml").read_text())["datasources"][0]
    assert urlparse(ds["url"]).hostname == "prometheus" and urlparse(ds["url"]).port == 9090
    provider = yaml.safe_load((prov / "dashboards" / "tokengate.yml").read_text())["providers"][0]
    dash_target = next(
        v.split(":")[1] for v in SERVICES["grafana"]["volumes"] if v.split(":")[0].endswith("tokengate.json")
    )
    assert Path(dash_target).parent == Path(provider["options"]["path"])
    dashboard = json.loads(mounted("grafana", dash_target).read_text())
    assert dashboard["uid"] == "tokengate" and len(dashboard["panels"]) >= 10


def test_the_stack_comes_up_in_order_on_healthchecks() -> None:
    for name, spec in SERVICES.items():
        for dep, cond in spec.get("depends_on", {}).items():
            assert cond == {"condition": "service_healthy"}, f"{name} -> {dep}"
            assert "healthcheck" in SERVICES[dep], f"{name} waits for {dep}, which has no healthcheck"
    for g in gateways():
        assert set(SERVICES[g]["depends_on"]) >= {"redis", "backend-short", "backend-long"}
        assert "/readyz" in " ".join(SERVICES[g]["healthcheck"]["test"])
    assert set(SERVICES["lb"]["depends_on"]) == set(gateways())
    assert SERVICES["grafana"]["depends_on"] == {"prometheus": {"condition": "service_healthy"}}


def test_the_admin_token_comes_from_an_env_file_that_is_not_committed() -> None:
    for g in gateways():
        assert SERVICES[g]["env_file"] == ["${TOKENGATE_ENV_FILE:-deploy/compose/tokengate.env}"]
    example = (ROOT / "deploy/compose/tokengate.env.example").read_text()
    assert re.search(r"^TOKENGATE_ADMIN_TOKEN=\S+", example, re.M)
    ignored = subprocess.run(
        ["git", "check-ignore", "-q", "deploy/compose/tokengate.env"], cwd=ROOT, capture_output=True
    )
    assert ignored.returncode == 0, "deploy/compose/tokengate.env must be git-ignored"


def test_the_gpu_backend_runs_the_torch_executor_on_a_reserved_gpu_under_its_profile() -> None:
    gpu = SERVICES["backend-gpu"]
    assert gpu["profiles"] == ["gpu"]
    assert gpu["build"]["target"] == "reference"
    assert (
        "--executor" in gpu["command"] and gpu["command"][gpu["command"].index("--executor") + 1] == "torch"
    )
    devices = gpu["deploy"]["resources"]["reservations"]["devices"]
    assert devices[0]["capabilities"] == ["gpu"] and devices[0]["driver"] == "nvidia"
    # Every other tokengate service runs from the gateway image (the sim executor needs no torch).
    for name, spec in SERVICES.items():
        if spec.get("image", "").startswith("localhost/tokengate:"):
            assert spec["build"]["target"] == "gateway", name

"""deploy/k8s: every kustomization rendered with ``kubectl kustomize`` and the objects checked —
probes, drain timing, resources, security context, references between objects, and the config in
the ConfigMap rendered with the image's template renderer and loaded by tokengate's own loader."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import pytest
import yaml

from gateway.config.loader import parse_config
from gateway.config.schema import GatewayConfig

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
KUSTOMIZATIONS = sorted(p.parent for p in K8S.rglob("kustomization.yaml"))
OVERLAYS = [p for p in KUSTOMIZATIONS if p.parent.name == "overlays"]
Obj = dict[str, Any]


def kubectl() -> str:
    found = shutil.which("kubectl")
    if found is None:
        message = "kubectl not installed: make deploy-tools (scripts/container_setup.sh --tools-only)"
        if os.environ.get("CI") == "true":
            pytest.fail(message)
        pytest.skip(message)
    return found


def render(path: Path) -> list[Obj]:
    r = subprocess.run([kubectl(), "kustomize", str(path)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    return [d for d in yaml.safe_load_all(r.stdout) if d]


def one(objs: list[Obj], kind: str, name: str) -> Obj:
    found = [o for o in objs if o["kind"] == kind and o["metadata"]["name"] == name]
    assert len(found) == 1, f"{kind}/{name}: {len(found)} found"
    return found[0]


def containers(objs: list[Obj]) -> Iterator[tuple[Obj, Obj]]:
    for o in objs:
        if o["kind"] == "Deployment":
            for c in o["spec"]["template"]["spec"]["containers"]:
                yield o, c


def gateway_config(objs: list[Obj]) -> GatewayConfig:
    """The ConfigMap's config.yaml as the container renders it at start, loaded by tokengate."""
    deploy = one(objs, "Deployment", "tokengate")
    pod = deploy["spec"]["template"]["spec"]
    volume = next(v for v in pod["volumes"] if v["name"] == "config")
    cm = one(objs, "ConfigMap", volume["configMap"]["name"])
    spec = importlib.util.spec_from_file_location("render_config", ROOT / "deploy/docker/render_config.py")
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    env = {e["name"]: e.get("value", f"from-secret-{e['name'].lower()}") for e in pod["containers"][0]["env"]}
    env["TOKENGATE_REDIS_URL"] = "redis://redis.example:6379/0"
    return parse_config(yaml.safe_load(mod.render(cm["data"]["config.yaml"], env)))


def test_every_kustomization_is_found() -> None:
    names = {p.relative_to(K8S).as_posix() for p in KUSTOMIZATIONS}
    assert names == {"base", "overlays/reference", "overlays/vllm"}


@pytest.mark.parametrize("path", KUSTOMIZATIONS, ids=lambda p: p.relative_to(K8S).as_posix())
def test_the_gateway_deployment_has_probes_drain_resources_and_a_non_root_security_context(
    path: Path,
) -> None:
    objs = render(path)
    deploy = one(objs, "Deployment", "tokengate")
    pod = deploy["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert c["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "http"}
    assert c["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "http"}
    config = gateway_config(objs)
    assert (config.listen.host, config.listen.port) == ("0.0.0.0", ports["http"])
    assert (config.ops.host, config.ops.port) == ("0.0.0.0", ports["ops"])
    # preStop lets endpoints drop the pod, then SIGTERM drains; the grace period covers both.
    sleep = int(c["lifecycle"]["preStop"]["exec"]["command"][1])
    assert pod["terminationGracePeriodSeconds"] > sleep + config.drain_timeout_s
    assert deploy["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"] == 0
    assert c["args"][:2] == ["serve", "--config"]
    env = {e["name"]: e for e in c["env"]}
    assert c["args"][2] == env["TOKENGATE_CONFIG_RENDERED"]["value"]
    assert Path(env["TOKENGATE_CONFIG_TEMPLATE"]["value"]).parent.as_posix() == next(
        m["mountPath"] for m in c["volumeMounts"] if m["name"] == "config"
    )
    assert config.store.kind == "redis"
    assert env["TOKENGATE_REDIS_URL"]["valueFrom"]["secretKeyRef"]["name"] == "tokengate-redis"
    assert "TOKENGATE_ADMIN_TOKEN" in env


@pytest.mark.parametrize("path", KUSTOMIZATIONS, ids=lambda p: p.relative_to(K8S).as_posix())
def test_every_container_runs_non_root_read_only_with_requests_and_a_memory_limit(path: Path) -> None:
    objs = render(path)
    seen = 0
    for deploy, c in containers(objs):
        pod = deploy["spec"]["template"]["spec"]
        where = f"{deploy['metadata']['name']}/{c['name']}"
        assert pod["securityContext"]["runAsNonRoot"] is True, where
        assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}, where
        sc = c["securityContext"]
        assert sc["allowPrivilegeEscalation"] is False and sc["readOnlyRootFilesystem"] is True, where
        assert sc["capabilities"]["drop"] == ["ALL"], where
        assert {"cpu", "memory"} <= set(c["resources"]["requests"]), where
        assert "memory" in c["resources"]["limits"], where
        assert "readinessProbe" in c and "livenessProbe" in c, where
        # The tokengate image's user; a writable /tmp (HOME) on the read-only root.
        if c["image"].startswith("tokengate"):
            assert pod["securityContext"]["runAsUser"] == 10001, where
            assert any(m["mountPath"] == "/tmp" for m in c["volumeMounts"]), where
        seen += 1
    assert seen >= 1


@pytest.mark.parametrize("path", KUSTOMIZATIONS, ids=lambda p: p.relative_to(K8S).as_posix())
def test_services_pdb_and_hpa_select_the_gateway_and_secrets_hold_every_referenced_key(path: Path) -> None:
    objs = render(path)
    deploy = one(objs, "Deployment", "tokengate")
    labels = deploy["spec"]["template"]["metadata"]["labels"]
    port_names = {p["name"] for p in deploy["spec"]["template"]["spec"]["containers"][0]["ports"]}
    for name, port in (("tokengate", "http"), ("tokengate-ops", "ops")):
        svc = one(objs, "Service", name)
        assert svc["spec"]["selector"].items() <= labels.items()
        assert [p["targetPort"] for p in svc["spec"]["ports"]] == [port] and port in port_names
    pdb = one(objs, "PodDisruptionBudget", "tokengate")
    assert pdb["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert pdb["spec"]["minAvailable"] >= 1
    hpa = one(objs, "HorizontalPodAutoscaler", "tokengate")
    assert hpa["spec"]["scaleTargetRef"] == {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "name": "tokengate",
    }
    assert hpa["spec"]["minReplicas"] >= 2 and hpa["spec"]["maxReplicas"] > hpa["spec"]["minReplicas"]
    # store.replicas (the fail-open split) follows the replicas the HPA keeps at least.
    store = gateway_config(objs).store.redis
    assert store is not None and store.replicas == hpa["spec"]["minReplicas"] == deploy["spec"]["replicas"]
    secrets = {o["metadata"]["name"]: o for o in objs if o["kind"] == "Secret"}
    for _, c in containers(objs):
        for e in c.get("env", []):
            ref = e.get("valueFrom", {}).get("secretKeyRef")
            if ref:
                assert ref["key"] in secrets[ref["name"]]["stringData"], f"{ref['name']}.{ref['key']}"


@pytest.mark.parametrize("path", OVERLAYS, ids=lambda p: p.name)
def test_every_backend_of_an_overlay_is_a_service_it_names(path: Path) -> None:
    objs = render(path)
    config = gateway_config(objs)
    assert config.pools, "an overlay configures its backend pools"
    services = {o["metadata"]["name"]: o for o in objs if o["kind"] == "Service"}
    for pool in config.pools:
        for b in pool.backends:
            url = urlparse(b.url)
            host = str(url.hostname)
            if "." in host:  # an existing Service elsewhere: service.namespace.svc.cluster.local
                assert host.endswith(".svc.cluster.local"), b.url
                continue
            svc = services[host]
            assert url.port in [p["port"] for p in svc["spec"]["ports"]], b.url


def test_the_reference_overlay_runs_sim_backends_and_its_demo_redis_matches_the_secret() -> None:
    objs = render(K8S / "overlays" / "reference")
    for name in ("backend-short", "backend-long"):
        c = one(objs, "Deployment", name)["spec"]["template"]["spec"]["containers"][0]
        args = c["args"]
        assert args[0] == "backend" and args[args.index("--executor") + 1] == "sim"
        assert (
            c["image"]
            == one(objs, "Deployment", "tokengate")["spec"]["template"]["spec"]["containers"][0]["image"]
        )
    url = urlparse(one(objs, "Secret", "tokengate-redis")["stringData"]["url"])
    assert url.hostname == "redis" and url.port in [
        p["port"] for p in one(objs, "Service", "redis")["spec"]["ports"]
    ]
    assert {o["metadata"].get("namespace") for o in objs} == {"tokengate"}


def test_the_vllm_overlay_forwards_priority_and_keeps_the_backend_key_in_a_secret() -> None:
    objs = render(K8S / "overlays" / "vllm")
    config = gateway_config(objs)
    text = (K8S / "overlays" / "vllm" / "config.yaml").read_text()
    assert "--scheduling-policy priority" in text
    for pool in config.pools:
        for b in pool.backends:
            assert b.accepts_priority
            assert b.api_key == "from-secret-vllm_api_key"  # filled from the environment at start
    env = {
        e["name"]: e
        for e in one(objs, "Deployment", "tokengate")["spec"]["template"]["spec"]["containers"][0]["env"]
    }
    assert env["VLLM_API_KEY"]["valueFrom"]["secretKeyRef"] == {"name": "vllm-api-key", "key": "api-key"}

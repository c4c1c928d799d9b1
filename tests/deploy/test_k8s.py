"""deploy/k8s: every kustomization rendered with ``kubectl kustomize`` and the objects checked —
probes, drain timing, resources, security context, references between objects, and the config in
the ConfigMap rendered with the image's template renderer and loaded by tokengate's own loader."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlparse

import pytest
import yaml

from gateway.config.loader import parse_config
from gateway.config.schema import GatewayConfig
from tests.deploy.kustomize import K8S, ROOT, Obj, gateway_raw_config, mounted_config_map, one, render

KUSTOMIZATIONS = sorted(p.parent for p in K8S.rglob("kustomization.yaml"))
OVERLAYS = [p for p in KUSTOMIZATIONS if p.parent.name == "overlays"]
# The gateway pods' command: the proxy, or Envoy's external processor behind an Envoy.
COMMAND = {"overlays/envoy": "extproc"}


def containers(objs: list[Obj]) -> Iterator[tuple[Obj, Obj]]:
    for o in objs:
        if o["kind"] == "Deployment":
            for c in o["spec"]["template"]["spec"]["containers"]:
                yield o, c


def gateway_config(objs: list[Obj]) -> GatewayConfig:
    """The ConfigMap's config.yaml as the container renders it at start, loaded by tokengate."""
    return parse_config(gateway_raw_config(objs))


def test_every_kustomization_is_found() -> None:
    names = {p.relative_to(K8S).as_posix() for p in KUSTOMIZATIONS}
    assert names == {"base", "overlays/reference", "overlays/vllm", "overlays/envoy"}


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
    assert c["args"][:2] == [COMMAND.get(path.relative_to(K8S).as_posix(), "serve"), "--config"]
    if c["args"][0] == "extproc":
        assert (config.extproc.host, config.extproc.port) == ("0.0.0.0", ports["grpc"])
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


ENVOY = K8S / "overlays" / "envoy"


def _endpoint(cluster: Obj) -> tuple[str, int]:
    (group,) = cluster["load_assignment"]["endpoints"]
    (lb,) = group["lb_endpoints"]
    address = lb["endpoint"]["address"]["socket_address"]
    return address["address"], address["port_value"]


def _without_endpoint(cluster: Obj) -> Obj:
    cluster = yaml.safe_load(yaml.safe_dump(cluster))
    cluster["name"] = cluster["load_assignment"]["cluster_name"] = "-"
    cluster["load_assignment"]["endpoints"] = []
    return cluster


def test_the_envoy_overlays_envoy_config_is_the_shipped_one_at_this_overlays_addresses() -> None:
    objs = render(ENVOY)
    overlay = yaml.safe_load(mounted_config_map(objs, "envoy", "config")["data"]["envoy.yaml"])
    shipped = yaml.safe_load((ROOT / "deploy" / "envoy" / "envoy.yaml").read_text())
    config = gateway_config(objs)
    listeners = {x["name"]: x for x in overlay["static_resources"]["listeners"]}
    assert set(listeners) == {"api", "ready"}
    # The API listener as shipped (filters, ext_proc modes and timeouts, routes), its fallback route
    # (tokengate unreachable, failure_mode_allow) to one of this overlay's pools.
    api = listeners["api"]
    routes = api["filter_chains"][0]["filters"][0]["typed_config"]["route_config"]["virtual_hosts"][0][
        "routes"
    ]
    assert routes[-1]["route"]["cluster"] in {p.name for p in config.pools}
    (shipped_api,) = shipped["static_resources"]["listeners"]
    shipped_routes = shipped_api["filter_chains"][0]["filters"][0]["typed_config"]["route_config"]
    shipped_routes["virtual_hosts"][0]["routes"][-1]["route"]["cluster"] = routes[-1]["route"]["cluster"]
    assert api == shipped_api
    assert overlay["admin"] == shipped["admin"]
    # One cluster per pool, named as the pool, at the pool's backend; each set as the shipped ones.
    clusters = {c["name"]: c for c in overlay["static_resources"]["clusters"]}
    shipped_clusters = {c["name"]: c for c in shipped["static_resources"]["clusters"]}
    assert set(clusters) == {"tokengate"} | {p.name for p in config.pools}
    for pool in config.pools:
        (backend,) = pool.backends
        url = urlparse(backend.url)
        assert _endpoint(clusters[pool.name]) == (url.hostname, url.port)
        assert _without_endpoint(clusters[pool.name]) == _without_endpoint(shipped_clusters["chat"])
    assert _without_endpoint(clusters["tokengate"]) == _without_endpoint(shipped_clusters["tokengate"])
    # ext_proc's longest wait is the one tokengate extends to.
    hcm = api["filter_chains"][0]["filters"][0]["typed_config"]
    ext = next(f for f in hcm["http_filters"] if f["name"] == "envoy.filters.http.ext_proc")
    assert ext["typed_config"]["max_message_timeout"] == f"{config.extproc.max_message_timeout_s:g}s"
    assert ext["typed_config"]["failure_mode_allow"] is False


def test_the_envoy_overlay_wires_envoy_to_every_ready_gateway_pod_and_clients_to_envoy() -> None:
    objs = render(ENVOY)
    overlay = yaml.safe_load(mounted_config_map(objs, "envoy", "config")["data"]["envoy.yaml"])
    config = gateway_config(objs)
    clusters = {c["name"]: c for c in overlay["static_resources"]["clusters"]}
    listeners = {x["name"]: x for x in overlay["static_resources"]["listeners"]}
    # Envoy reaches the processor through a headless Service: DNS names every ready gateway pod.
    host, port = _endpoint(clusters["tokengate"])
    assert clusters["tokengate"]["type"] == "STRICT_DNS"
    svc = one(objs, "Service", host)
    assert svc["spec"]["clusterIP"] == "None"
    (svc_port,) = svc["spec"]["ports"]
    assert svc_port["port"] == port
    gateway = one(objs, "Deployment", "tokengate")["spec"]["template"]
    assert svc["spec"]["selector"].items() <= gateway["metadata"]["labels"].items()
    gateway_ports = {p["name"]: p["containerPort"] for p in gateway["spec"]["containers"][0]["ports"]}
    assert gateway_ports[svc_port["targetPort"]] == config.extproc.port
    # Envoy's pod: its config mounted where -c reads it, its ports the listeners', probes on the
    # readiness listener, a grace period longer than its preStop pause; the Service to its API.
    envoy = one(objs, "Deployment", "envoy")["spec"]["template"]
    (c,) = envoy["spec"]["containers"]
    path = Path(c["args"][c["args"].index("-c") + 1])
    mounts = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
    assert path.parent.as_posix() == mounts["config"] and path.name == "envoy.yaml"
    envoy_ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert envoy_ports["http"] == listeners["api"]["address"]["socket_address"]["port_value"]
    assert envoy_ports["ready"] == listeners["ready"]["address"]["socket_address"]["port_value"]
    assert (
        c["readinessProbe"]["httpGet"] == c["livenessProbe"]["httpGet"] == {"path": "/ready", "port": "ready"}
    )
    assert envoy["spec"]["terminationGracePeriodSeconds"] > c["lifecycle"]["preStop"]["sleep"]["seconds"]
    front = one(objs, "Service", "envoy")
    assert front["spec"]["selector"].items() <= envoy["metadata"]["labels"].items()
    assert [p["targetPort"] for p in front["spec"]["ports"]] == ["http"]
    assert one(objs, "PodDisruptionBudget", "envoy")["spec"]["selector"]["matchLabels"].items() <= (
        envoy["metadata"]["labels"].items()
    )

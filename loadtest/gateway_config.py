"""Builds a tokengate config file for a scenario target: its gateway section, backend URLs, the tenants."""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from typing import Any

from loadtest.distributions import SpecError
from loadtest.spec import WorkloadSpec


def deep_merge(base: Mapping[str, Any], override: Mapping[str, Any]) -> dict[str, Any]:
    """Mappings merge key by key; anything else in ``override`` replaces what ``base`` had."""
    out: dict[str, Any] = copy.deepcopy(dict(base))
    for key, value in override.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def tenant_entries(workload: WorkloadSpec) -> dict[str, dict[str, Any]]:
    """The workload's tenants in the gateway's tenant format (keys, weight, tier + their 'gateway' extras)."""
    out: dict[str, dict[str, Any]] = {}
    for name, t in workload.tenants.items():
        entry: dict[str, Any] = {"keys": list(t.keys), "weight": t.weight}
        if t.tier is not None:
            entry["tier"] = t.tier
        out[name] = deep_merge(entry, t.gateway)
    return out


def _resolve_backends(pools: Mapping[str, Any], backend_urls: Sequence[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for pool_name, pool in pools.items():
        pool = dict(pool)
        backends = []
        for i, b in enumerate(pool.get("backends", [])):
            b = dict(b)
            if "backend" in b:
                index = b.pop("backend")
                if not isinstance(index, int) or not 0 <= index < len(backend_urls):
                    raise SpecError(f"pools.{pool_name}.backends[{i}].backend: no backend {index!r}")
                b["url"] = backend_urls[index]
            backends.append(b)
        pool["backends"] = backends
        out[pool_name] = pool
    return out


def gateway_config(
    workload: WorkloadSpec,
    base: Mapping[str, Any],
    target: Mapping[str, Any],
    backend_urls: Sequence[str],
    port: int,
) -> dict[str, Any]:
    merged = deep_merge(base, target)
    tenant_overrides = merged.pop("tenants", {}) or {}
    config: dict[str, Any] = {"listen": {"host": "127.0.0.1", "port": port}, "store": {"kind": "memory"}}
    config = deep_merge(config, merged)
    config["listen"] = {"host": "127.0.0.1", "port": port}
    config.setdefault("ops", {"port": 0})  # spawned gateways side by side: each its own ops port
    config["tenants"] = deep_merge(tenant_entries(workload), tenant_overrides)
    if "pools" in config:
        config["pools"] = _resolve_backends(config["pools"], backend_urls)
    return config

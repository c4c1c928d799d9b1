"""deploy/k8s rendered as ``kubectl kustomize`` renders it, and the gateway's config as a pod of it
reads it at start (the ConfigMap's template filled by the image's renderer)."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
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


def mounted_config_map(objs: list[Obj], deployment: str, volume: str) -> Obj:
    """The ConfigMap a Deployment mounts as ``volume`` (generated names carry a hash)."""
    pod = one(objs, "Deployment", deployment)["spec"]["template"]["spec"]
    found = next(v for v in pod["volumes"] if v["name"] == volume)
    return one(objs, "ConfigMap", found["configMap"]["name"])


def gateway_raw_config(objs: list[Obj], redis_url: str = "redis://redis.example:6379/0") -> dict[str, Any]:
    """The gateway Deployment's config.yaml as its container renders it at start: environment from
    the pod spec (secrets as placeholders), the Redis URL given."""
    pod = one(objs, "Deployment", "tokengate")["spec"]["template"]["spec"]
    cm = mounted_config_map(objs, "tokengate", "config")
    spec = importlib.util.spec_from_file_location("render_config", ROOT / "deploy/docker/render_config.py")
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    env = {e["name"]: e.get("value", f"from-secret-{e['name'].lower()}") for e in pod["containers"][0]["env"]}
    env["TOKENGATE_REDIS_URL"] = redis_url
    raw = yaml.safe_load(mod.render(cm["data"]["config.yaml"], env))
    assert isinstance(raw, dict)
    return raw

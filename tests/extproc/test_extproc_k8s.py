"""The Kubernetes overlay for Envoy (deploy/k8s/overlays/envoy) as it renders, run: its Envoy
config and its gateway config, addresses moved to this test's processes (a real Envoy, tokengate's
external processor on a real Redis, a stub backend per pool), route each class to its pool; the
kubelet's probe listener answers 200 and 503 once Envoy fails its health checks."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest
import yaml

from loadtest.processes import free_port
from tests.budgets.redis_fixtures import RedisServer
from tests.deploy.kustomize import K8S, gateway_raw_config, mounted_config_map, render
from tests.extproc.support import envoy_for, in_process, running_envoy, stub_backends

pytestmark = pytest.mark.slow


def chat(words: int) -> dict[str, Any]:
    content = " ".join(["tokens"] * words)
    return {"model": "tokengate-sim", "messages": [{"role": "user", "content": content}], "max_tokens": 8}


async def test_the_envoy_overlay_routes_each_class_to_its_pool_and_reports_ready(
    tmp_path: Path, fresh_redis: RedisServer
) -> None:
    objs = render(K8S / "overlays" / "envoy")
    shipped_envoy = yaml.safe_load(mounted_config_map(objs, "envoy", "config")["data"]["envoy.yaml"])
    raw = gateway_raw_config(objs, redis_url=fresh_redis.url)
    async with stub_backends(raw["pools"]) as backends:
        for name, pool in raw["pools"].items():
            (backend,) = pool["backends"]
            backend["url"] = backends[name][1].url
        raw["extproc"] = {**raw["extproc"], "host": "127.0.0.1", "port": free_port()}
        raw["ops"] = {"port": None}
        async with in_process(raw) as processor:
            config = envoy_for(processor, backends, base=shipped_envoy)
            ready = next(x for x in config["static_resources"]["listeners"] if x["name"] == "ready")
            ready_url = f"http://127.0.0.1:{ready['address']['socket_address']['port_value']}/ready"
            async with running_envoy(config, tmp_path) as envoy, aiohttp.ClientSession() as http:
                key = {"Authorization": "Bearer sk-acme-demo"}
                url = envoy.url + "/v1/chat/completions"
                for words, cls, pool in ((20, "short", "short"), (9000, "reasoning", "long")):
                    async with http.post(url, data=orjson.dumps(chat(words)), headers=key) as r:
                        assert r.status == 200, await r.text()
                        assert r.headers["x-tokengate-class"] == cls
                    (seen,) = backends[pool][0].requests
                    assert seen.headers["x-tokengate-pool"] == pool
                    assert seen.headers["x-llm-d-inference-fairness-id"] == "acme"
                    assert seen.headers["x-llm-d-inference-objective"] == "critical"
                async with http.get(ready_url) as r:
                    assert r.status == 200
                admin = f"http://127.0.0.1:{config['admin']['address']['socket_address']['port_value']}"
                async with http.post(admin + "/healthcheck/fail") as r:
                    assert r.status == 200
                async with http.get(ready_url) as r:
                    assert r.status == 503

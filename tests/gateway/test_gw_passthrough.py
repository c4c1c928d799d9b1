"""Pass-through is an allowlist: only routes named in passthrough.routes are forwarded, each priced
from its body; everything else under /v1 is a 404 that names the setting."""

from __future__ import annotations

import httpx
import pytest

from gateway.config.loader import ConfigError, parse_config
from tests.conftest import GatewayFactory, StubBackend, stub_pools


def routes_config(url: str, routes: list[dict[str, object]] | None = None) -> dict[str, object]:
    config: dict[str, object] = {"pools": stub_pools(url), "drain_timeout_s": 1}
    if routes is not None:
        config["passthrough"] = {"routes": routes}
    return config


async def test_unlisted_routes_are_404_and_never_forwarded(
    stub_backend: tuple[StubBackend, str], gateway_factory: GatewayFactory
) -> None:
    stub, url = stub_backend
    gw = await gateway_factory(routes_config(url))
    async with httpx.AsyncClient(base_url=gw.url) as c:
        for method, path in [
            ("PUT", "/v1/fine_tuning/jobs"),
            ("POST", "/v1/rerank"),
            ("GET", "/v1/files"),
            ("DELETE", "/v1/files/x"),
        ]:
            r = await c.request(method, path, json={"model": "stub-model"} if method != "GET" else None)
            assert r.status_code == 404, (method, path)
            err = r.json()["error"]
            assert err["code"] == "unknown_route" and "passthrough.routes" in err["message"]
    assert stub.requests == []


async def test_by_default_nothing_is_forwarded_and_a_model_is_retrieved_from_the_gateway(
    stub_backend: tuple[StubBackend, str], gateway_factory: GatewayFactory
) -> None:
    stub, url = stub_backend
    gw = await gateway_factory(routes_config(url))
    async with httpx.AsyncClient(base_url=gw.url) as c:
        r = await c.get("/v1/models/stub-model")
        assert r.status_code == 200 and r.json() == {
            "id": "stub-model",
            "object": "model",
            "created": 0,
            "owned_by": "tokengate",
        }
        r = await c.get("/v1/files/file-1")
        assert r.status_code == 404 and r.json()["error"]["code"] == "unknown_route"
    assert stub.requests == []


async def test_an_allowed_post_is_priced_from_its_body_not_a_constant(
    stub_backend: tuple[StubBackend, str], gateway_factory: GatewayFactory
) -> None:
    _, url = stub_backend
    gw = await gateway_factory(
        routes_config(
            url,
            [
                {"method": "POST", "path": "/v1/rerank", "generates": False},
                {"method": "PUT", "path": "/v1/fine_tuning/*"},
            ],
        )
    )
    async with httpx.AsyncClient(base_url=gw.url) as c:
        small = await c.post("/v1/rerank", json={"model": "stub-model", "query": "q", "documents": ["a"]})
        big = await c.post(
            "/v1/rerank", json={"model": "stub-model", "query": "q", "documents": ["word " * 5000]}
        )
        assert small.status_code == big.status_code == 200
        assert int(small.headers["x-tokengate-cost"]) > 0
        assert int(big.headers["x-tokengate-cost"]) >= 5000  # tokens of the body, no output reserved
        r = await c.put("/v1/fine_tuning/jobs?limit=2", json={"model": "stub-model", "max_tokens": 300})
        assert r.status_code == 200
        assert r.json() == {
            "echo": "/v1/fine_tuning/jobs",
            "method": "PUT",
            "body": {"model": "stub-model", "max_tokens": 300},
        }
        assert int(r.headers["x-tokengate-cost"]) >= 300  # the output limit the body names is reserved
        generated = await c.put("/v1/fine_tuning/x", json={"model": "stub-model"})
        assert int(generated.headers["x-tokengate-cost"]) >= 1024  # generates: the default reservation
    assert await gw.wait_idle() == {name: 0 for name in await gw.in_flight()}


def test_passthrough_config_errors_name_the_field() -> None:
    base = {"pools": stub_pools("http://127.0.0.1:1")}
    cases = [
        ({"routes": [{"method": "GET"}]}, "passthrough.routes[0].path: required"),
        ({"routes": [{"method": "FETCH", "path": "/v1/x"}]}, "passthrough.routes[0].method"),
        ({"routes": [{"method": "GET", "path": "/admin/x"}]}, "must start with /v1/"),
        ({"routes": [{"method": "POST", "path": "/v1/chat/completions"}]}, "priced route"),
        ({"routes": [{"method": "GET", "path": "/v1/../x"}]}, "not a valid path"),
        ({"routes": "all"}, "passthrough.routes: expected a list"),
    ]
    for section, message in cases:
        with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]")):
            parse_config({**base, "passthrough": section})
    with pytest.raises(ConfigError, match="passthrough_cost_tokens: removed"):
        parse_config({**base, "limits": {"passthrough_cost_tokens": 16}})

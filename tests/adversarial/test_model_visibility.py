"""A tenant sees, and reaches, only the models it may use.

Model names are tenants' secrets often enough: a customer's fine-tune or LoRA adapter is named for
the customer. A tenant with ``models`` globs is shown only the served models they match, on
``GET /v1/models`` and ``GET /v1/models/{id}``; any other model is the same 404 whether another
tenant may use it or nobody serves it; and no pass-through route runs a model outside its globs.
Over real sockets, against a stub backend that serves three models."""

from __future__ import annotations

from typing import Any

import httpx

from tests.conftest import GatewayFactory, StubBackend

MODELS = ["stub-model", "acme-ft-v3", "globex-ft-v1"]


def config(url: str) -> dict[str, Any]:
    return {
        "pools": {"default": {"backends": [{"url": url, "capacity_tokens": 100_000, "models": MODELS}]}},
        "tenants": {
            "acme": {"keys": ["ka"], "budget_tokens": 20_000, "models": ["stub-model", "acme-*"]},
            "globex": {"keys": ["kg"], "budget_tokens": 20_000, "models": ["stub-model", "globex-*"]},
            "ops": {"keys": ["ko"]},  # no globs: every served model
        },
        "passthrough": {"routes": [{"method": "POST", "path": "/v1/rerank", "generates": False}]},
    }


def key(k: str) -> dict[str, str]:
    return {"authorization": f"Bearer {k}"}


def chat(model: str) -> dict[str, Any]:
    return {"model": model, "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]}


async def test_each_tenant_lists_and_retrieves_only_its_own_models(
    stub_backend: tuple[StubBackend, str], gateway_factory: GatewayFactory
) -> None:
    _, url = stub_backend
    gw = await gateway_factory(config(url))
    async with httpx.AsyncClient(base_url=gw.url) as c:
        for k, seen in (
            ("ka", ["stub-model", "acme-ft-v3"]),
            ("kg", ["stub-model", "globex-ft-v1"]),
            ("ko", MODELS),
        ):
            listed = await c.get("/v1/models", headers=key(k))
            assert [m["id"] for m in listed.json()["data"]] == seen, k
            for m in seen:
                one = await c.get(f"/v1/models/{m}", headers=key(k))
                assert one.status_code == 200 and one.json()["id"] == m
        theirs = await c.get("/v1/models/globex-ft-v1", headers=key("ka"))
        nobody = await c.get("/v1/models/initech-ft-v9", headers=key("ka"))
        for r in (theirs, nobody):
            assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
        # The two answers differ only by the name asked for: nothing tells "another's" from "none".
        assert theirs.json()["error"]["message"].replace("globex-ft-v1", "X") == nobody.json()["error"][
            "message"
        ].replace("initech-ft-v9", "X")
        assert "globex" not in nobody.text
        assert (await c.post("/v1/models/acme-ft-v3", headers=key("ka"))).status_code == 405
        assert (await c.get("/v1/models", headers=key("wrong"))).status_code == 401


async def test_another_tenants_model_is_the_same_404_as_one_nobody_serves_and_never_runs(
    stub_backend: tuple[StubBackend, str], gateway_factory: GatewayFactory
) -> None:
    stub, url = stub_backend
    gw = await gateway_factory(config(url))
    async with httpx.AsyncClient(base_url=gw.url) as c:
        theirs = await c.post("/v1/chat/completions", json=chat("globex-ft-v1"), headers=key("ka"))
        nobody = await c.post("/v1/chat/completions", json=chat("initech-ft-v9"), headers=key("ka"))
        for r in (theirs, nobody):
            assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found", r.text
            assert "globex" not in r.json()["error"]["message"].replace("globex-ft-v1", "")
            assert "acme-ft-v3" in r.json()["error"]["message"]  # what it may use instead
        # A pass-through route runs only the tenant's models too.
        rerank = {"query": "q", "documents": ["a"]}
        r = await c.post("/v1/rerank", json={"model": "globex-ft-v1", **rerank}, headers=key("ka"))
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found", r.text
        assert stub.requests == []
        assert (
            await c.post("/v1/chat/completions", json=chat("acme-ft-v3"), headers=key("ka"))
        ).status_code == 200
        r = await c.post("/v1/rerank", json={"model": "acme-ft-v3", **rerank}, headers=key("ka"))
        assert r.status_code == 200
        r = await c.post("/v1/rerank", json={"model": "globex-ft-v1", **rerank}, headers=key("ko"))
        assert r.status_code == 200
    assert [req.body["model"] for req in stub.requests] == ["acme-ft-v3", "acme-ft-v3", "globex-ft-v1"]
    assert await gw.wait_idle() == {name: 0 for name in await gw.in_flight()}

"""The official openai SDK as the client, through the gateway, in front of the stub backend and
in front of the simulated reference backend."""

from __future__ import annotations

from collections.abc import AsyncIterator

import openai
import pytest

from backends.reference.server import BackendSettings, build_app
from tests.conftest import GatewayFactory, StubBackend, serve_asgi, stub_pools


def client(url: str, key: str = "sk-test") -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=30)


async def test_sdk_against_stub(
    stub_backend: tuple[StubBackend, str], gateway_factory: GatewayFactory
) -> None:
    _, url = stub_backend
    gateway = await gateway_factory({"pools": stub_pools(url, models=["stub-model"])})
    c = client(gateway.url)
    r = await c.chat.completions.create(
        model="stub-model", messages=[{"role": "user", "content": "hi"}], max_tokens=3
    )
    assert r.choices[0].message.content == "tok0 tok1 tok2 "
    assert r.usage is not None and r.usage.completion_tokens == 3
    stream = await c.chat.completions.create(
        model="stub-model", messages=[{"role": "user", "content": "hi"}], stream=True, max_tokens=3
    )
    chunks = [ch async for ch in stream]
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == "tok0 tok1 tok2 "
    assert all(ch.choices for ch in chunks)  # the usage chunk the client didn't ask for is gone
    stream = await c.chat.completions.create(
        model="stub-model",
        messages=[{"role": "user", "content": "hi"}],
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = [ch async for ch in stream]
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 3
    models = await c.models.list()
    assert [m.id for m in models.data] == ["stub-model"]
    with pytest.raises(openai.NotFoundError):
        await c.chat.completions.create(model="nope", messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(openai.BadRequestError):
        await c.chat.completions.create(model="stub-model", messages=[], max_tokens=-1)
    await c.close()
    assert await gateway.wait_idle() == {"tenant:default": 0, "backend:default": 0}


async def test_sdk_auth_errors(
    stub_backend: tuple[StubBackend, str], gateway_factory: GatewayFactory
) -> None:
    _, url = stub_backend
    gw = await gateway_factory({"pools": stub_pools(url), "tenants": {"t": {"keys": ["good"]}}})
    with pytest.raises(openai.AuthenticationError):
        await client(gw.url, "bad").chat.completions.create(
            model="stub-model", messages=[{"role": "user", "content": "x"}]
        )
    r = await client(gw.url, "good").completions.create(model="stub-model", prompt="hi", max_tokens=2)
    assert r.choices[0].text


@pytest.fixture
async def reference() -> AsyncIterator[str]:
    served = await serve_asgi(build_app(BackendSettings(time_scale=0.0, num_blocks=2048)))
    try:
        yield served.url
    finally:
        await served.stop()


async def test_sdk_against_reference_backend(reference: str, gateway_factory: GatewayFactory) -> None:
    gw = await gateway_factory(
        {"pools": stub_pools(reference, capacity=32768), "tenants": {"t": {"keys": ["k"]}}}
    )
    c = client(gw.url, "k")
    messages = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "hello there, how are you?"},
    ]
    r = await c.chat.completions.create(model="tokengate-sim", messages=messages, max_tokens=8)
    assert r.usage is not None and r.usage.completion_tokens == 8
    stream = await c.chat.completions.create(
        model="tokengate-sim", messages=messages, max_tokens=8, stream=True
    )
    text = "".join([ch.choices[0].delta.content or "" async for ch in stream if ch.choices])
    assert text == r.choices[0].message.content  # deterministic sim tokens
    r2 = await c.completions.create(model="tokengate-sim", prompt="once upon a time", max_tokens=4)
    assert r2.usage is not None and r2.usage.completion_tokens == 4
    await c.close()
    snap = await gw.store.snapshot()
    assert all(p.in_flight == 0 for p in snap.pools.values())
    # Gateway pricing and the reference backend agree on prompt tokens (same tokenizer/template).
    metrics = (await gw.app.store.snapshot()).virtual_service
    assert metrics["t"] > 0

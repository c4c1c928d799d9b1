"""tokengate as Envoy's external processor, with a real Envoy (deploy/envoy/envoy.yaml) in front of
stub backends, the processor in the test's loop: admission, routing, refusals, queueing past
Envoy's message timeout, streams, and every way a request can end releasing its tokens once."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import httpx
import orjson
import pytest

from gateway.observe.accesslog import Record
from tests.budgets.support import assert_idle
from tests.conftest import StubBackend
from tests.extproc.support import Envoy, Processor, envoy_for, in_process, running_envoy, stub_backends
from tests.support import eventually

pytestmark = pytest.mark.slow


@dataclass
class Stack:
    envoy: Envoy
    processor: Processor
    stubs: dict[str, StubBackend]
    records: list[Record]  # the access records of the requests that ended

    @property
    def url(self) -> str:
        return self.envoy.url + "/v1/chat/completions"

    @property
    def store(self) -> Any:
        return self.processor.gateway.store


def chat(content: str = "hello", **extra: Any) -> dict[str, Any]:
    return {
        "model": "stub-model",
        "messages": [{"role": "user", "content": content}],
        "max_tokens": 5,
        **extra,
    }


def key(name: str) -> dict[str, str]:
    return {"Authorization": f"Bearer sk-{name}"}


@contextlib.asynccontextmanager
async def stack(
    tmp_path: Path, raw: dict[str, Any], pools: tuple[str, ...] = ("chat",), capacity: int = 10_000
) -> AsyncIterator[Stack]:
    async with stub_backends(pools) as backends:
        raw = {
            "pools": {
                name: {"backends": [{"url": s.url, "capacity_tokens": capacity}]}
                for name, (_, s) in backends.items()
            },
            **raw,
        }
        async with in_process(raw) as processor:
            config = envoy_for(processor, backends)
            records: list[Record] = []
            processor.gateway.request_hooks.append(lambda rec, _end: records.append(rec))
            async with running_envoy(config, tmp_path) as envoy:
                yield Stack(envoy, processor, {name: stub for name, (stub, _) in backends.items()}, records)


async def settled(s: Stack) -> None:
    """Every lease released and every pool back at zero. The client has the answer's last bytes
    when Envoy has the processor's answer to them, a moment before the release: waited for."""

    async def idle() -> bool:
        snap = await s.store.snapshot()
        return snap.leases == 0 and not any(p.in_flight for p in snap.pools.values())

    with contextlib.suppress(AssertionError):
        await eventually(idle, timeout_s=5)
    await assert_idle(s.store)


TENANTS = {"a": {"keys": ["sk-a"], "budget_tokens": 5000}, "b": {"keys": ["sk-b"], "budget_tokens": 5000}}


async def test_admitted_request_goes_to_its_pool_with_the_gateways_headers_and_body(tmp_path: Path) -> None:
    async with stack(tmp_path, {"tenants": TENANTS}) as s, aiohttp.ClientSession() as http:
        headers = {
            **key("a"),
            "x-tokengate-pool": "elsewhere",  # a client never picks the pool
            "x-llm-d-inference-fairness-id": "b",  # nor whose queue it waits in
            "x-gateway-destination-endpoint": "10.0.0.9:8000",  # nor the endpoint (private headers)
            "x-custom": "kept",
        }
        async with http.post(s.url, data=orjson.dumps(chat()), headers=headers) as r:
            assert r.status == 200, await r.text()
            answer = await r.json()
            assert r.headers["x-tokengate-class"] == "default"
            assert int(r.headers["x-tokengate-cost"]) > 0
            request_id = r.headers["x-request-id"]
        assert answer["usage"]["completion_tokens"] == 3
        (seen,) = s.stubs["chat"].requests
        assert seen.headers["x-tokengate-pool"] == "chat"
        assert seen.headers["x-llm-d-inference-fairness-id"] == "a"
        assert seen.headers["x-llm-d-inference-objective"] == "standard"
        assert seen.headers["x-custom"] == "kept"
        assert seen.headers["x-request-id"] == request_id
        assert "authorization" not in seen.headers  # the tenant's key never reaches a backend
        assert "x-gateway-destination-endpoint" not in seen.headers
        # The body as the proxy sends it: priced, with the output limit it was priced at.
        assert seen.body == chat()
        assert int(seen.headers["content-length"]) == len(seen.raw)
        await settled(s)


async def test_refusals_are_envoys_immediate_answers_in_openais_shape(tmp_path: Path) -> None:
    tenants = {"a": {"keys": ["sk-a"], "budget_tokens": 100}}
    async with stack(tmp_path, {"tenants": tenants}) as s, aiohttp.ClientSession() as http:
        async with http.post(s.url, data=orjson.dumps(chat()), headers=key("nobody")) as r:
            assert r.status == 401
            assert (await r.json())["error"]["code"] == "invalid_api_key"
            assert r.headers["content-type"] == "application/json"
        big = chat(max_tokens=5000)  # more than the tenant's whole budget
        async with http.post(s.url, data=orjson.dumps(big), headers=key("a")) as r:
            body = await r.json()
            assert r.status == 413, body
            assert "budget" in body["error"]["message"]
        async with http.post(s.url, data=b"{not json", headers=key("a")) as r:
            assert r.status == 400
            assert (await r.json())["error"]["code"] == "invalid_json"
        async with http.get(s.envoy.url + "/v1/models", headers=key("a")) as r:
            assert r.status == 200  # answered by the gateway itself
            assert [m["id"] for m in (await r.json())["data"]] == ["stub-model"]
        assert s.stubs["chat"].requests == []  # nothing refused reached the backend
        await settled(s)


async def test_classes_route_to_their_pools(tmp_path: Path) -> None:
    raw = {
        "tenants": TENANTS,
        "classes": [
            {"name": "long", "when": {"min_prompt_tokens": 200}, "pool": "batch"},
            {"name": "short", "pool": "chat"},
        ],
    }
    async with stack(tmp_path, raw, pools=("chat", "batch")) as s, aiohttp.ClientSession() as http:
        async with http.post(s.url, data=orjson.dumps(chat("hi")), headers=key("a")) as r:
            assert r.status == 200
            assert r.headers["x-tokengate-class"] == "short"
        async with http.post(s.url, data=orjson.dumps(chat("word " * 400)), headers=key("a")) as r:
            assert r.status == 200
            assert r.headers["x-tokengate-class"] == "long"
        assert len(s.stubs["chat"].requests) == 1
        assert len(s.stubs["batch"].requests) == 1
        assert s.stubs["batch"].requests[0].headers["x-tokengate-pool"] == "batch"
        await settled(s)


async def test_stream_usage_is_read_and_cut_out_where_the_client_did_not_ask(tmp_path: Path) -> None:
    async with stack(tmp_path, {"tenants": TENANTS}) as s, aiohttp.ClientSession() as http:
        async with http.post(s.url, data=orjson.dumps(chat(stream=True)), headers=key("a")) as r:
            assert r.status == 200
            text = await r.text()
        assert '"usage"' not in text  # the event the gateway asked for is not the client's
        assert text.rstrip().endswith("data: [DONE]")
        assert s.stubs["chat"].requests[0].body["stream_options"] == {"include_usage": True}
        wants = chat(stream=True, stream_options={"include_usage": True})
        async with http.post(s.url, data=orjson.dumps(wants), headers=key("a")) as r:
            text = await r.text()
        assert '"completion_tokens":3' in text.replace(" ", "")
        await settled(s)
        # Both streams' usage was the engine's count, not an estimate; read as they went by.
        assert [(r.status, r.completion_tokens, r.usage_estimated) for r in s.records] == [
            (200, 3, False)
        ] * 2
        assert all(r.ttft_s is not None and r.stream for r in s.records)


async def test_a_request_queues_past_envoys_message_timeout_and_then_runs(tmp_path: Path) -> None:
    """The budget holds one request at a time; the second waits ~1.5 s, longer than Envoy's 1 s
    message timeout, which the processor extends while it queues."""
    tenants = {"a": {"keys": ["sk-a"], "budget_tokens": 40}}
    async with stack(tmp_path, {"tenants": tenants}) as s, aiohttp.ClientSession() as http:
        slow = {**key("a"), "x-stub-delay": "1.5"}

        async def one(headers: dict[str, str]) -> tuple[int, float]:
            async with http.post(s.url, data=orjson.dumps(chat(max_tokens=20)), headers=headers) as r:
                await r.read()
                return r.status, float(r.headers.get("x-tokengate-queue-ms", "0"))

        first = asyncio.create_task(one(slow))
        await eventually(lambda: len(s.stubs["chat"].requests) == 1, timeout_s=5)
        second = await one(key("a"))
        assert await first == (200, pytest.approx(0.0, abs=50))
        status, queued_ms = second
        assert status == 200
        assert queued_ms > 1000  # it waited for the first, beyond Envoy's message timeout
        await settled(s)


async def test_the_lease_heartbeats_while_envoys_stream_lives(tmp_path: Path) -> None:
    """A stream through Envoy outlives the lease TTL several times over: the processor's heartbeat
    keeps the lease (expired leases reaped meanwhile), and the stream's end releases it."""
    async with stack(tmp_path, {"tenants": TENANTS, "leases": {"ttl_s": 0.3}}) as s:
        async with aiohttp.ClientSession() as http:
            headers = {**key("a"), "x-stub-chunks": "100", "x-stub-interval": "0.01"}
            async with http.post(
                s.url, data=orjson.dumps(chat(stream=True, max_tokens=120)), headers=headers
            ) as r:
                assert r.status == 200
                await r.content.readuntil(b"tok2 ")
                await asyncio.sleep(0.8)  # well past the TTL: only heartbeats keep the lease
                await s.store.reap_expired()
                snap = await s.store.snapshot()
                assert snap.leases == 1 and snap.pools["tenant:a"].in_flight > 0
                text = (await r.read()).decode()
        assert text.rstrip().endswith("data: [DONE]")
        await settled(s)
        await eventually(lambda: len(s.records) == 1, timeout_s=5)
        assert s.records[0].status == 200 and s.records[0].completion_tokens == 100


async def test_client_gone_mid_stream_releases_once_and_cancels_upstream(tmp_path: Path) -> None:
    """Envoy closes the processor's stream when its client goes: the request is a 499, its lease
    released once, and Envoy cancels the upstream call."""
    async with stack(tmp_path, {"tenants": TENANTS}) as s:
        headers = {**key("a"), "x-stub-chunks": "50", "x-stub-interval": "0.05"}
        reader, writer = await asyncio.open_connection("127.0.0.1", s.envoy.port)
        body = orjson.dumps(chat(stream=True, max_tokens=60))
        head = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
        writer.write(
            f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n{head}"
            f"Content-Length: {len(body)}\r\n\r\n".encode()
            + body
        )
        await writer.drain()
        seen = await reader.readuntil(b"tok2 ")  # the stream is under way
        assert b"200" in seen.split(b"\r\n", 1)[0]
        assert (await s.store.snapshot()).pools["tenant:a"].in_flight > 0
        writer.close()
        await eventually(lambda: s.stubs["chat"].requests[0].cancelled_at is not None, timeout_s=5)
        await settled(s)
        await eventually(lambda: len(s.records) == 1, timeout_s=5)
        assert (s.records[0].status, s.records[0].outcome) == (499, "client_disconnect")


async def test_envoy_killed_mid_stream_releases_and_a_restarted_envoy_is_served(tmp_path: Path) -> None:
    async with stack(tmp_path, {"tenants": TENANTS}) as s, aiohttp.ClientSession() as http:
        headers = {**key("a"), "x-stub-chunks": "100", "x-stub-interval": "0.05"}

        async def long_stream() -> None:
            with contextlib.suppress(aiohttp.ClientError):
                async with http.post(
                    s.url, data=orjson.dumps(chat(stream=True, max_tokens=120)), headers=headers
                ) as r:
                    async for _ in r.content:
                        pass

        streams = [asyncio.create_task(long_stream()) for _ in range(3)]
        await eventually(lambda: len(s.stubs["chat"].requests) == 3, timeout_s=5)
        assert (await s.store.snapshot()).leases == 3
        await s.envoy.stop(kill=True)
        await asyncio.gather(*streams)
        await settled(s)
        await s.envoy.start()
        async with http.post(s.url, data=orjson.dumps(chat()), headers=key("a")) as r:
            assert r.status == 200
        await settled(s)


async def test_a_backend_failure_is_the_gateways_502_without_the_backends_words(tmp_path: Path) -> None:
    async with stack(tmp_path, {"tenants": TENANTS}) as s, aiohttp.ClientSession() as http:
        headers = {**key("a"), "x-stub-status": "500"}
        async with http.post(s.url, data=orjson.dumps(chat()), headers=headers) as r:
            assert r.status == 502
            body = await r.json()
        assert body["error"]["code"] == "upstream_error"
        assert "stub error" not in orjson.dumps(body).decode()
        headers = {**key("a"), "x-stub-status": "404"}
        async with http.post(s.url, data=orjson.dumps(chat()), headers=headers) as r:
            assert r.status == 404  # a backend's 4xx is the client's to read, as through the proxy
        await settled(s)


async def test_every_api_over_http2_is_admitted_and_its_usage_read(tmp_path: Path) -> None:
    """What docs/envoy.md says is supported: chat, completions, embeddings and the Responses API,
    streamed or not, from an HTTP/2 client (h2c) as from HTTP/1.1; /v1/models is the gateway's own
    answer. Each request's usage is the backend's count, read as it went by."""
    calls: list[tuple[str, dict[str, Any], int]] = [
        ("/v1/chat/completions", chat(), 3),
        ("/v1/chat/completions", chat(stream=True), 3),
        ("/v1/completions", {"model": "stub-model", "prompt": "hi", "max_tokens": 5}, 3),
        ("/v1/completions", {"model": "stub-model", "prompt": "hi", "max_tokens": 5, "stream": True}, 3),
        ("/v1/embeddings", {"model": "stub-model", "input": "hi"}, 0),
        ("/v1/responses", {"model": "stub-model", "input": "hi", "max_output_tokens": 5}, 3),
        ("/v1/responses", {"model": "stub-model", "input": "hi", "max_output_tokens": 5, "stream": True}, 3),
    ]
    async with (
        stack(tmp_path, {"tenants": TENANTS}) as s,
        httpx.AsyncClient(http1=False, http2=True, timeout=10) as h2,
    ):
        for path, body, _ in calls:
            r = await h2.post(s.envoy.url + path, json=body, headers=key("a"))
            assert (r.status_code, r.http_version) == (200, "HTTP/2"), r.text
        models = await h2.get(s.envoy.url + "/v1/models", headers=key("a"))
        assert models.status_code == 200 and models.json()["object"] == "list"
        await settled(s)
        metered = [r for r in s.records if r.path != "/v1/models"]
        assert [(r.path, r.status, r.completion_tokens or 0, r.usage_estimated) for r in metered] == [
            (path, 200, tokens, False) for path, _, tokens in calls
        ]
        assert all(r.prompt_tokens for r in metered)
        assert sum(len(stub.requests) for stub in s.stubs.values()) == len(calls)  # /v1/models: not sent on


async def test_big_prompts_are_admitted_or_refused_in_openais_shape(tmp_path: Path) -> None:
    """A prompt of megabytes goes to the processor whole (one gRPC message) and on to the backend;
    one over limits.max_body_bytes, or priced past the pool, gets the gateway's answer in OpenAI's
    shape (a body past limits.max_body_bytes once failed the gRPC stream: Envoy's empty 500). One
    past Envoy's own buffer gets Envoy's 413, in the same shape."""
    tenants = {"a": {"keys": ["sk-a"], "budget_tokens": 300_000}}
    raw = {
        "tenants": tenants,
        "limits": {"max_body_bytes": 3 << 20},
        "models": {"stub-model": {"context_length": 1_000_000}},
    }
    async with stack(tmp_path, raw, capacity=300_000) as s, aiohttp.ClientSession() as http:
        words = "lorem ipsum dolor sit amet " * 40_000  # ~1 MB, ~200k tokens
        async with http.post(s.url, data=orjson.dumps(chat(words)), headers=key("a")) as r:
            assert r.status == 200, await r.text()
        [seen] = s.stubs["chat"].requests
        assert seen.body["messages"][0]["content"] == words
        too_long = chat(words * 2 + "x" * 200_000)  # ~2.3 MB: under the body limit, past the pool
        async with http.post(s.url, data=orjson.dumps(too_long), headers=key("a")) as r:
            body = await r.json()
            assert r.status == 413 and body["error"]["type"] == "invalid_request_error", body
        too_big = chat(words * 4)  # ~4 MB: past limits.max_body_bytes
        async with http.post(s.url, data=orjson.dumps(too_big), headers=key("a")) as r:
            body = await r.json()
            assert r.status == 413, body
            assert "limits.max_body_bytes" in body["error"]["message"]
        huge = b"x" * (33 << 20)  # past Envoy's own buffer (per_connection_buffer_limit_bytes)
        async with http.post(s.url, data=huge, headers=key("a")) as r:
            body = await r.json()  # Envoy's own answer, in OpenAI's shape (its local_reply_config)
            assert (r.status, body["error"]["code"]) == (413, "request_too_large"), body
        assert len(s.stubs["chat"].requests) == 1
        await settled(s)

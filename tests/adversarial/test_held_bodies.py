"""A tenant cannot run the gateway out of memory with request bodies.

Bodies are read whole before they are priced and held until their request ends; the budget bounds
tokens, not bytes (a 4 MB inline image can cost a few hundred tokens; a body still arriving costs
nothing yet). Before, a tenant dripping a few hundred 4 MB uploads held gigabytes in a process whose
container may have 1 GiB. Over real sockets: uploads left half sent hold their Content-Length; past
the tenant's share its next request is a 429, past the process's limit anyone's is a 503, and once the
uploads finish everything held is given back."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import orjson

from tests.conftest import GatewayFactory, RunningGateway, StubBackend, eventually, stub_pools

SIZE = 50_000


def body(size: int = SIZE) -> bytes:
    """A chat request of exactly ``size`` bytes."""
    empty = {"model": "stub-model", "max_tokens": 1, "messages": [{"role": "user", "content": ""}]}
    pad = size - len(orjson.dumps(empty))
    return orjson.dumps({**empty, "messages": [{"role": "user", "content": "x" * pad}]})


def config(url: str) -> dict[str, Any]:
    return {
        "pools": stub_pools(url, capacity=1_000_000),
        "tenants": {"t": {"keys": ["kt"]}, "u": {"keys": ["ku"]}, "v": {"keys": ["kv"]}},
        "limits": {
            "max_body_bytes": 100_000,
            "max_held_body_bytes": 260_000,
            "max_held_body_bytes_per_tenant": 120_000,
        },
    }


class SlowUpload:
    """A chat request whose headers and first bytes are sent; the rest when ``finish`` is called."""

    def __init__(self, gw: RunningGateway, key: str) -> None:
        self.gw, self.key, self.raw = gw, key, body()

    async def start(self) -> None:
        host, port = self.gw.url.removeprefix("http://").split(":")
        self.reader, self.writer = await asyncio.open_connection(host, int(port))
        head = (
            f"POST /v1/chat/completions HTTP/1.1\r\nHost: gw\r\nAuthorization: Bearer {self.key}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(self.raw)}\r\n\r\n"
        )
        self.writer.write(head.encode() + self.raw[:100])
        await self.writer.drain()

    async def finish(self) -> int:
        self.writer.write(self.raw[100:])
        await self.writer.drain()
        status = int((await self.reader.readline()).split()[1])
        self.writer.close()
        return status


def held(gw: RunningGateway) -> tuple[int, dict[str, int]]:
    h = gw.app._proxy.held
    return h.total, dict(h.by_tenant)


async def test_half_sent_bodies_are_held_and_bounded_per_tenant_and_per_process(
    stub_backend: tuple[StubBackend, str], gateway_factory: GatewayFactory
) -> None:
    _, url = stub_backend
    gw = await gateway_factory(config(url))
    uploads = [SlowUpload(gw, k) for k in ("kt", "kt", "ku", "ku", "kv")]
    for i, up in enumerate(uploads):
        await up.start()
        await eventually(lambda n=i: held(gw)[0] == (n + 1) * SIZE, message="upload not held")
    assert held(gw) == (5 * SIZE, {"t": 2 * SIZE, "u": 2 * SIZE, "v": SIZE})
    async with httpx.AsyncClient() as ops:
        metrics = (await ops.get(gw.ops_url + "/metrics")).text
        stats = (await ops.get(gw.ops_url + "/stats")).json()
    assert f"tokengate_held_body_bytes {5 * SIZE}.0" in metrics
    assert stats["held_bodies"]["bytes"] == 5 * SIZE and stats["held_bodies"]["limit"] == 260_000
    # The doctor names it (96 % of the limit), and who holds most.
    [finding] = [f for f in stats["findings"] if f["topic"] == "bodies"]
    assert (
        finding["level"] == "warn"
        and "250,000 of 260,000" in finding["text"]
        and "'s (100,000 bytes)" in finding["text"]
    )
    async with httpx.AsyncClient(base_url=gw.url, timeout=30) as c:
        post = c.post  # a whole request of the same size, sent at once
        r = await post("/v1/chat/completions", content=body(), headers={"authorization": "Bearer kt"})
        assert r.status_code == 429 and r.json()["error"]["code"] == "too_many_body_bytes", r.text
        assert "limits.max_held_body_bytes_per_tenant" in r.json()["error"]["message"]
        assert r.headers["retry-after"]
        r = await post("/v1/chat/completions", content=body(), headers={"authorization": "Bearer kv"})
        assert r.status_code == 503 and r.json()["error"]["code"] == "overloaded", r.text
        small = await post(
            "/v1/chat/completions", content=body(5_000), headers={"authorization": "Bearer kv"}
        )
        assert small.status_code == 200  # (within both limits)
        assert [await up.finish() for up in uploads] == [200] * 5
        assert held(gw) == (0, {})
        r = await post("/v1/chat/completions", content=body(), headers={"authorization": "Bearer kt"})
        assert r.status_code == 200
    assert held(gw) == (0, {})
    assert await gw.wait_idle() == {name: 0 for name in await gw.in_flight()}


async def test_a_chunked_body_holds_the_most_until_its_size_is_known_and_a_dropped_upload_gives_back(
    stub_backend: tuple[StubBackend, str], gateway_factory: GatewayFactory
) -> None:
    _, url = stub_backend
    gw = await gateway_factory(config(url))
    up = SlowUpload(gw, "kt")
    await up.start()
    await eventually(lambda: held(gw)[0] == SIZE, message="upload not held")
    up.writer.close()  # the client gives up half way
    await eventually(lambda: held(gw) == (0, {}), message="a dropped upload kept its bytes")

    go_on = asyncio.Event()
    whole = body(5_000)

    async def chunks() -> Any:
        yield whole[:100]
        await go_on.wait()
        yield whole[100:]

    async with httpx.AsyncClient(base_url=gw.url, timeout=30) as c:
        sending = asyncio.create_task(
            c.post("/v1/chat/completions", content=chunks(), headers={"authorization": "Bearer kt"})
        )
        # No Content-Length: the most a body may be (limits.max_body_bytes) until it is read.
        await eventually(lambda: held(gw)[0] == 100_000, message="a chunked body not held at the most")
        go_on.set()
        assert (await sending).status_code == 200
    assert held(gw) == (0, {})


async def test_a_json_body_in_flight_is_kept_parsed_and_serialized_not_also_as_the_clients_bytes(
    stub_backend: tuple[StubBackend, str], gateway_factory: GatewayFactory
) -> None:
    # Held three times (the client's bytes, parsed, serialized to send), 256 MiB of held bodies
    # took ~990 MiB of a gateway whose Kubernetes limit is 1 GiB (python -m loadtest.bench.held_memory).
    _, url = stub_backend
    gw = await gateway_factory(config(url))
    raw = body()
    async with httpx.AsyncClient(base_url=gw.url, timeout=30) as c:
        sending = asyncio.create_task(
            c.post(
                "/v1/chat/completions",
                content=raw,
                headers={"authorization": "Bearer kt", "x-stub-chunks": "4", "x-stub-interval": "0.3"},
            )
        )
        await eventually(lambda: len(gw.app.exchanges) == 1, message="request not in flight")
        [x] = gw.app.exchanges
        await eventually(lambda: x.sent != b"", message="not priced")
        assert x.raw == b"" and len(x.sent) >= len(raw) - 100
        assert held(gw)[0] == SIZE  # still counted at its size until it ends
        assert (await sending).status_code == 200
    assert held(gw) == (0, {})


async def test_a_large_body_is_serialized_again_at_the_send_and_arrives_whole(
    stub_backend: tuple[StubBackend, str], gateway_factory: GatewayFactory
) -> None:
    # Above 64 KB the serialized body is not kept while the request waits (it is made again at
    # the send): what the backend reads is still exactly the body that was priced.
    stub, url = stub_backend
    gw = await gateway_factory(config(url))
    raw = body(90_000)
    async with httpx.AsyncClient(base_url=gw.url, timeout=30) as c:
        r = await c.post("/v1/chat/completions", content=raw, headers={"authorization": "Bearer kt"})
    assert r.status_code == 200, r.text
    sent = stub.requests[-1].body
    assert sent["messages"] == orjson.loads(raw)["messages"] and sent["max_tokens"] == 1

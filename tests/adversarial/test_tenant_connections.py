"""A tenant cannot take every connection the gateway will accept.

``limits.max_connections`` bounds a process's open connections, first come, first served. A tenant
keeping many connections alive — a tiny, cheap request on each now and then, far inside its token
budget — held them all, and every other tenant's next connection was a 503. Over raw sockets: past
``limits.max_connections_per_tenant`` the tenant's request on one more connection is a 429 and that
connection is closed, so the slot is free again; another tenant connects and is served; a closed
connection gives its tenant's share back.
"""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import orjson

from tests.conftest import GatewayFactory, RunningGateway, StubBackend, eventually, stub_pools

BODY = orjson.dumps({"model": "stub-model", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]})


class KeptAlive:
    """One client connection, kept open between requests."""

    def __init__(self, gw: RunningGateway) -> None:
        self.host, port = gw.url.removeprefix("http://").split(":")
        self.port = int(port)

    async def open(self) -> KeptAlive:
        self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
        return self

    async def request(self, key: str) -> tuple[int, dict[str, str], dict[str, Any]]:
        head = (
            f"POST /v1/chat/completions HTTP/1.1\r\nHost: gw\r\nAuthorization: Bearer {key}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(BODY)}\r\n\r\n"
        )
        self.writer.write(head.encode() + BODY)
        await self.writer.drain()
        status = int((await self.reader.readline()).split()[1])
        headers: dict[str, str] = {}
        while (line := await self.reader.readline()) not in (b"\r\n", b""):
            name, _, value = line.decode().partition(":")
            headers[name.strip().lower()] = value.strip()
        body = await self.reader.readexactly(int(headers["content-length"]))
        return status, headers, orjson.loads(body)

    async def closed_by_server(self) -> bool:
        return await asyncio.wait_for(self.reader.read(1), 5) == b""

    def close(self) -> None:
        self.writer.close()


def connections(gw: RunningGateway) -> dict[str, int]:
    return dict(gw.app._proxy.connections.by_tenant)


async def test_past_its_share_a_tenants_request_on_one_more_connection_is_a_429_and_the_slot_is_freed(
    stub_backend: tuple[StubBackend, str], gateway_factory: GatewayFactory
) -> None:
    _, url = stub_backend
    gw = await gateway_factory(
        {
            "pools": stub_pools(url, capacity=1_000_000),
            "tenants": {"greedy": {"keys": ["kg"]}, "other": {"keys": ["ko"]}},
            "limits": {"max_connections": 6, "max_connections_per_tenant": 3},
        }
    )
    greedy = [await KeptAlive(gw).open() for _ in range(3)]
    for conn in greedy:
        assert (await conn.request("kg"))[0] == 200
    for conn in greedy:  # kept alive: each request again on the same connection is fine
        assert (await conn.request("kg"))[0] == 200
    assert connections(gw) == {"greedy": 3}

    one_more = await KeptAlive(gw).open()
    status, headers, body = await one_more.request("kg")
    assert status == 429 and body["error"]["code"] == "too_many_connections", body
    assert "limits.max_connections_per_tenant" in body["error"]["message"]
    assert headers["connection"] == "close" and headers["retry-after"]
    assert await one_more.closed_by_server()  # its slot is free at once
    assert connections(gw) == {"greedy": 3}

    # Before, the greedy tenant's connections filled max_connections and this was a 503.
    others = [await KeptAlive(gw).open() for _ in range(3)]
    for conn in others:
        assert (await conn.request("ko"))[0] == 200
    assert connections(gw) == {"greedy": 3, "other": 3}

    # A connection moves to the tenant of its latest request; a closed one gives its share back.
    greedy[0].close()
    await eventually(lambda: connections(gw) == {"greedy": 2, "other": 3}, message="share not given back")
    again = await KeptAlive(gw).open()
    assert (await again.request("kg"))[0] == 200
    assert (await others[0].request("kg"))[
        0
    ] == 429  # greedy at 3 again: "other"'s connection cannot become its 4th
    assert await others[0].closed_by_server()
    await eventually(lambda: connections(gw) == {"greedy": 3, "other": 2}, message="not released")
    async with httpx.AsyncClient() as ops:
        stats = (await ops.get(gw.ops_url + "/stats")).json()["tenant_connections"]
    assert stats["total"] == 5 and stats["limit_per_tenant"] == 3
    assert stats["top_tenants"][0] == {"tenant": "greedy", "connections": 3}
    for conn in [*greedy[1:], again, *others[1:]]:
        conn.close()
    await eventually(lambda: connections(gw) == {}, message="connections not released")
    assert await gw.wait_idle() == {name: 0 for name in await gw.in_flight()}


async def test_in_open_mode_connections_are_bounded_only_by_the_process_limit(
    stub_backend: tuple[StubBackend, str], gateway_factory: GatewayFactory
) -> None:
    _, url = stub_backend
    gw = await gateway_factory(
        {"pools": stub_pools(url), "limits": {"max_connections": 8, "max_connections_per_tenant": 2}}
    )
    conns = [await KeptAlive(gw).open() for _ in range(4)]
    assert [(await c.request("anything"))[0] for c in conns] == [200] * 4
    assert connections(gw) == {}
    for c in conns:
        c.close()

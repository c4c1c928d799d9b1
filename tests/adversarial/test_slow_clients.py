"""Slow and oversized clients cannot hold the gateway: every limit answers in OpenAI's error shape
and closes, and the gateway keeps serving everyone else. All over raw sockets."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import httpx

from loadtest.raw_http import host_port, read_response, request, send_raw
from tests.conftest import GatewayFactory, RunningGateway, StubBackend, stub_pools
from tests.support import eventually

CHAT = b'{"model":"stub-model","messages":[{"role":"user","content":"hi"}],"max_tokens":5}'


async def limited(
    stub_backend: tuple[StubBackend, str], factory: GatewayFactory, **limits: Any
) -> RunningGateway:
    _, url = stub_backend
    return await factory({"pools": stub_pools(url), "limits": limits, "drain_timeout_s": 1})


async def still_serves(gw: RunningGateway) -> None:
    async with httpx.AsyncClient(base_url=gw.url) as c:
        r = await c.post("/v1/chat/completions", content=CHAT, headers={"content-type": "application/json"})
    assert r.status_code == 200
    assert await gw.wait_idle() == {name: 0 for name in await gw.in_flight()}


async def test_oversized_headers_get_431_and_are_never_forwarded(
    stub_backend: tuple[StubBackend, str], gateway_factory: GatewayFactory
) -> None:
    stub, _ = stub_backend
    gw = await limited(stub_backend, gateway_factory, max_header_bytes=8192)
    for size in (9000, 100_000, 1_000_000):
        r = await send_raw(
            gw.url, request("POST", "/v1/chat/completions", body=CHAT, headers={"x-big": "a" * size})
        )
        assert r is not None and r.status == 431, size
        err = r.json()
        assert isinstance(err, dict) and err["error"]["code"] == "headers_too_large"
        assert "limits.max_header_bytes" in err["error"]["message"]
    # Many small headers add up the same way.
    many = {f"x-h{i}": "v" * 100 for i in range(200)}
    r = await send_raw(gw.url, request("POST", "/v1/chat/completions", body=CHAT, headers=many))
    assert r is not None and r.status == 431
    assert stub.requests == []
    await still_serves(gw)


async def test_headers_that_keep_coming_are_refused_before_they_end(
    stub_backend: tuple[StubBackend, str], gateway_factory: GatewayFactory
) -> None:
    stub, _ = stub_backend
    gw = await limited(stub_backend, gateway_factory, max_header_bytes=8192, header_timeout_s=30)
    host, port = host_port(gw.url)
    reader, writer = await asyncio.open_connection(host, port)
    writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\n")
    t0 = time.monotonic()
    # 64 KiB of headers in small writes, never finished: refused long before the header deadline.

    async def keep_sending() -> None:
        for i in range(64):
            writer.write(f"x-h{i}: {'v' * 1000}\r\n".encode())
            await writer.drain()
            await asyncio.sleep(0.005)

    sender = asyncio.create_task(keep_sending())
    r = await asyncio.wait_for(read_response(reader), 5)
    assert r is not None and r.status == 431
    assert time.monotonic() - t0 < 10
    await asyncio.gather(sender, return_exceptions=True)  # its writes fail once the gateway closed
    writer.close()
    assert stub.requests == []
    await still_serves(gw)


async def test_a_pipelined_request_with_oversized_headers_is_never_forwarded(
    stub_backend: tuple[StubBackend, str], gateway_factory: GatewayFactory
) -> None:
    stub, _ = stub_backend
    gw = await limited(stub_backend, gateway_factory, max_header_bytes=8192)
    host, port = host_port(gw.url)
    reader, writer = await asyncio.open_connection(host, port)
    # Both requests in one write: the second one's headers are parsed while the first is served.
    ok = request("POST", "/v1/chat/completions", body=CHAT, headers={"content-type": "application/json"})
    big = request("POST", "/v1/chat/completions", body=CHAT, headers={"x-big": "a" * 9000})
    writer.write(ok + big)
    await writer.drain()
    first = await asyncio.wait_for(read_response(reader), 10)
    assert first is not None and first.status == 200
    # The first is answered and the connection ends; the oversized one never reaches the backend.
    rest = await asyncio.wait_for(reader.read(), 10)
    assert b" 200 " not in rest
    writer.close()
    assert len(stub.requests) == 1
    await still_serves(gw)


async def test_headers_that_never_finish_are_cut_off(
    stub_backend: tuple[StubBackend, str], gateway_factory: GatewayFactory
) -> None:
    gw = await limited(stub_backend, gateway_factory, header_timeout_s=0.5)
    host, port = host_port(gw.url)
    # One client sends half a request, another sends nothing at all.
    half_r, half_w = await asyncio.open_connection(host, port)
    half_w.write(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\nx-slow: ")
    await half_w.drain()
    mute_r, mute_w = await asyncio.open_connection(host, port)
    t0 = time.monotonic()
    for reader in (half_r, mute_r):
        r = await asyncio.wait_for(read_response(reader), 5)
        assert r is not None and r.status == 408
        assert r.json()["error"]["code"] == "header_timeout"  # type: ignore[index]
        assert await asyncio.wait_for(reader.read(), 5) == b""  # and the connection is closed
    assert time.monotonic() - t0 < 3
    for w in (half_w, mute_w):
        w.close()
    await still_serves(gw)


async def test_a_body_dripped_byte_by_byte_gets_408_and_holds_nothing(
    stub_backend: tuple[StubBackend, str], gateway_factory: GatewayFactory
) -> None:
    stub, _ = stub_backend
    gw = await limited(stub_backend, gateway_factory, body_timeout_s=0.5)
    host, port = host_port(gw.url)
    reader, writer = await asyncio.open_connection(host, port)
    head = request("POST", "/v1/chat/completions", body=CHAT)
    writer.write(head[: -len(CHAT)])
    answer = asyncio.ensure_future(read_response(reader))
    for byte in CHAT[:20]:
        if answer.done():
            break
        writer.write(bytes([byte]))
        await writer.drain()
        await asyncio.sleep(0.1)
    r = await asyncio.wait_for(answer, 5)
    writer.close()
    assert r is not None and r.status == 408
    assert r.json()["error"]["code"] == "body_timeout"  # type: ignore[index]
    assert stub.requests == []
    await still_serves(gw)


async def test_connections_beyond_the_limit_are_refused_at_once(
    stub_backend: tuple[StubBackend, str], gateway_factory: GatewayFactory
) -> None:
    gw = await limited(stub_backend, gateway_factory, max_connections=3, header_timeout_s=30)
    host, port = host_port(gw.url)
    held = [await asyncio.open_connection(host, port) for _ in range(3)]
    r = await send_raw(gw.url, request("POST", "/v1/chat/completions", body=CHAT), timeout_s=2)
    assert r is not None and r.status == 503
    assert r.json()["error"]["code"] == "too_many_connections"  # type: ignore[index]
    assert r.headers.get("retry-after") == "1"
    for _, w in held:
        w.close()

    async def served() -> bool:  # the server notices the closes on its next loop turns
        r = await send_raw(gw.url, request("POST", "/v1/chat/completions", body=CHAT))
        return r is not None and r.status == 200

    await eventually(served, interval_s=0.02)
    await still_serves(gw)


async def test_a_content_length_that_promises_more_than_is_sent_gets_408_after_the_idle_limit(
    stub_backend: tuple[StubBackend, str], gateway_factory: GatewayFactory
) -> None:
    stub, _ = stub_backend
    gw = await limited(stub_backend, gateway_factory, body_idle_timeout_s=0.3, body_timeout_s=30)
    data = request("POST", "/v1/chat/completions", body=CHAT).replace(
        f"content-length: {len(CHAT)}".encode(), f"content-length: {len(CHAT) + 100}".encode()
    )
    t0 = time.monotonic()
    r = await send_raw(gw.url, data, timeout_s=5)
    assert r is not None and r.status == 408
    assert r.json()["error"]["code"] == "body_timeout"  # type: ignore[index]
    assert time.monotonic() - t0 < 2
    assert stub.requests == []
    await still_serves(gw)

"""A deliberately dumb HTTP/1.1 client over a raw socket: sends exactly the bytes it is given.

Real client libraries normalise what an attacker would not (dot segments, header casing, body
framing), so attacks on the gateway's parsing go through this.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from urllib.parse import urlsplit

import orjson


@dataclass
class RawResponse:
    status: int
    headers: dict[str, str]
    body: bytes

    def json(self) -> object:
        return orjson.loads(self.body)


def host_port(url: str) -> tuple[str, int]:
    parts = urlsplit(url)
    assert parts.hostname is not None and parts.port is not None
    return parts.hostname, parts.port


async def send_raw(url: str, data: bytes, *, timeout_s: float = 10.0) -> RawResponse | None:
    """Send ``data`` and read one response; None when the server closed without answering."""
    host, port = host_port(url)
    reader, writer = await asyncio.open_connection(host, port)
    try:
        writer.write(data)
        await writer.drain()
        return await asyncio.wait_for(read_response(reader), timeout_s)
    finally:
        writer.close()


async def read_response(reader: asyncio.StreamReader) -> RawResponse | None:
    head = b""
    while b"\r\n\r\n" not in head:
        chunk = await reader.read(65536)
        if not chunk:
            return None if not head else _parse(head, b"")
        head += chunk
    head, _, rest = head.partition(b"\r\n\r\n")
    response = _parse(head, b"")
    length = response.headers.get("content-length")
    if length is not None:
        body = rest
        while len(body) < int(length):
            chunk = await reader.read(65536)
            if not chunk:
                break
            body += chunk
        response.body = body[: int(length)]
    elif response.headers.get("transfer-encoding") == "chunked":
        response.body = await _read_chunked(reader, rest)
    else:
        response.body = rest + await reader.read()
    return response


async def _read_chunked(reader: asyncio.StreamReader, buf: bytes) -> bytes:
    out = b""
    while True:
        while b"\r\n" not in buf:
            more = await reader.read(65536)
            if not more:
                return out
            buf += more
        size_line, _, buf = buf.partition(b"\r\n")
        size = int(size_line.split(b";")[0], 16)
        while len(buf) < size + 2:
            more = await reader.read(65536)
            if not more:
                return out + buf
            buf += more
        if size == 0:
            return out
        out += buf[:size]
        buf = buf[size + 2 :]


def _parse(head: bytes, body: bytes) -> RawResponse:
    lines = head.split(b"\r\n")
    status = int(lines[0].split(b" ")[1])
    headers = {}
    for line in lines[1:]:
        name, _, value = line.partition(b":")
        headers[name.strip().lower().decode("latin-1")] = value.strip().decode("latin-1")
    return RawResponse(status, headers, body)


def request(method: str, target: str, *, body: bytes = b"", headers: dict[str, str] | None = None) -> bytes:
    """A well-framed request for ``target`` exactly as written (no normalisation)."""
    lines = [f"{method} {target} HTTP/1.1", "host: gateway", "connection: close"]
    all_headers = {"content-type": "application/json"} if body else {}
    all_headers.update(headers or {})
    lines += [f"{k}: {v}" for k, v in all_headers.items()]
    if body or method == "POST":
        lines.append(f"content-length: {len(body)}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body

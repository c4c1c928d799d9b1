"""Helpers for gateway tests: a raw HTTP/1.1 client that can hang up at any moment."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from urllib.parse import urlsplit

import orjson


class RawRequest:
    """One request on its own TCP connection; read a little, then ``close()`` to disconnect."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer

    @classmethod
    async def post(
        cls, base_url: str, path: str, body: object, headers: Mapping[str, str] | None = None
    ) -> RawRequest:
        u = urlsplit(base_url)
        reader, writer = await asyncio.open_connection(u.hostname, u.port)
        data = orjson.dumps(body)
        head = [
            f"POST {path} HTTP/1.1",
            f"Host: {u.hostname}:{u.port}",
            "Content-Type: application/json",
            f"Content-Length: {len(data)}",
        ]
        head += [f"{k}: {v}" for k, v in (headers or {}).items()]
        writer.write(("\r\n".join(head) + "\r\n\r\n").encode() + data)
        await writer.drain()
        return cls(reader, writer)

    async def read_head(self) -> tuple[int, dict[str, str]]:
        raw = await self.reader.readuntil(b"\r\n\r\n")
        lines = raw.decode("latin-1").split("\r\n")
        status = int(lines[0].split()[1])
        headers = {}
        for line in lines[1:]:
            if ":" in line:
                k, v = line.split(":", 1)
                headers[k.strip().lower()] = v.strip()
        return status, headers

    async def read_some(self, n: int = 1) -> bytes:
        return await self.reader.read(n)

    async def close(self) -> None:
        self.writer.close()
        try:
            await self.writer.wait_closed()
        except (ConnectionError, OSError):
            pass


def chat(content: str = "hello", **extra: object) -> dict[str, object]:
    return {"model": "stub-model", "messages": [{"role": "user", "content": content}], **extra}


def dead_then_live(live_url: str, **pool: object) -> dict[str, object]:
    """A pool of two equal backends, an unreachable one (``dead``, listed first, so picked first) and
    ``live_url`` (``live``); ``pool``: more settings of the pool."""
    from tests.conftest import free_port

    dead = f"http://127.0.0.1:{free_port()}"
    backends = [
        {"url": dead, "capacity_tokens": 100_000, "models": ["stub-model"], "name": "dead"},
        {"url": live_url, "capacity_tokens": 100_000, "models": ["stub-model"], "name": "live"},
    ]
    return {"default": {"backends": backends, **pool}}

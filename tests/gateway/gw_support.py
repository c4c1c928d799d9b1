"""Helpers for gateway tests: a raw HTTP/1.1 client that can hang up at any moment, request bodies,
keys, a hand-set clock, the access log's lines."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

import httpx
import orjson
import pytest

if TYPE_CHECKING:
    from tests.conftest import RunningGateway

ROOT = Path(__file__).resolve().parents[2]
AUTH = {"authorization": "Bearer k"}
ADMIN = {"authorization": "Bearer admin-secret"}
READ = {"authorization": "Bearer read-secret"}
# What ``wait_idle`` answers for the default stub layout once nothing is in flight.
ZERO = {"tenant:default": 0, "backend:default": 0}


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


async def use(gw: RunningGateway, key: str, max_tokens: int = 5) -> httpx.Response:
    """One chat completion through ``gw`` with ``key``."""
    async with httpx.AsyncClient(base_url=gw.url) as c:
        return await c.post(
            "/v1/chat/completions",
            json=chat(max_tokens=max_tokens),
            headers={"authorization": f"Bearer {key}"},
        )


async def use_status(gw: RunningGateway, key: str, max_tokens: int = 5) -> int:
    """The status code of ``use``."""
    return (await use(gw, key, max_tokens)).status_code


def access_lines(caplog: pytest.LogCaptureFixture) -> list[dict[str, Any]]:
    return [orjson.loads(r.getMessage()) for r in caplog.records if r.name == "tokengate.access"]


class Clock:
    """A clock the test sets by hand (``clock.t``)."""

    def __init__(self, start: float = 0.0) -> None:
        self.t = start

    def __call__(self) -> float:
        return self.t


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


async def cut_stream(url: str, key: str, max_tokens: int = 40) -> None:
    """A streamed chat completion its client hangs up on after the first bytes (before any usage)."""
    req = await RawRequest.post(
        url,
        "/v1/chat/completions",
        chat(stream=True, max_tokens=max_tokens),
        {"authorization": f"Bearer {key}", "x-stub-chunks": "200", "x-stub-interval": "0.01"},
    )
    status, _ = await req.read_head()
    assert status == 200 and await req.read_some(64)
    await req.close()

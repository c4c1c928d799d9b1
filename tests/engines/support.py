"""Shared helpers for the real-engine tests: a prompt, an OpenAI client, the access log's lines."""

from __future__ import annotations

from typing import Any

import openai
import orjson
import pytest

MESSAGES = [{"role": "user", "content": "Name three colours."}]


def access_lines(caplog: pytest.LogCaptureFixture) -> list[dict[str, Any]]:
    return [orjson.loads(r.getMessage()) for r in caplog.records if r.name == "tokengate.access"]


def client(base: str, key: str = "sk-acme") -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{base}/v1", api_key=key, max_retries=0, timeout=120)


async def read_some(stream: Any, events: int = 3) -> None:
    """Read a stream's first ``events`` events and stop (the caller then hangs up)."""
    seen = 0
    async for _ in stream:
        seen += 1
        if seen == events:
            return

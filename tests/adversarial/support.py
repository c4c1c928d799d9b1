"""Shared helpers for the adversarial tests: keys, prompts, request bodies, gateway configs."""

from __future__ import annotations

from typing import Any

from tests.conftest import stub_pools

AUTH = {"authorization": "Bearer k"}
WORDS = "word " * 30_000  # ~30k tokens
# Words to draw prompts from.
PROSE_WORDS = "the model token budget queue tenant prefill decode cache batch stream gateway latency".split()


def image_chat(url: str) -> dict[str, Any]:
    """A chat request with one image, at ``url``."""
    parts = [{"type": "text", "text": "what is this?"}, {"type": "image_url", "image_url": {"url": url}}]
    return {"model": "stub-model", "max_tokens": 5, "messages": [{"role": "user", "content": parts}]}


def rerank_config(url: str, **limits: Any) -> dict[str, object]:
    """One tenant (key ``k``) on the stub backend, ``/v1/rerank`` passed through; ``limits``: the
    gateway's ``limits`` section, if any."""
    return {
        "pools": stub_pools(url, capacity=200_000),
        "tenants": {"t": {"keys": ["k"], "budget_tokens": 20_000}},
        "passthrough": {"routes": [{"method": "POST", "path": "/v1/rerank"}]},
        **({"limits": limits} if limits else {}),
    }

"""Shared helpers for the classifiers tests: pricing limits, token counts, request bodies."""

from __future__ import annotations

from typing import Any

from classifiers import default_tokenizer
from classifiers.images import ImageRule

CTX = 8192
LIMITS: dict[str, Any] = {"default_max_tokens": 256, "max_tokens_limit": None, "context_length": CTX}
# Qwen2-VL's dynamic-resolution image rule.
QWEN = ImageRule(patch_pixels=28, min_pixels=3_136, max_pixels=12_845_056, extra_tokens=2)


def count(text: str) -> int:
    return default_tokenizer().count(text)


def chat(**extra: Any) -> dict[str, Any]:
    return {"model": "m", "messages": [{"role": "user", "content": "Hi"}], **extra}


def responses(**extra: Any) -> dict[str, Any]:
    return {"model": "m", "input": "Hi", **extra}

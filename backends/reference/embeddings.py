"""``POST /v1/embeddings`` of the reference backend: deterministic test vectors, not semantic ones.

The reference backend is a generation engine, so its embeddings are built from the input's tokens by
feature hashing (each token adds +1 or -1 to one of ``dimensions`` coordinates, then the vector is
scaled to unit length): the same input always gives the same vector, inputs sharing tokens are closer
than inputs that share none, and the shape, the usage and the errors are OpenAI's. That is what a
client, a gateway or a load test needs from it; retrieval quality is not.
"""

from __future__ import annotations

import base64
import math
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from backends.reference.errors import bad_request

DEFAULT_DIMENSIONS = 256
MAX_DIMENSIONS = 4096
MAX_INPUTS = 2048
_GOLDEN = 2654435761  # Knuth's multiplicative hash constant


@dataclass(frozen=True)
class EmbeddingRequest:
    model: str
    inputs: list[str | list[int]]
    dimensions: int
    base64: bool


def parse_embeddings(raw: Any) -> EmbeddingRequest:
    if not isinstance(raw, dict):
        raise bad_request("the request body must be a JSON object")
    model = raw.get("model")
    if not isinstance(model, str) or not model:
        raise bad_request("'model' must be a non-empty string", "model")
    inputs = _inputs(raw.get("input"))
    dims = raw.get("dimensions")
    if dims is None:
        dims = DEFAULT_DIMENSIONS
    elif not isinstance(dims, int) or isinstance(dims, bool) or not 1 <= dims <= MAX_DIMENSIONS:
        raise bad_request(
            f"'dimensions' must be an integer from 1 to {MAX_DIMENSIONS}, got {dims!r}", "dimensions"
        )
    fmt = raw.get("encoding_format") or "float"
    if fmt not in ("float", "base64"):
        raise bad_request(f"'encoding_format' must be 'float' or 'base64', got {fmt!r}", "encoding_format")
    return EmbeddingRequest(model, inputs, dims, fmt == "base64")


def _inputs(v: Any) -> list[str | list[int]]:
    """A string, a list of strings, a list of token ids, or a list of lists of token ids."""
    if isinstance(v, str):
        items: list[Any] = [v]
    elif isinstance(v, list) and v and all(_is_token(t) for t in v):
        items = [v]
    elif isinstance(v, list) and v:
        items = v
    else:
        raise bad_request(
            "'input' must be a non-empty string, array of strings or array of token ids", "input"
        )
    if len(items) > MAX_INPUTS:
        raise bad_request(f"'input' has {len(items)} items; at most {MAX_INPUTS} per request", "input")
    for i, item in enumerate(items):
        ok = (isinstance(item, str) and item) or (
            isinstance(item, list) and item and all(_is_token(t) for t in item)
        )
        if not ok:
            raise bad_request(f"'input[{i}]' must be a non-empty string or array of token ids", "input")
    return items


def _is_token(t: Any) -> bool:
    return isinstance(t, int) and not isinstance(t, bool) and t >= 0


def embed(token_ids: Sequence[int], dimensions: int) -> list[float]:
    vec = [0.0] * dimensions
    for t in token_ids:
        h = (t * _GOLDEN) & 0xFFFFFFFF
        vec[h % dimensions] += 1.0 if (h >> 31) & 1 else -1.0
    norm = math.sqrt(sum(x * x for x in vec))
    return [x / norm for x in vec] if norm else vec


def embeddings_body(
    req: EmbeddingRequest, encode: Callable[[str], list[int]], max_model_len: int
) -> dict[str, Any]:
    data = []
    total = 0
    for i, item in enumerate(req.inputs):
        ids = encode(item) if isinstance(item, str) else item
        if len(ids) > max_model_len:
            raise bad_request(
                f"This model's maximum context length is {max_model_len} tokens; input[{i}] has {len(ids)} tokens.",
                "input",
                "context_length_exceeded",
            )
        total += len(ids)
        vec = embed(ids, req.dimensions)
        value: list[float] | str = (
            base64.b64encode(struct.pack(f"<{len(vec)}f", *vec)).decode() if req.base64 else vec
        )
        data.append({"object": "embedding", "index": i, "embedding": value})
    return {
        "object": "list",
        "data": data,
        "model": req.model,
        "usage": {"prompt_tokens": total, "total_tokens": total},
    }

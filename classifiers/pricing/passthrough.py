"""Pricing allow-listed pass-through POSTs (``/v1/rerank``, ``/v1/score``, ``/v1/audio/...``).

They are never refused: prefill is the token count of the whole body decoded as UTF-8 with
replacement (the model's tokenizer when the model is known, else the byte estimate), at least 1
for a non-empty body; decode is the largest non-negative integer among the body's
``max_tokens`` / ``max_completion_tokens`` / ``max_output_tokens`` when it is a JSON object that
names one, else ``default_max_tokens`` for a route that ``generates`` and 0 for one that does
not, and at most 2**32; a ``context_length``, when given, caps decode at ``context_length -
prefill``. Binary bodies (uploads) therefore price high: about one token per byte.
"""

from __future__ import annotations

import orjson

from classifiers.pricing.cost import Cost
from classifiers.tokenizers import Tokenizer

_OUTPUT_LIMIT_KEYS = ("max_tokens", "max_completion_tokens", "max_output_tokens")
# Far above any budget (so still refused), yet exact in the Lua store's doubles.
_MAX_PASSTHROUGH_DECODE = 2**32


def walk(
    tok: Tokenizer,
    body_bytes: bytes,
    default_max_tokens: int,
    generates: bool,
    context_length: int | None,
) -> Cost:
    """Price a pass-through body with ``tok``; never raises."""
    prefill = max(1, tok.count(body_bytes.decode("utf-8", "replace"))) if body_bytes else 0
    decode = -1
    if body_bytes.lstrip()[:1] == b"{":
        try:
            obj = orjson.loads(body_bytes)
        except orjson.JSONDecodeError:
            obj = None
        if isinstance(obj, dict):
            for key in _OUTPUT_LIMIT_KEYS:
                value = obj.get(key)
                if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
                    decode = max(decode, value)
    if decode < 0:
        decode = default_max_tokens if generates else 0
    decode = min(decode, _MAX_PASSTHROUGH_DECODE)
    if context_length is not None:
        decode = min(decode, max(context_length - prefill, 0))
    return Cost(prefill=prefill, decode=decode)

"""Client values quoted back in error messages and logs are clipped.

A tenant controls every string it sends; an error that quotes a 1 MB model name answers with 1 MB
and writes 1 MB to the operator's log. Quote at most ``limit`` characters, and say how long it was.
"""

from __future__ import annotations

ECHO_LIMIT = 64


def clip(value: object, limit: int = ECHO_LIMIT) -> str:
    """``repr(value)`` cut to about ``limit`` characters, e.g. ``'aaaa…' (1048576 chars)``."""
    if isinstance(value, str | bytes) and len(value) > limit:
        return f"{value[:limit]!r}… ({len(value)} chars)"
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}… ({len(text)} chars)"

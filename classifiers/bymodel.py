"""A per-model setting: the value of the first ``(glob, value)`` pair whose glob matches a model name."""

from __future__ import annotations

from collections.abc import Iterable
from fnmatch import fnmatchcase
from typing import Generic, TypeVar

T = TypeVar("T")

# Names remembered: a client inventing model names must not grow the memo without bound.
_MEMO_LIMIT = 4096


class ByModel(Generic[T]):
    """``get(model)``: the first matching glob's value (``fnmatchcase``, config order), else
    ``default``; each name's answer is remembered, since the same few names come on every request."""

    def __init__(self, pairs: Iterable[tuple[str, T]], default: T) -> None:
        self._pairs = tuple(pairs)
        self._default = default
        self._memo: dict[str, T] = {}

    def __bool__(self) -> bool:
        """False when no glob is configured: every model gets the default."""
        return bool(self._pairs)

    def get(self, model: str) -> T:
        try:
            return self._memo[model]
        except KeyError:
            pass
        value = next((v for pattern, v in self._pairs if fnmatchcase(model, pattern)), self._default)
        if len(self._memo) < _MEMO_LIMIT:
            self._memo[model] = value
        return value

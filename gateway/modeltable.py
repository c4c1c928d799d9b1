"""Per-model pricing facts from the ``models`` config section: tokenizer spec, context length, the
cost of an image."""

from __future__ import annotations

from collections.abc import Sequence
from fnmatch import fnmatchcase

from classifiers.images import ImageRule
from gateway.config import DEFAULT_CONTEXT_LENGTH, ModelConfig

_CACHE_LIMIT = 4096  # a client inventing model names must not grow the cache without bound


class ModelTable:
    def __init__(self, models: Sequence[ModelConfig], default_context: int = DEFAULT_CONTEXT_LENGTH) -> None:
        self._models = tuple(models)
        self._default = default_context
        self._ctx: dict[str, int] = {}

    def image_rules(self) -> list[tuple[str, ImageRule]]:
        """(glob, rule) of the models whose images are not priced at ``pricing.image_tokens``."""
        return [(m.pattern, m.images) for m in self._models if m.images is not None]

    def tokenizer_specs(self) -> dict[str, str]:
        """Glob -> tokenizer spec, for classifiers.TokenizerRegistry."""
        return {m.pattern: m.tokenizer for m in self._models if m.tokenizer}

    def context_length(self, model: str) -> int:
        ctx = self._ctx.get(model)
        if ctx is None:
            ctx = next(
                (m.context_length for m in self._models if fnmatchcase(model, m.pattern)), self._default
            )
            if len(self._ctx) < _CACHE_LIMIT:
                self._ctx[model] = ctx
        return ctx

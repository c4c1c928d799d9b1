"""Per-model pricing facts from the ``models`` config section: tokenizer spec, context length, the
cost of an image, the vocabulary size, the prompt-overhead settings."""

from __future__ import annotations

from collections.abc import Sequence

from classifiers.bymodel import ByModel
from classifiers.images import ImageRule
from classifiers.prompt_overhead import NO_SETTING, OverheadSetting
from gateway.config.schema import DEFAULT_CONTEXT_LENGTH, ModelConfig


class ModelTable:
    def __init__(self, models: Sequence[ModelConfig], default_context: int = DEFAULT_CONTEXT_LENGTH) -> None:
        self._models = tuple(models)
        self._ctx = ByModel(((m.pattern, m.context_length) for m in self._models), default_context)
        self._overhead = ByModel(
            (
                (m.pattern, OverheadSetting(m.prompt_overhead_tokens, m.learn_prompt_overhead, m.pattern))
                for m in self._models
            ),
            NO_SETTING,
        )

    def image_rules(self) -> list[tuple[str, ImageRule]]:
        """(glob, rule) of the models whose images are not priced at ``pricing.image_tokens``."""
        return [(m.pattern, m.images) for m in self._models if m.images is not None]

    def vocab_sizes(self) -> list[tuple[str, int]]:
        """(glob, vocab_size) of the models whose token ids the gateway checks (classifiers.Pricer)."""
        return [(m.pattern, m.vocab_size) for m in self._models if m.vocab_size is not None]

    def tokenizer_specs(self) -> dict[str, str]:
        """Glob -> tokenizer spec, for classifiers.TokenizerRegistry."""
        return {m.pattern: m.tokenizer for m in self._models if m.tokenizer}

    def context_length(self, model: str) -> int:
        return self._ctx.get(model)

    def prompt_overhead(self, model: str) -> OverheadSetting:
        """The model's configured prompt overhead and whether a learned one applies (first match)."""
        return self._overhead.get(model)

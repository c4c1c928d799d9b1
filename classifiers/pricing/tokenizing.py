"""Which tokenizer a walk counts with: the model's own, made safe for any Python str.

Tokenizers that refuse lone surrogates (the Hugging Face binding) count the text with them
replaced; tiktoken and the byte estimate take any str and are used unwrapped. ``scoped`` gives a
tokenizer whose memo is one tenant's (classifiers.tokenizers), ``offloadable`` says whether it can
count in a thread with the GIL released.
"""

from __future__ import annotations

from classifiers.tokenizers import (
    BytesTokenizer,
    OffLoopCounting,
    TiktokenTokenizer,
    Tokenizer,
    TokenizerRegistry,
)

BYTES = BytesTokenizer()


def _scrub(text: str) -> str:
    """`text` with lone surrogates replaced (each by up to three U+FFFD: never fewer tokens)."""
    return text.encode("utf-8", "surrogatepass").decode("utf-8", "replace")


class _Scrubbing:
    """A tokenizer that may refuse lone surrogates (the Hugging Face binding raises TypeError).

    orjson never produces such strings, but a Python caller can: retry once on the scrubbed text
    rather than fail. tiktoken and the byte estimate take any str and are used unwrapped.
    """

    __slots__ = ("_tok", "name")

    def __init__(self, tok: Tokenizer) -> None:
        self._tok = tok
        self.name = tok.name

    def encode(self, text: str) -> list[int]:
        try:
            return self._tok.encode(text)
        except (TypeError, UnicodeError):
            return self._tok.encode(_scrub(text))

    def count(self, text: str) -> int:
        try:
            return self._tok.count(text)
        except (TypeError, UnicodeError):
            return self._tok.count(_scrub(text))

    def cached_count(self, text: str) -> int | None:
        peek = getattr(self._tok, "cached_count", None)
        return None if peek is None else peek(text)  # type: ignore[no-any-return]

    def count_nogil(self, text: str) -> int:
        off: OffLoopCounting = self._tok  # type: ignore[assignment]  # only used when offloadable
        try:
            return off.count_nogil(text)
        except (TypeError, UnicodeError):
            return off.count_nogil(_scrub(text))


class SafeTokenizers:
    """The registry's tokenizers, each wrapped (once) where it may refuse lone surrogates."""

    def __init__(self, registry: TokenizerRegistry) -> None:
        self.registry = registry
        self._safe: dict[int, Tokenizer] = {}

    def for_model(self, model: str | None) -> Tokenizer:
        """``model``'s tokenizer; the byte estimate for None (a pass-through body of no known model)."""
        return self._safe_tokenizer(self.registry.for_model(model)) if model else BYTES

    def _safe_tokenizer(self, tok: Tokenizer) -> Tokenizer:
        if type(tok) is TiktokenTokenizer or type(tok) is BytesTokenizer:
            return tok
        safe = self._safe.get(id(tok))
        if safe is None:
            # Registries hold their tokenizers for their lifetime, so ids stay unique; bounded anyway.
            safe = _Scrubbing(tok)
            if len(self._safe) < 1024:
                self._safe[id(tok)] = safe
        return safe


def scoped(tok: Tokenizer, scope: str) -> Tokenizer:
    """``tok`` with its memo partitioned to ``scope``, where it has a memo; "" is the shared one."""
    if not scope:
        return tok
    if type(tok) is _Scrubbing:
        inner = getattr(tok._tok, "scoped", None)
        return _Scrubbing(inner(scope)) if inner is not None else tok
    scope_of = getattr(tok, "scoped", None)
    return tok if scope_of is None else scope_of(scope)  # type: ignore[no-any-return]


def offloadable(tok: Tokenizer) -> bool:
    """Whether `tok` can count in a thread with the GIL released (see OffLoopCounting)."""
    if type(tok) is TiktokenTokenizer:
        return True
    if type(tok) is _Scrubbing:
        tok = tok._tok
    return hasattr(tok, "count_nogil") and hasattr(tok, "cached_count")

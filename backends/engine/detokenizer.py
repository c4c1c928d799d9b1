"""Incremental detokenization and stop strings.

Text is decoded incrementally with the prefix/read-offset technique (decode a short window of
tokens and emit only what a complete window adds), so a multi-byte character split across
tokens is emitted once it is whole and the cost per token stays constant. Stop strings are
matched on the decoded text; while a request runs, the last ``len(longest stop) - 1``
characters are held back so that a client never sees the beginning of a stop string that then
completes (the stop string itself is not part of the output, as in OpenAI's API and vLLM).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol


class TextDecoder(Protocol):
    def decode(self, ids: Sequence[int]) -> str: ...


class OutputText:
    def __init__(
        self, decoder: TextDecoder, stop: tuple[str, ...] = (), skip_ids: frozenset[int] = frozenset()
    ):
        self._decoder = decoder
        self._stop = tuple(s for s in stop if s)
        self._skip = skip_ids
        self._holdback = max((len(s) for s in self._stop), default=1) - 1
        self._ids: list[int] = []
        self._prefix_offset = 0
        self._read_offset = 0
        self._emitted = 0
        self.text = ""
        self.stopped = False  # a stop string matched; text is cut just before it

    def add(self, token_id: int) -> None:
        if self.stopped or token_id in self._skip:
            return
        ids = self._ids
        ids.append(token_id)
        prefix_text = self._decoder.decode(ids[self._prefix_offset : self._read_offset])
        new_text = self._decoder.decode(ids[self._prefix_offset :])
        if len(new_text) <= len(prefix_text) or new_text.endswith("\ufffd"):
            return  # an incomplete character: wait for the next token
        delta = new_text[len(prefix_text) :]
        self._prefix_offset = self._read_offset
        self._read_offset = len(ids)
        if not self._stop:
            self.text += delta
            return
        # A match can only start in the held-back tail of the old text or in the delta.
        search_from = max(0, len(self.text) - self._holdback)
        self.text += delta
        hits = [i for i in (self.text.find(s, search_from) for s in self._stop) if i >= 0]
        if hits:
            self.text = self.text[: min(hits)]
            self.stopped = True

    def take(self, final: bool) -> str:
        """The text not yet emitted; while running, minus the held-back tail."""
        end = len(self.text) if final or self.stopped else len(self.text) - self._holdback
        if end <= self._emitted:
            return ""
        delta = self.text[self._emitted : end]
        self._emitted = end
        return delta

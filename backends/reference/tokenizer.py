"""Text <-> token ids for the reference backend.

The default is the gateway's own default tokenizer (``classifiers.tokenizers.default_tokenizer``:
the offline cl100k_base, ``encode_ordinary``), so a prompt's count here equals the gateway's
price. A torch executor loaded from a Hugging Face directory brings its own tokenizer instead.
"""

from __future__ import annotations

from collections.abc import Sequence

import tiktoken


class TiktokenText:
    """Encodes like the gateway (special-token text is ordinary text); decodes leniently.

    Satisfies ``backends.engine.types.TextTokenizer``.
    """

    def __init__(self, encoding: tiktoken.Encoding) -> None:
        self._enc = encoding
        self.n_vocab = encoding.n_vocab

    def encode(self, text: str) -> list[int]:
        return self._enc.encode_ordinary(text)

    def decode(self, ids: Sequence[int]) -> str:
        try:
            return self._enc.decode(list(ids))
        except KeyError:
            # An id the encoding does not define (a random-weight model may sample one): skip it
            # rather than fail the whole stream.
            return self._enc.decode([i for i in ids if self._valid(i)])

    def _valid(self, token_id: int) -> bool:
        try:
            self._enc.decode_single_token_bytes(token_id)
        except KeyError:
            return False
        return True


def default_tokenizer() -> TiktokenText:
    from classifiers.tokenizers import default_tokenizer as gateway_default

    return TiktokenText(gateway_default().encoding)

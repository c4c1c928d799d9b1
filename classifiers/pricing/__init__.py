"""Price a request in tokens before it runs, validating the body on the way.

A request's cost is ``prefill`` (prompt tokens) + ``decode`` (output tokens reserved); together
they approximate the KV-cache footprint the request pins at completion. Every malformed body is an
`InvalidRequest` (a 400 with a message and the offending ``param``); pricing raises nothing else.

`Pricer` is the one entry point: an ``aprice_*`` coroutine per API. The rules live beside the code
that applies them:

* chat.py: ``/v1/chat/completions`` (and the prompt rules the others reuse);
* responses.py: ``/v1/responses``;
* completions.py: ``/v1/completions`` and ``/v1/embeddings``;
* passthrough.py: allow-listed pass-through POSTs (never refused);
* validation.py: what every walk shares: the output reserved (decode rules), choices, context
  length, prompt log-probabilities, and the bounds on hostile input;
* media.py: what an image costs and which media URLs the engine may fetch;
* values.py: how client values are named, echoed and serialized in those checks;
* encoding.py: long never-seen texts tokenized off the event loop; tokenizing.py: which tokenizer
  counts.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from classifiers.images import ImageRule
from classifiers.pricing import chat, completions, passthrough, responses
from classifiers.pricing.cost import Cost, InvalidRequest
from classifiers.pricing.encoding import Encoder
from classifiers.pricing.media import check_passthrough_media
from classifiers.pricing.responses import CLIENT_TOOLS
from classifiers.pricing.settings import PricingSettings, Rules
from classifiers.pricing.tokenizing import SafeTokenizers
from classifiers.pricing.validation import MAX_CHOICES, check_envelope
from classifiers.pricing.values import MAX_JSON_DEPTH
from classifiers.tokenizers import Tokenizer, TokenizerRegistry

__all__ = [
    "CLIENT_TOOLS",
    "MAX_CHOICES",
    "MAX_JSON_DEPTH",
    "Cost",
    "InvalidRequest",
    "Pricer",
    "PricingSettings",
]


class Pricer:
    """Prices request bodies in tokens (rules: the package docstring's modules).

    Each ``aprice_*`` validates its body and prices it, tokenizing long never-seen texts in a small
    fair thread pool so the event loop keeps serving other requests meanwhile (encoding.py); a
    short request is priced at once, with no thread hop and no suspension of the caller.
    ``fair_key`` (the gateway passes the tenant) shares that pool fairly and scopes the tokenizer's
    memo. `close` stops the pool at shutdown; pricing keeps working afterwards, always inline.
    """

    def __init__(
        self,
        tokenizers: TokenizerRegistry,
        settings: PricingSettings = PricingSettings(),
        images: Sequence[tuple[str, ImageRule]] = (),
        vocab_sizes: Sequence[tuple[str, int]] = (),
    ) -> None:
        """``images``: (model glob, rule) pairs, first match wins; other models' images cost
        ``settings.image_tokens`` each. ``vocab_sizes``: (model glob, vocabulary size) pairs; a
        matching model's requests carry token ids below it (validation.py, "Hostile input")."""
        self._tokenizers = tokenizers
        self._safe = SafeTokenizers(tokenizers)
        self._rules = Rules.of(settings, images, vocab_sizes)
        self._encoder = Encoder(settings)

    @property
    def settings(self) -> PricingSettings:
        return self._rules.settings

    async def aprice_chat(
        self,
        body: Mapping[str, Any],
        *,
        default_max_tokens: int,
        max_tokens_limit: int | None,
        context_length: int,
        fair_key: str = "",
    ) -> Cost:
        """Price ``POST /v1/chat/completions`` (chat.py)."""
        tok = self._tokenizer(body)
        rules = self._rules
        return await self._encoder.price(
            lambda t: chat.walk(rules, t, body, default_max_tokens, max_tokens_limit, context_length),
            tok,
            fair_key,
        )

    async def aprice_completion(
        self,
        body: Mapping[str, Any],
        *,
        default_max_tokens: int,
        max_tokens_limit: int | None,
        context_length: int,
        fair_key: str = "",
    ) -> Cost:
        """Price ``POST /v1/completions`` (completions.py)."""
        tok = self._tokenizer(body)
        rules = self._rules
        return await self._encoder.price(
            lambda t: completions.walk_completion(
                rules, t, body, default_max_tokens, max_tokens_limit, context_length
            ),
            tok,
            fair_key,
        )

    async def aprice_embeddings(
        self, body: Mapping[str, Any], *, context_length: int | None = None, fair_key: str = ""
    ) -> Cost:
        """Price ``POST /v1/embeddings`` (completions.py); decode is 0."""
        tok = self._tokenizer(body)
        rules = self._rules
        return await self._encoder.price(
            lambda t: completions.walk_embeddings(rules, t, body, context_length), tok, fair_key
        )

    async def aprice_responses(
        self,
        body: Mapping[str, Any],
        *,
        default_max_tokens: int,
        max_tokens_limit: int | None,
        context_length: int,
        fair_key: str = "",
    ) -> Cost:
        """Price ``POST /v1/responses`` like chat (responses.py).

        Only what the body shows is priced: ``previous_response_id``, ``conversation`` and
        ``item_reference`` items make the server prepend state the gateway cannot see (unless
        ``server_state_at_context``: then such a request holds the whole context).
        """
        tok = self._tokenizer(body)
        rules = self._rules
        return await self._encoder.price(
            lambda t: responses.walk(rules, t, body, default_max_tokens, max_tokens_limit, context_length),
            tok,
            fair_key,
        )

    async def aprice_passthrough(
        self,
        body_bytes: bytes,
        *,
        model: str | None,
        default_max_tokens: int,
        generates: bool = True,
        context_length: int | None = None,
        fair_key: str = "",
    ) -> Cost:
        """A conservative price for an allow-listed pass-through POST (passthrough.py); never raises.

        ``model``: a model the gateway serves (its tokenizer counts), or None (the byte estimate).
        ``generates``: whether the route can produce tokens when the body names no output limit.
        ``context_length``: when given, caps the decode at ``context_length - prefill``.
        """
        return await self._encoder.price(
            lambda t: passthrough.walk(t, body_bytes, default_max_tokens, generates, context_length),
            self._safe.for_model(model),
            fair_key,
        )

    def check_passthrough_media(self, raw: bytes, body: Mapping[str, Any]) -> None:
        """A pass-through JSON body (``raw``, parsed as ``body``) names only media the engine may
        fetch (media.py)."""
        check_passthrough_media(self._rules.settings, raw, body)

    def encode_backlog(self) -> dict[str, int]:
        """Characters waiting for an encode thread, per ``fair_key`` (tenant) with any; for /stats."""
        return self._encoder.backlog()

    def estimates(self) -> dict[str, object]:
        """Estimate mode (estimate.py), for /stats: the learned tokens-per-character ratios and how
        far the exact counts were from the estimates."""
        return {
            "above_chars": self._rules.settings.estimate_above_chars,
            "margin_percent": self._rules.settings.estimate_margin_percent,
            "ratios": self._encoder.ratios.snapshot(),
            **self._encoder.errors.snapshot(),
        }

    def close(self) -> None:
        """Stop the encode pool; idempotent. Call it at shutdown.

        Encodes still queued are cancelled and their callers count those texts inline instead;
        encodes already running finish first (each is one text, at most one request body long), so
        this returns within one encode. Pricing keeps working afterwards, always inline.
        """
        self._encoder.close()

    def _tokenizer(self, body: Mapping[str, Any]) -> Tokenizer:
        return self._safe.for_model(check_envelope(body))

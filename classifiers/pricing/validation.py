"""Checks every API's walk shares: the body's envelope, the output it asks for, and hostile input.

Decode rules
------------
Per choice, the request asks for ``max_completion_tokens``, else ``max_tokens``, else the
``default_max_tokens`` given by the caller (a tenant/class setting). Asking for more than
``max_tokens_limit`` is an error; the default is silently clamped to it. Each sequence's per-choice
reservation is capped at ``context_length - prompt tokens`` (never below 0), and multiplied by the
number of choices: ``max(n, best_of)`` (chat too: vLLM's chat API runs ``best_of`` sequences); both
are at most ``MAX_CHOICES`` (128, OpenAI's limit), so no cost can leave 64-bit integers. A prompt
longer than ``context_length`` is rejected (code ``context_length_exceeded``).

Prompt log-probabilities (vLLM's ``prompt_logprobs``, in chat and completions; completions' ``echo``
with ``logprobs``) make the engine compute the logits of every prompt token over the whole
vocabulary at once, a ``[prompt tokens x vocabulary]`` float32 tensor outside the KV cache its
memory profile reserved (~7.5 GiB for 8,192 tokens of a 152k vocabulary: enough to crash a shared
engine, vLLM issues #5907, #38830). They are refused (code ``prompt_logprobs_too_long``) for a prompt
(each prompt, in completions) longer than ``max_prompt_logprobs_tokens``.

Hostile input
-------------
``stop`` and vLLM's ``bad_words`` (chat, completions) are each a string or at most
``max_stop_sequences`` strings of at most ``max_stop_chars`` characters, ``logit_bias`` an object
of at most ``max_logit_bias`` entries (0: no bound): an engine pays for them on every decode step,
and the requests beside this one wait. Token ids a request carries are the engine's array indices on
the device, where one out of range can take the whole engine down (or write into the other requests'
rows): ``logit_bias`` keys are decimal digits and its values numbers; ``stop_token_ids`` and
``allowed_token_ids`` are arrays of integers, at most ``max_stop_token_ids`` (128) and
``max_allowed_token_ids`` (1,024), the widths of vLLM's sampler rows; every one of these ids, and
the token ids of a prompt, is non-negative and, for a model with ``vocab_size``
(``Pricer(vocab_sizes=)``, config ``models.<glob>.vocab_size``), below it. A request holds at most
``max_items`` elements (messages and parts, prompts, input items).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from classifiers.pricing.cost import InvalidRequest
from classifiers.pricing.settings import PricingSettings, Rules
from classifiers.pricing.values import MAX_TOKEN_ID, is_int, kind, show_value

# OpenAI's limit on `n` / `best_of`; it also keeps every cost far inside 64-bit integers.
MAX_CHOICES = 128

# Strings an engine looks for on every decode step: `stop` (searched in the new text) and vLLM's
# `bad_words` (each a token sequence its logits processor checks); bounded alike.
_STEP_STRINGS = ("stop", "bad_words")


def check_envelope(body: Mapping[str, Any]) -> str:
    """The model a body names, once the fields every API shares (``model``, ``stream``,
    ``stream_options``) are well formed."""
    if not isinstance(body, Mapping):
        raise InvalidRequest(f"the request body must be a JSON object, got {kind(body)}")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise InvalidRequest(
            f"'model' must be a non-empty string naming the model, got {kind(model)}", param="model"
        )
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise InvalidRequest(f"'stream' must be true or false, got {kind(stream)}", param="stream")
    options = body.get("stream_options")
    if options is not None:
        if stream is not True:
            raise InvalidRequest(
                "'stream_options' is only allowed when 'stream' is true; remove it or set \"stream\": true",
                param="stream_options",
            )
        if not isinstance(options, dict):
            raise InvalidRequest(
                f"'stream_options' must be an object, got {kind(options)}", param="stream_options"
            )
    return model


def count_choices(body: Mapping[str, Any]) -> int:
    """How many sequences the request runs: ``max(n, best_of)``, each at most ``MAX_CHOICES``."""
    n = _choice_count(body, "n")
    if body.get("best_of") is None:
        return n
    best_of = _choice_count(body, "best_of")
    if best_of < n:
        raise InvalidRequest(
            f"'best_of' ({best_of}) must be greater than or equal to 'n' ({n})", param="best_of"
        )
    return best_of


def _choice_count(body: Mapping[str, Any], key: str) -> int:
    value = body.get(key)
    if value is None:
        return 1
    if not is_int(value) or value < 1:
        raise InvalidRequest(f"'{key}' must be a positive integer, got {show_value(value)}", param=key)
    if value > MAX_CHOICES:
        raise InvalidRequest(
            f"'{key}' is {show_value(value)}, above the limit of {MAX_CHOICES} choices per request; "
            f"set '{key}' to {MAX_CHOICES} or less",
            param=key,
        )
    return int(value)


def requested_max(body: Mapping[str, Any], keys: tuple[str, ...]) -> tuple[int | None, str]:
    """The output limit the body asks for under the first of ``keys`` it sets, and that key."""
    for key in keys:
        value = body.get(key)
        if value is None:
            continue
        if not is_int(value) or value < 0:
            raise InvalidRequest(
                f"'{key}' must be a non-negative integer, got {show_value(value)}", param=key
            )
        return int(value), key
    return None, keys[-1]


def limit_per_choice(requested: int | None, key: str, default: int, limit: int | None) -> int:
    """The output tokens one sequence may produce: what was asked for (within ``limit``), else the
    default clamped to it."""
    if requested is None:
        return default if limit is None else min(default, limit)
    if limit is not None and requested > limit:
        raise InvalidRequest(
            f"'{key}' is {show_value(requested)}, above this deployment's limit of {limit} output tokens per "
            f"choice; set '{key}' to {limit} or less",
            param=key,
        )
    return requested


def check_context(prompt_tokens: int, context_length: int, param: str) -> None:
    if prompt_tokens > context_length:
        raise InvalidRequest(
            f"this model's maximum context length is {context_length} tokens, but the prompt has "
            f"about {prompt_tokens} tokens; shorten the {param}",
            param=param,
            code="context_length_exceeded",
        )


def check_step_work(rules: Rules, body: Mapping[str, Any]) -> None:
    """``stop`` and ``logit_bias`` within ``max_stop_sequences`` / ``max_stop_chars`` /
    ``max_logit_bias``: what they cost the engine is paid on every step, and by the requests
    beside this one too (one loop streams them all), so a budget in tokens does not bound it.
    The token ids in ``logit_bias``, ``stop_token_ids`` and ``allowed_token_ids`` are token ids
    of the model (`check_token_ids`), the two lists within their own bounds."""
    s = rules.settings
    for key in _STEP_STRINGS:
        value = body.get(key)
        if value is None:
            continue
        seqs = [value] if isinstance(value, str) else value
        if not isinstance(seqs, list) or not all(isinstance(x, str) for x in seqs):
            raise InvalidRequest(
                f"'{key}' must be a string or an array of strings, got {kind(value)}", param=key
            )
        if s.max_stop_sequences and len(seqs) > s.max_stop_sequences:
            raise InvalidRequest(
                f"'{key}' has {len(seqs)} strings, above the limit of {s.max_stop_sequences} "
                "(pricing.max_stop_sequences); send fewer",
                param=key,
            )
        longest = max(map(len, seqs), default=0)
        if s.max_stop_chars and longest > s.max_stop_chars:
            raise InvalidRequest(
                f"a '{key}' string is {longest} characters long, above the limit of "
                f"{s.max_stop_chars} (pricing.max_stop_chars); shorten it",
                param=key,
            )
    bias = body.get("logit_bias")
    if bias is not None:
        if not isinstance(bias, dict):
            raise InvalidRequest(
                f"'logit_bias' must be an object mapping token ids to biases, got {kind(bias)}",
                param="logit_bias",
            )
        if s.max_logit_bias and len(bias) > s.max_logit_bias:
            raise InvalidRequest(
                f"'logit_bias' has {len(bias)} entries, above the limit of {s.max_logit_bias} "
                "(pricing.max_logit_bias); send fewer",
                param="logit_bias",
            )
        if bias:
            check_token_ids(rules, body, _bias_ids(bias), "logit_bias")
    for key, most, setting in (
        ("stop_token_ids", s.max_stop_token_ids, "max_stop_token_ids"),
        ("allowed_token_ids", s.max_allowed_token_ids, "max_allowed_token_ids"),
    ):
        ids = body.get(key)
        if ids is None:
            continue
        if not isinstance(ids, list):
            raise InvalidRequest(
                f"'{key}' must be an array of token ids (integers), got {kind(ids)}", param=key
            )
        if most and len(ids) > most:  # (counted before a million ids are looked at)
            raise InvalidRequest(
                f"'{key}' has {len(ids)} token ids, above the limit of {most} (pricing.{setting}); "
                "send fewer",
                param=key,
            )
        if not all(type(t) is int for t in ids):
            raise InvalidRequest(
                f"'{key}' must be an array of token ids (integers), got {kind(ids)}", param=key
            )
        if ids:
            check_token_ids(rules, body, ids, key)


def _bias_ids(bias: Mapping[Any, Any]) -> list[int]:
    """The token ids of a ``logit_bias`` object, whose keys are ids written in decimal and whose
    values are numbers."""
    ids = []
    for key, value in bias.items():
        if not (isinstance(key, str) and key.isascii() and key.isdigit() and len(key) <= 20):
            raise InvalidRequest(
                f"'logit_bias' keys must be token ids written in decimal digits, got {show_value(key)}",
                param="logit_bias",
            )
        if type(value) not in (int, float):
            raise InvalidRequest(
                f"'logit_bias' values must be numbers (-100 to 100), got {kind(value)} for token {key}",
                param="logit_bias",
            )
        ids.append(int(key))
    return ids


def check_token_ids(rules: Rules, body: Mapping[str, Any], ids: list[int], param: str) -> None:
    """Every id in [0, the model's ``vocab_size``) (without one: [0, 2**63)). An engine indexes
    its logits (or embeddings) with them on the device: an id out of range crashed vLLM's whole
    engine, or wrote into other requests' rows of the batch (vLLM #54195, #16529)."""
    low, high = min(ids), max(ids)
    if low < 0:
        raise InvalidRequest(f"'{param}' holds the token id {low}; token ids are never negative", param=param)
    vocab = rules.vocab.get(body["model"]) if rules.vocab else None
    if vocab is not None and high >= vocab:
        raise InvalidRequest(
            f"'{param}' holds the token id {high}, outside the vocabulary of model "
            f"{show_value(body['model'])}: {vocab} tokens, ids 0 to {vocab - 1} (models.*.vocab_size)",
            param=param,
        )
    if high > MAX_TOKEN_ID:
        raise InvalidRequest(
            f"'{param}' holds the token id {show_value(high)}, above the largest token id {MAX_TOKEN_ID}",
            param=param,
        )


def check_items(settings: PricingSettings, items: list[Any], param: str, what: str) -> None:
    """At most ``max_items`` elements: ``items`` and the parts of each (its ``content`` or
    ``output`` array), counted before any is walked."""
    most = settings.max_items
    if not most:
        return
    n = len(items)
    exact = n <= most
    if exact:  # (else the parts are not even counted)
        for item in items:
            if isinstance(item, dict):
                parts = item.get("content")
                if not isinstance(parts, list):
                    parts = item.get("output")
                if isinstance(parts, list):
                    n += len(parts)
    if n > most:
        raise InvalidRequest(
            f"'{param}' holds {'' if exact else 'at least '}{n} {what}, above this deployment's limit "
            f"of {most} (pricing.max_items); send fewer, or split the request",
            param=param,
        )


def check_prompt_logprobs(
    settings: PricingSettings, body: Mapping[str, Any], prompt_tokens: int, echo_counts: bool
) -> None:
    """Prompt log-probabilities only for prompts of at most ``max_prompt_logprobs_tokens`` (module
    docstring). Asked for by any ``prompt_logprobs`` that is not null (0 and false too: the
    engine reads them as 0, which still computes the full-vocabulary logits), and in completions
    by ``echo`` with ``logprobs``."""
    most = settings.max_prompt_logprobs_tokens
    if not most or prompt_tokens <= most:
        return
    if body.get("prompt_logprobs") is not None:
        param = "prompt_logprobs"
    elif echo_counts and body.get("echo") not in (None, False) and body.get("logprobs") is not None:
        param = "echo"
    else:
        return
    raise InvalidRequest(
        f"'{param}' asks for the log-probabilities of every prompt token, which the engine computes "
        f"over its whole vocabulary at once, outside the memory it keeps for requests; this "
        f"deployment allows that for prompts of at most {most} tokens "
        f"(pricing.max_prompt_logprobs_tokens), and this prompt has about {prompt_tokens}: "
        f"shorten the prompt, or remove '{param}'",
        param=param,
        code="prompt_logprobs_too_long",
    )

"""Pricing ``/v1/completions`` and ``/v1/embeddings``: prompts given as text or token ids.

Completions: each prompt is its own sequence. A string counts its tokens, a token-id array its
length; ``suffix`` adds its tokens to every prompt. A token id is an integer in [0, 2**63), and
below the model's ``vocab_size`` where one is configured; an empty token-id array inside an array
of them is refused (an empty string prompt is legal). ``prompt_embeds`` (vLLM) is refused (400
``unsupported_parameter``): how many tokens an embedding tensor holds depends on the model's hidden
size, which the gateway does not know. The output reserved follows validation.py's decode rules,
per prompt.

Embeddings: the same shapes for ``input``; or, instead of it, ``messages`` (vLLM's chat-style
embeddings request) priced like chat's prompt (parts, images, URLs and all); decode is 0.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from classifiers.pricing.chat import prompt_tokens
from classifiers.pricing.cost import Cost, InvalidRequest
from classifiers.pricing.settings import Rules
from classifiers.pricing.validation import (
    check_context,
    check_items,
    check_prompt_logprobs,
    check_step_work,
    check_token_ids,
    count_choices,
    limit_per_choice,
    requested_max,
)
from classifiers.pricing.values import MAX_TOKEN_ID, kind, token_ids
from classifiers.tokenizers import Tokenizer


def walk_completion(
    rules: Rules,
    tok: Tokenizer,
    body: Mapping[str, Any],
    default_max_tokens: int,
    max_tokens_limit: int | None,
    context_length: int,
) -> Cost:
    """Validate and price a completions request with ``tok``."""
    if body.get("prompt_embeds") is not None:
        raise InvalidRequest(
            "'prompt_embeds' is not accepted here: the gateway cannot tell how many tokens an "
            "embedding tensor holds, so it cannot price the request; send the prompt as text or "
            "token ids",
            param="prompt_embeds",
            code="unsupported_parameter",
        )
    check_step_work(rules, body)
    lengths = _prompt_lengths(rules, tok, body, "prompt")
    suffix = body.get("suffix")
    if suffix is not None:
        if not isinstance(suffix, str):
            raise InvalidRequest(f"'suffix' must be a string, got {kind(suffix)}", param="suffix")
        extra = tok.count(suffix)
        lengths = [n + extra for n in lengths]
    check_prompt_logprobs(rules.settings, body, max(lengths), echo_counts=True)
    choices = count_choices(body)
    requested, key = requested_max(body, ("max_completion_tokens", "max_tokens"))
    per_choice = limit_per_choice(requested, key, default_max_tokens, max_tokens_limit)
    check_context(max(lengths), context_length, "prompt")
    decode = sum(min(per_choice, context_length - n) for n in lengths) * choices
    return Cost(
        prefill=sum(lengths), decode=decode, per_choice=min(per_choice, context_length - max(lengths))
    )


def walk_embeddings(
    rules: Rules, tok: Tokenizer, body: Mapping[str, Any], context_length: int | None
) -> Cost:
    """Validate and price an embeddings request with ``tok``."""
    if body.get("messages") is not None:
        # vLLM's chat-style embeddings request (multimodal embedding models): its messages are
        # rendered by the chat template, and with an 'input' as well which one the engine embeds
        # depends on how its request union is parsed: one or the other, never both.
        if body.get("input") is not None:
            raise InvalidRequest(
                "send 'input' or 'messages' (a chat-style embeddings request), not both",
                param="messages",
            )
        prefill = prompt_tokens(rules, tok, body)
        if context_length is not None:
            check_context(prefill, context_length, "messages")
        return Cost(prefill=prefill, decode=0)
    lengths = _prompt_lengths(rules, tok, body, "input")
    if context_length is not None:
        check_context(max(lengths), context_length, "input")
    return Cost(prefill=sum(lengths), decode=0)


def _prompt_lengths(rules: Rules, tok: Tokenizer, body: Mapping[str, Any], param: str) -> list[int]:
    """Token length of each sequence in a prompt/input field (token ids checked against the
    model's vocabulary where it is configured)."""
    prompt = body.get(param)
    if isinstance(prompt, str):
        return [tok.count(prompt)]
    shapes = "a string, an array of strings, an array of token ids, or an array of token-id arrays"
    if not isinstance(prompt, list) or not prompt:
        raise InvalidRequest(
            f"'{param}' must be {shapes}; got {kind(prompt)}" + (" (empty)" if prompt == [] else ""),
            param=param,
        )
    first = prompt[0]
    if type(first) is not int:  # (a token-id array is one sequence, however long)
        check_items(rules.settings, prompt, param, "prompts" if param == "prompt" else "inputs")
    if isinstance(first, str):
        if not all(isinstance(p, str) for p in prompt):
            raise InvalidRequest(
                f"'{param}' mixes strings with other values; it must be {shapes}", param=param
            )
        return [tok.count(p) for p in prompt]
    if type(first) is int:
        if not token_ids(prompt):
            raise InvalidRequest(
                f"'{param}' looks like token ids but holds something other than a token id "
                f"(an integer from 0 to {MAX_TOKEN_ID})",
                param=param,
            )
        if rules.vocab:
            check_token_ids(rules, body, prompt, param)
        return [len(prompt)]
    if isinstance(first, list):
        lengths = []
        for i, ids in enumerate(prompt):
            if not isinstance(ids, list) or not token_ids(ids):
                raise InvalidRequest(
                    f"{param}[{i}] must be an array of token ids (integers from 0 to {MAX_TOKEN_ID}); "
                    f"'{param}' must be {shapes}",
                    param=param,
                )
            if not ids:
                raise InvalidRequest(
                    f"{param}[{i}] is an empty token-id array; every sequence needs at least one token",
                    param=param,
                )
            if rules.vocab:
                check_token_ids(rules, body, ids, param)
            lengths.append(len(ids))
        return lengths
    raise InvalidRequest(f"'{param}' must be {shapes}; got an array of {kind(first)}", param=param)

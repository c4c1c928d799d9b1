"""Price a request in tokens before it runs, validating the body on the way.

A request's cost is ``prefill`` (prompt tokens) + ``decode`` (output tokens reserved); together
they approximate the KV-cache footprint the request pins at completion.

Prefill rules
-------------
Chat (``/v1/chat/completions``), following the OpenAI cookbook's counting rules:

* each message: ``per_message_tokens`` + tokens(role) + content tokens;
  a ``name`` adds ``per_name_tokens`` + tokens(name);
  each assistant ``tool_calls`` entry adds ``per_tool_call_tokens`` + tokens(function name)
  + tokens(arguments); a legacy ``function_call`` counts the same way;
* content: a string counts its tokens; a list of parts sums its parts: ``text`` / ``refusal``
  parts count their text, ``image_url`` costs ``image_tokens``, ``input_audio`` / ``audio_url``
  ``audio_tokens``, ``video_url`` ``video_tokens``, ``file`` ``file_tokens``;
* ``reply_priming_tokens`` once (the assistant header the model is primed with);
* ``tools`` / ``functions``: tokens of their compact JSON + ``tools_overhead_tokens``;
* ``response_format`` of type ``json_schema``: tokens of the schema object's compact JSON.

Completions (``/v1/completions``): each prompt is its own sequence. A string counts its tokens,
a token-id array its length; ``suffix`` adds its tokens to every prompt.
Embeddings: the same shapes for ``input``; decode is 0.

Decode rules
------------
Per choice, the request asks for ``max_completion_tokens``, else ``max_tokens``, else the
``default_max_tokens`` given by the caller (a tenant/class setting). Asking for more than
``max_tokens_limit`` is an error; the default is silently clamped to it. Each sequence's per-choice
reservation is capped at ``context_length - prompt tokens`` (never below 0), and multiplied by the
number of choices: ``n``, or for completions ``max(n, best_of)``. A prompt longer than
``context_length`` is rejected (code ``context_length_exceeded``).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import orjson

from classifiers.tokenizers import Tokenizer, TokenizerRegistry

__all__ = ["Cost", "InvalidRequest", "Pricer", "PricingSettings"]


@dataclass(frozen=True, slots=True)
class Cost:
    prefill: int
    decode: int

    @property
    def total(self) -> int:
        return self.prefill + self.decode


class InvalidRequest(Exception):
    """A malformed or unservable body; the gateway turns it into an OpenAI-style 400."""

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code

    def __repr__(self) -> str:
        return f"InvalidRequest({self.message!r}, param={self.param!r}, code={self.code!r})"


@dataclass(frozen=True)
class PricingSettings:
    per_message_tokens: int = 3
    per_name_tokens: int = 1
    reply_priming_tokens: int = 3
    per_tool_call_tokens: int = 3
    tools_overhead_tokens: int = 9
    image_tokens: int = 765
    audio_tokens: int = 1000
    video_tokens: int = 4096
    file_tokens: int = 4096


_JSON_TYPE = {
    dict: "object",
    list: "array",
    str: "string",
    int: "integer",
    float: "number",
    bool: "boolean",
    type(None): "null",
}


def _kind(value: object) -> str:
    return _JSON_TYPE.get(type(value), type(value).__name__)


def _is_int(value: object) -> bool:
    # bool is a subclass of int, but `"max_tokens": true` is a client bug, not a number.
    return type(value) is int


def _compact_json(value: object) -> str:
    try:
        return orjson.dumps(value).decode()
    except TypeError:  # e.g. integers beyond 64 bits, which orjson refuses
        return json.dumps(value, separators=(",", ":"), ensure_ascii=False, default=str)


def _token_ids(value: list[Any]) -> bool:
    """True when `value` is a list of non-negative ints (a pre-tokenized prompt)."""
    return all(type(t) is int for t in value) and (not value or min(value) >= 0)


class Pricer:
    def __init__(self, tokenizers: TokenizerRegistry, settings: PricingSettings = PricingSettings()) -> None:
        self._tokenizers = tokenizers
        self._s = settings
        self._part_constants = {
            "image_url": settings.image_tokens,
            "input_audio": settings.audio_tokens,
            "audio_url": settings.audio_tokens,
            "video_url": settings.video_tokens,
            "file": settings.file_tokens,
        }

    @property
    def settings(self) -> PricingSettings:
        return self._s

    # ---- public entry points -------------------------------------------------------------

    def price_chat(
        self,
        body: Mapping[str, Any],
        *,
        default_max_tokens: int,
        max_tokens_limit: int | None,
        context_length: int,
    ) -> Cost:
        tok = self._tokenizer(body)
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise InvalidRequest(
                f"'messages' must be a non-empty array of message objects, got {_kind(messages)}"
                + (" (empty)" if messages == [] else ""),
                param="messages",
            )
        prefill = self._s.reply_priming_tokens
        for i, message in enumerate(messages):
            prefill += self._message_tokens(tok, message, f"messages[{i}]")
        prefill += self._tools_tokens(tok, body, "tools")
        prefill += self._tools_tokens(tok, body, "functions")
        prefill += self._response_format_tokens(tok, body)
        choices = self._choices(body, allow_best_of=False)
        requested, key = self._requested_max(body)
        per_choice = self._per_choice(requested, key, default_max_tokens, max_tokens_limit)
        self._check_context(prefill, context_length, "messages")
        return Cost(prefill=prefill, decode=min(per_choice, context_length - prefill) * choices)

    def price_completion(
        self,
        body: Mapping[str, Any],
        *,
        default_max_tokens: int,
        max_tokens_limit: int | None,
        context_length: int,
    ) -> Cost:
        tok = self._tokenizer(body)
        lengths = self._prompt_lengths(tok, body.get("prompt"), "prompt")
        suffix = body.get("suffix")
        if suffix is not None:
            if not isinstance(suffix, str):
                raise InvalidRequest(f"'suffix' must be a string, got {_kind(suffix)}", param="suffix")
            extra = tok.count(suffix)
            lengths = [n + extra for n in lengths]
        choices = self._choices(body, allow_best_of=True)
        requested, key = self._requested_max(body)
        per_choice = self._per_choice(requested, key, default_max_tokens, max_tokens_limit)
        self._check_context(max(lengths), context_length, "prompt")
        decode = sum(min(per_choice, context_length - n) for n in lengths) * choices
        return Cost(prefill=sum(lengths), decode=decode)

    def price_embeddings(self, body: Mapping[str, Any], *, context_length: int | None = None) -> Cost:
        tok = self._tokenizer(body)
        lengths = self._prompt_lengths(tok, body.get("input"), "input")
        if context_length is not None:
            self._check_context(max(lengths), context_length, "input")
        return Cost(prefill=sum(lengths), decode=0)

    # ---- common fields -------------------------------------------------------------------

    def _tokenizer(self, body: Mapping[str, Any]) -> Tokenizer:
        if not isinstance(body, Mapping):
            raise InvalidRequest(f"the request body must be a JSON object, got {_kind(body)}")
        model = body.get("model")
        if not isinstance(model, str) or not model:
            raise InvalidRequest(
                f"'model' must be a non-empty string naming the model, got {_kind(model)}", param="model"
            )
        stream = body.get("stream")
        if stream is not None and not isinstance(stream, bool):
            raise InvalidRequest(f"'stream' must be true or false, got {_kind(stream)}", param="stream")
        options = body.get("stream_options")
        if options is not None:
            if stream is not True:
                raise InvalidRequest(
                    "'stream_options' is only allowed when 'stream' is true; remove it or set \"stream\": true",
                    param="stream_options",
                )
            if not isinstance(options, dict):
                raise InvalidRequest(
                    f"'stream_options' must be an object, got {_kind(options)}", param="stream_options"
                )
        return self._tokenizers.for_model(model)

    def _choices(self, body: Mapping[str, Any], *, allow_best_of: bool) -> int:
        n = body.get("n")
        if n is None:
            n = 1
        elif not _is_int(n) or n < 1:
            raise InvalidRequest(f"'n' must be a positive integer, got {n!r}", param="n")
        if not allow_best_of:
            return int(n)
        best_of = body.get("best_of")
        if best_of is None:
            return int(n)
        if not _is_int(best_of) or best_of < 1:
            raise InvalidRequest(f"'best_of' must be a positive integer, got {best_of!r}", param="best_of")
        if best_of < n:
            raise InvalidRequest(
                f"'best_of' ({best_of}) must be greater than or equal to 'n' ({n})", param="best_of"
            )
        return int(best_of)

    def _requested_max(self, body: Mapping[str, Any]) -> tuple[int | None, str]:
        for key in ("max_completion_tokens", "max_tokens"):
            value = body.get(key)
            if value is None:
                continue
            if not _is_int(value) or value < 0:
                raise InvalidRequest(f"'{key}' must be a non-negative integer, got {value!r}", param=key)
            return int(value), key
        return None, "max_tokens"

    def _per_choice(self, requested: int | None, key: str, default: int, limit: int | None) -> int:
        if requested is None:
            return default if limit is None else min(default, limit)
        if limit is not None and requested > limit:
            raise InvalidRequest(
                f"'{key}' is {requested}, above this deployment's limit of {limit} output tokens per "
                f"choice; set '{key}' to {limit} or less",
                param=key,
            )
        return requested

    def _check_context(self, prompt_tokens: int, context_length: int, param: str) -> None:
        if prompt_tokens > context_length:
            raise InvalidRequest(
                f"this model's maximum context length is {context_length} tokens, but the prompt has "
                f"about {prompt_tokens} tokens; shorten the {param}",
                param=param,
                code="context_length_exceeded",
            )

    # ---- chat ----------------------------------------------------------------------------

    def _message_tokens(self, tok: Tokenizer, message: object, where: str) -> int:
        if not isinstance(message, dict):
            raise InvalidRequest(
                f"{where} must be an object with 'role' and 'content', got {_kind(message)}", param=where
            )
        role = message.get("role")
        if not isinstance(role, str) or not role:
            raise InvalidRequest(
                f"{where}.role must be a non-empty string such as 'user', got {_kind(role)}",
                param=f"{where}.role",
            )
        n = self._s.per_message_tokens + tok.count(role)
        name = message.get("name")
        if name is not None:
            if not isinstance(name, str):
                raise InvalidRequest(
                    f"{where}.name must be a string, got {_kind(name)}", param=f"{where}.name"
                )
            n += self._s.per_name_tokens + tok.count(name)
        calls = self._tool_calls_tokens(tok, message, where)
        content = message.get("content")
        if isinstance(content, str):
            n += tok.count(content)
        elif isinstance(content, list):
            n += self._parts_tokens(tok, content, f"{where}.content")
        elif content is None:
            if role != "assistant" or calls is None:
                raise InvalidRequest(
                    f"{where}.content is required: give a string or an array of content parts "
                    "(it may be null only for an assistant message with tool_calls)",
                    param=f"{where}.content",
                )
        else:
            raise InvalidRequest(
                f"{where}.content must be a string, an array of content parts, or null (only for an "
                f"assistant message with tool_calls), got {_kind(content)}",
                param=f"{where}.content",
            )
        return n + (calls or 0)

    def _tool_calls_tokens(self, tok: Tokenizer, message: dict[str, Any], where: str) -> int | None:
        """Tokens of the assistant's tool_calls / legacy function_call; None when it has neither."""
        calls = message.get("tool_calls")
        legacy = message.get("function_call")
        if calls is None and legacy is None:
            return None
        total = 0
        if calls is not None:
            if not isinstance(calls, list):
                raise InvalidRequest(
                    f"{where}.tool_calls must be an array, got {_kind(calls)}", param=f"{where}.tool_calls"
                )
            for j, call in enumerate(calls):
                at = f"{where}.tool_calls[{j}]"
                if not isinstance(call, dict):
                    raise InvalidRequest(f"{at} must be an object, got {_kind(call)}", param=at)
                total += self._s.per_tool_call_tokens + self._function_tokens(
                    tok, call.get("function"), f"{at}.function"
                )
        if legacy is not None:
            total += self._s.per_tool_call_tokens + self._function_tokens(
                tok, legacy, f"{where}.function_call"
            )
        return total

    def _function_tokens(self, tok: Tokenizer, fn: object, where: str) -> int:
        if not isinstance(fn, dict):
            raise InvalidRequest(
                f"{where} must be an object with 'name' and 'arguments', got {_kind(fn)}", param=where
            )
        name = fn.get("name")
        if not isinstance(name, str):
            raise InvalidRequest(f"{where}.name must be a string, got {_kind(name)}", param=f"{where}.name")
        arguments = fn.get("arguments", "")
        if arguments is None:
            arguments = ""
        if not isinstance(arguments, str):
            raise InvalidRequest(
                f"{where}.arguments must be a JSON-encoded string, got {_kind(arguments)}",
                param=f"{where}.arguments",
            )
        return tok.count(name) + tok.count(arguments)

    def _parts_tokens(self, tok: Tokenizer, parts: list[Any], where: str) -> int:
        total = 0
        for j, part in enumerate(parts):
            at = f"{where}[{j}]"
            if not isinstance(part, dict):
                raise InvalidRequest(
                    f"{at} must be a content part object with a 'type', got {_kind(part)}", param=at
                )
            kind = part.get("type")
            if kind in ("text", "refusal"):
                text = part.get(kind)
                if not isinstance(text, str):
                    raise InvalidRequest(
                        f"{at}.{kind} must be a string for a '{kind}' part, got {_kind(text)}",
                        param=f"{at}.{kind}",
                    )
                total += tok.count(text)
                continue
            constant = self._part_constants.get(kind) if isinstance(kind, str) else None
            if constant is None:
                supported = ", ".join(["text", "refusal", *self._part_constants])
                raise InvalidRequest(
                    f"{at}.type must be one of {supported}; got {kind!r}", param=f"{at}.type"
                )
            if not isinstance(part.get(kind), dict | str):
                raise InvalidRequest(
                    f"{at}.{kind} must be an object describing the {kind} part, got {_kind(part.get(kind))}",
                    param=f"{at}.{kind}",
                )
            total += constant
        return total

    def _tools_tokens(self, tok: Tokenizer, body: Mapping[str, Any], key: str) -> int:
        tools = body.get(key)
        if tools is None:
            return 0
        if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
            raise InvalidRequest(f"'{key}' must be an array of objects, got {_kind(tools)}", param=key)
        if not tools:
            return 0
        return self._s.tools_overhead_tokens + tok.count(_compact_json(tools))

    def _response_format_tokens(self, tok: Tokenizer, body: Mapping[str, Any]) -> int:
        fmt = body.get("response_format")
        if fmt is None:
            return 0
        if not isinstance(fmt, dict) or not isinstance(fmt.get("type"), str):
            raise InvalidRequest(
                "'response_format' must be an object with a string 'type' (text, json_object or json_schema)",
                param="response_format",
            )
        if fmt["type"] != "json_schema":
            return 0
        schema = fmt.get("json_schema")
        if not isinstance(schema, dict):
            raise InvalidRequest(
                f"'response_format.json_schema' must be an object, got {_kind(schema)}",
                param="response_format.json_schema",
            )
        return tok.count(_compact_json(schema))

    # ---- completions / embeddings ----------------------------------------------------------

    def _prompt_lengths(self, tok: Tokenizer, prompt: object, param: str) -> list[int]:
        """Token length of each sequence in a prompt/input field."""
        if isinstance(prompt, str):
            return [tok.count(prompt)]
        shapes = "a string, an array of strings, an array of token ids, or an array of token-id arrays"
        if not isinstance(prompt, list) or not prompt:
            raise InvalidRequest(
                f"'{param}' must be {shapes}; got {_kind(prompt)}" + (" (empty)" if prompt == [] else ""),
                param=param,
            )
        first = prompt[0]
        if isinstance(first, str):
            if not all(isinstance(p, str) for p in prompt):
                raise InvalidRequest(
                    f"'{param}' mixes strings with other values; it must be {shapes}", param=param
                )
            return [tok.count(p) for p in prompt]
        if type(first) is int:
            if not _token_ids(prompt):
                raise InvalidRequest(
                    f"'{param}' looks like token ids but holds something other than non-negative integers",
                    param=param,
                )
            return [len(prompt)]
        if isinstance(first, list):
            lengths = []
            for i, ids in enumerate(prompt):
                if not isinstance(ids, list) or not _token_ids(ids):
                    raise InvalidRequest(
                        f"{param}[{i}] must be an array of non-negative integer token ids; '{param}' must be {shapes}",
                        param=param,
                    )
                lengths.append(len(ids))
            return lengths
        raise InvalidRequest(f"'{param}' must be {shapes}; got an array of {_kind(first)}", param=param)

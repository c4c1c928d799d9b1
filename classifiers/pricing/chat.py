"""Pricing ``/v1/chat/completions``, following the OpenAI cookbook's counting rules.

* each message: ``per_message_tokens`` + tokens(role) + content tokens;
  a ``name`` adds ``per_name_tokens`` + tokens(name);
  each assistant ``tool_calls`` entry adds ``per_tool_call_tokens`` + tokens(function name)
  + tokens(arguments); a legacy ``function_call`` counts the same way;
* content: a string counts its tokens; a list of parts sums its parts: ``text`` / ``refusal``
  parts count their text, ``image_url`` costs what the model's image rule says (media.py)
  or ``image_tokens``, ``input_audio`` / ``audio_url``
  ``audio_tokens``, ``video_url`` ``video_tokens``, ``file`` ``file_tokens``;
* any other fields of a message (``reasoning_content`` / ``reasoning`` of earlier turns,
  ``tool_call_id``, whatever key an engine's chat template reads): the tokens of the compact JSON
  object of those that are not null;
* ``reply_priming_tokens`` once (the assistant header the model is primed with);
* ``tools`` / ``functions``: tokens of their compact JSON + ``tools_overhead_tokens``;
* ``response_format`` of type ``json_schema``: tokens of the schema object's compact JSON;
* ``documents`` and ``chat_template_kwargs`` (vLLM / SGLang: the chat template renders them into
  the prompt): tokens of their compact JSON;
* a ``chat_template`` sent with the request is refused (400 ``unsupported_parameter``): it can make
  a prompt of any length out of the same messages, so nothing in the body bounds its cost.

The output reserved follows validation.py's decode rules. The Responses API and chat-style
embeddings reuse the prompt rules here.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from classifiers.images import ImageRule
from classifiers.pricing.cost import Cost, InvalidRequest
from classifiers.pricing.media import check_media_url, image_rule, image_tokens
from classifiers.pricing.settings import Rules
from classifiers.pricing.validation import (
    check_context,
    check_items,
    check_prompt_logprobs,
    check_step_work,
    count_choices,
    limit_per_choice,
    requested_max,
)
from classifiers.pricing.values import compact_json, kind, show_value
from classifiers.tokenizers import Tokenizer

# Engine extensions a chat template renders into the prompt: (field, its shape's check, the shape).
_TEMPLATE_INPUTS: tuple[tuple[str, Callable[[Any], bool], str], ...] = (
    (
        "documents",
        lambda v: isinstance(v, list) and all(isinstance(d, dict) for d in v),
        'an array of objects (e.g. {"title": ..., "text": ...})',
    ),
    ("chat_template_kwargs", lambda v: isinstance(v, dict), "an object"),
)

# A chat message's fields that _message_tokens counts by their own rules; any other one is counted
# whole (_other_message_fields_tokens).
_COUNTED_MESSAGE_FIELDS = frozenset(("role", "content", "name", "tool_calls", "function_call"))

# Chat content parts whose value is a URL (or an object with a "url") the engine fetches.
_URL_PARTS = frozenset(("image_url", "audio_url", "video_url"))


def walk(
    rules: Rules,
    tok: Tokenizer,
    body: Mapping[str, Any],
    default_max_tokens: int,
    max_tokens_limit: int | None,
    context_length: int,
) -> Cost:
    """Validate and price a chat request with ``tok``."""
    prefill = prompt_tokens(rules, tok, body)
    check_step_work(rules, body)
    check_prompt_logprobs(rules.settings, body, prefill, echo_counts=False)
    choices = count_choices(body)
    requested, key = requested_max(body, ("max_completion_tokens", "max_tokens"))
    per_choice = limit_per_choice(requested, key, default_max_tokens, max_tokens_limit)
    check_context(prefill, context_length, "messages")
    each = min(per_choice, context_length - prefill)
    return Cost(prefill=prefill, decode=each * choices, per_choice=each)


def prompt_tokens(rules: Rules, tok: Tokenizer, body: Mapping[str, Any]) -> int:
    """The prompt a chat template renders from ``messages`` and what else it reads."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise InvalidRequest(
            f"'messages' must be a non-empty array of message objects, got {kind(messages)}"
            + (" (empty)" if messages == [] else ""),
            param="messages",
        )
    check_items(rules.settings, messages, "messages", "messages and content parts")
    prefill = rules.settings.reply_priming_tokens
    images = image_rule(rules, body)
    for i, message in enumerate(messages):
        prefill += _message_tokens(rules, tok, message, f"messages[{i}]", images)
    prefill += tools_tokens(rules, tok, body, "tools")
    prefill += tools_tokens(rules, tok, body, "functions")
    prefill += _response_format_tokens(tok, body)
    return prefill + template_input_tokens(tok, body)


def _message_tokens(rules: Rules, tok: Tokenizer, message: object, where: str, images: ImageRule) -> int:
    if not isinstance(message, dict):
        raise InvalidRequest(
            f"{where} must be an object with 'role' and 'content', got {kind(message)}", param=where
        )
    role = message.get("role")
    if not isinstance(role, str) or not role:
        raise InvalidRequest(
            f"{where}.role must be a non-empty string such as 'user', got {kind(role)}",
            param=f"{where}.role",
        )
    s = rules.settings
    n = s.per_message_tokens + tok.count(role)
    name = message.get("name")
    if name is not None:
        if not isinstance(name, str):
            raise InvalidRequest(f"{where}.name must be a string, got {kind(name)}", param=f"{where}.name")
        n += s.per_name_tokens + tok.count(name)
    calls = _tool_calls_tokens(rules, tok, message, where)
    content = message.get("content")
    if isinstance(content, str):
        n += tok.count(content)
    elif isinstance(content, list):
        n += _parts_tokens(rules, tok, content, f"{where}.content", images)
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
            f"assistant message with tool_calls), got {kind(content)}",
            param=f"{where}.content",
        )
    if len(message) > 2:  # (role and content are most messages' only fields)
        n += _other_message_fields_tokens(tok, message, where)
    return n + (calls or 0)


def _other_message_fields_tokens(tok: Tokenizer, message: dict[str, Any], where: str) -> int:
    """A message's fields beyond OpenAI's counted ones: what an engine's chat template may render
    (``reasoning_content`` / ``reasoning`` of earlier turns, ``tool_call_id``, any key a custom
    template reads), counted as the compact JSON of those that are not null: one count per
    message however many keys it carries (a 4 MB body of tiny fields is one tokenizer call per
    message, not one per key), a few tokens of keys and quotes above the values' own."""
    other = {k: v for k, v in message.items() if k not in _COUNTED_MESSAGE_FIELDS and v is not None}
    if not other:
        return 0
    return tok.count(compact_json(other, where))


def _tool_calls_tokens(rules: Rules, tok: Tokenizer, message: dict[str, Any], where: str) -> int | None:
    """Tokens of the assistant's tool_calls / legacy function_call; None when it has neither."""
    calls = message.get("tool_calls")
    legacy = message.get("function_call")
    if calls is None and legacy is None:
        return None
    per_call = rules.settings.per_tool_call_tokens
    total = 0
    if calls is not None:
        if not isinstance(calls, list):
            raise InvalidRequest(
                f"{where}.tool_calls must be an array, got {kind(calls)}", param=f"{where}.tool_calls"
            )
        for j, call in enumerate(calls):
            at = f"{where}.tool_calls[{j}]"
            if not isinstance(call, dict):
                raise InvalidRequest(f"{at} must be an object, got {kind(call)}", param=at)
            total += per_call + function_tokens(tok, call.get("function"), f"{at}.function")
    if legacy is not None:
        total += per_call + function_tokens(tok, legacy, f"{where}.function_call")
    return total


def function_tokens(tok: Tokenizer, fn: object, where: str) -> int:
    """tokens(name) + tokens(arguments) of a function call (chat's, or a Responses item)."""
    if not isinstance(fn, dict):
        raise InvalidRequest(
            f"{where} must be an object with 'name' and 'arguments', got {kind(fn)}", param=where
        )
    name = fn.get("name")
    if not isinstance(name, str):
        raise InvalidRequest(f"{where}.name must be a string, got {kind(name)}", param=f"{where}.name")
    arguments = fn.get("arguments", "")
    if arguments is None:
        arguments = ""
    if not isinstance(arguments, str):
        raise InvalidRequest(
            f"{where}.arguments must be a JSON-encoded string, got {kind(arguments)}",
            param=f"{where}.arguments",
        )
    return tok.count(name) + tok.count(arguments)


def _parts_tokens(rules: Rules, tok: Tokenizer, parts: list[Any], where: str, images: ImageRule) -> int:
    constants = rules.part_constants
    total = 0
    for j, part in enumerate(parts):
        at = f"{where}[{j}]"
        if not isinstance(part, dict):
            raise InvalidRequest(
                f"{at} must be a content part object with a 'type', got {kind(part)}", param=at
            )
        part_type = part.get("type")
        if part_type in ("text", "refusal"):
            text = part.get(part_type)
            if not isinstance(text, str):
                raise InvalidRequest(
                    f"{at}.{part_type} must be a string for a '{part_type}' part, got {kind(text)}",
                    param=f"{at}.{part_type}",
                )
            total += tok.count(text)
            continue
        constant = constants.get(part_type) if isinstance(part_type, str) else None
        if constant is None:
            supported = ", ".join(["text", "refusal", *constants])
            raise InvalidRequest(
                f"{at}.type must be one of {supported}; got {show_value(part_type)}", param=f"{at}.type"
            )
        value = part.get(part_type)
        if not isinstance(value, dict | str):
            raise InvalidRequest(
                f"{at}.{part_type} must be an object describing the {part_type} part, got {kind(value)}",
                param=f"{at}.{part_type}",
            )
        if part_type in _URL_PARTS:
            url = value.get("url") if isinstance(value, dict) else value
            param = f"{at}.{part_type}.url" if isinstance(value, dict) else f"{at}.{part_type}"
            check_media_url(rules.settings, url, param)
            if part_type == "image_url":
                total += image_tokens(rules.settings, url, images, f"{at}.{part_type}")
                continue
        total += constant
    return total


def tools_tokens(rules: Rules, tok: Tokenizer, body: Mapping[str, Any], key: str) -> int:
    """A tools array (chat's ``tools`` / ``functions``, Responses' ``tools``): its compact JSON plus
    ``tools_overhead_tokens``; 0 when absent or empty."""
    tools = body.get(key)
    if tools is None:
        return 0
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        raise InvalidRequest(f"'{key}' must be an array of objects, got {kind(tools)}", param=key)
    if not tools:
        return 0
    return rules.settings.tools_overhead_tokens + tok.count(compact_json(tools, key))


def template_input_tokens(tok: Tokenizer, body: Mapping[str, Any]) -> int:
    """Engine extensions of chat that the backend's chat template renders into the prompt (vLLM,
    SGLang): ``documents`` and ``chat_template_kwargs``, counted as their compact JSON. A
    ``chat_template`` sent with the request is refused: it can make a prompt of any length out of
    the same messages, so nothing in the body bounds what it costs."""
    if body.get("chat_template") is not None:
        raise InvalidRequest(
            "'chat_template' is not accepted here: a template sent with the request can turn the "
            "messages into a prompt of any length, which the gateway cannot price before it runs; "
            "remove it (the model's own chat template is used)",
            param="chat_template",
            code="unsupported_parameter",
        )
    n = 0
    for key, shape_ok, shape in _TEMPLATE_INPUTS:
        value = body.get(key)
        if value is None:
            continue
        if not shape_ok(value):
            raise InvalidRequest(f"'{key}' must be {shape}, got {kind(value)}", param=key)
        if value:
            n += tok.count(compact_json(value, key))
    return n


def _response_format_tokens(tok: Tokenizer, body: Mapping[str, Any]) -> int:
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
            f"'response_format.json_schema' must be an object, got {kind(schema)}",
            param="response_format.json_schema",
        )
    return tok.count(compact_json(schema, "response_format.json_schema"))

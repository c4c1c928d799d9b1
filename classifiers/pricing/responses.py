"""Pricing ``/v1/responses``, like chat (chat.py).

* ``input`` a string: one user message. An array of items:
  message items (``type`` "message" or absent, ``role`` user / assistant / system / developer)
  cost what a chat message costs; their parts: ``input_text`` / ``output_text`` / ``refusal``
  count their text, ``input_image`` costs what an ``image_url`` part costs, ``input_audio``
  ``audio_tokens``, ``input_file`` ``file_tokens``, or the tokens of its inline ``file_data`` when
  that is more;
  ``function_call``: ``per_tool_call_tokens`` + tokens(name) + tokens(arguments);
  ``function_call_output``: ``per_message_tokens`` + its output (a string, or parts as above);
  ``reasoning``: ``per_message_tokens`` + its summary and content texts + 3/4 of the bytes of its
  ``encrypted_content`` (the most tokens the base64 ciphertext can decrypt to);
  ``item_reference`` (``type`` absent with an ``id``, too): ``item_reference_tokens``;
  any other typed item: the tokens of its compact JSON (never 0);
* ``instructions``: a system message; ``reply_priming_tokens`` once;
* ``tools`` (function and built-in tools alike): compact JSON + ``tools_overhead_tokens``;
* ``text.format`` of type ``json_schema``: tokens of the format object without its ``type``,
  i.e. the same fields chat's ``response_format.json_schema`` holds;
* ``documents`` / ``chat_template_kwargs`` / ``chat_template``: as in chat (engines serve this API
  through their chat template);
* ``background`` (anything but null or false) is refused (400 ``unsupported_parameter``): the
  engine would answer at once and generate afterwards, while nothing holds its tokens;
* server-side state is invisible: ``previous_response_id``, ``conversation``, ``prompt`` and
  ``item_reference`` make the server add stored items the gateway cannot see or count, and the
  turns of built-in tool loops add tool output server-side. Only the visible body is priced,
  unless ``server_state_at_context`` is on: then such a request (or one with a tool of a type other
  than ``function`` / ``custom``) is priced at the model's whole context, prompt and output together;
  ``input`` may be absent only when one of the first three is given.

Output: one sequence (the API has no ``n``) reserving ``max_output_tokens``, else the default,
under the same limit and cap as chat (validation.py). Reasoning tokens are part of
``max_output_tokens`` in that API, so ``reasoning.effort`` (validated: none, minimal, low, medium,
high, xhigh, max, or null) does not change the reservation.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from classifiers.images import ImageRule
from classifiers.pricing.chat import function_tokens, template_input_tokens, tools_tokens
from classifiers.pricing.cost import Cost, InvalidRequest
from classifiers.pricing.media import check_media_url, image_rule, image_tokens
from classifiers.pricing.settings import Rules
from classifiers.pricing.validation import check_context, check_items, limit_per_choice, requested_max
from classifiers.pricing.values import compact_json, kind, show_value
from classifiers.tokenizers import Tokenizer

_RESPONSES_ROLES = ("user", "assistant", "system", "developer")
# The effort values of the OpenAI SDK's ReasoningEffort; reasoning tokens are output tokens, so
# none of them changes the reservation.
_REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh", "max")
_TEXT_FORMATS = ("text", "json_object", "json_schema")
_RESPONSES_PARTS = ("input_text", "output_text", "refusal", "input_image", "input_file", "input_audio")
# State kept by the server that stands in for `input`.
_STORED_STATE = ("previous_response_id", "conversation", "prompt")
# Responses tools the client runs itself; any other type (web_search, file_search,
# code_interpreter, mcp, ...) is run by the server, whose turns add to the request's context.
CLIENT_TOOLS = frozenset(("function", "custom"))


def walk(
    rules: Rules,
    tok: Tokenizer,
    body: Mapping[str, Any],
    default_max_tokens: int,
    max_tokens_limit: int | None,
    context_length: int,
) -> Cost:
    """Validate and price a Responses request with ``tok``.

    Only what the body shows is priced: ``previous_response_id``, ``conversation`` and
    ``item_reference`` items make the server prepend state the gateway cannot see (unless
    ``server_state_at_context``: then such a request holds the whole context).
    """
    s = rules.settings
    _check_stored_state(body)
    prefill = s.reply_priming_tokens
    instructions = body.get("instructions")
    if instructions is not None:
        if not isinstance(instructions, str):
            raise InvalidRequest(
                f"'instructions' must be a string, got {kind(instructions)}", param="instructions"
            )
        prefill += s.per_message_tokens + tok.count("system") + tok.count(instructions)
    prefill += _input_tokens(rules, tok, body, image_rule(rules, body))
    prefill += tools_tokens(rules, tok, body, "tools")
    prefill += _text_format_tokens(tok, body)
    prefill += template_input_tokens(tok, body)  # (an engine's Responses API renders chat)
    _check_reasoning(body)
    requested, key = requested_max(body, ("max_output_tokens",))
    per_sequence = limit_per_choice(requested, key, default_max_tokens, max_tokens_limit)
    check_context(prefill, context_length, "input")
    each = min(per_sequence, context_length - prefill)
    if s.server_state_at_context and _adds_server_state(body):
        prefill = context_length - each  # whatever the server adds fits in the context, no more
    return Cost(prefill=prefill, decode=each, per_choice=each)


def _adds_server_state(body: Mapping[str, Any]) -> bool:
    """Whether the server adds to this (validated) Responses request what its body does not show:
    stored state, an ``item_reference``, or a tool the server runs."""
    if any(body.get(key) is not None for key in _STORED_STATE):
        return True
    items = body.get("input")
    if isinstance(items, list):
        for item in items:
            item_type = item.get("type") if isinstance(item, dict) else None
            if item_type == "item_reference" or (
                item_type is None and isinstance(item, dict) and "role" not in item
            ):
                return True
    tools = body.get("tools")
    return isinstance(tools, list) and any(
        isinstance(t, dict) and t.get("type") not in CLIENT_TOOLS for t in tools
    )


def _check_stored_state(body: Mapping[str, Any]) -> None:
    background = body.get("background")
    if background is not None and background is not False:
        # The engine answers at once and generates afterwards, for as long as max_output_tokens
        # allows: the lease ends with the answer, so the tokens would run outside any budget.
        # (Anything but null/false is refused: a lax parser reads "yes" or 1 as true.)
        raise InvalidRequest(
            f"'background' is not accepted here (got {show_value(background)}): a background response "
            "runs on the backend after this request has ended, outside the token budget the "
            "gateway holds for it; send the request without it (stream it for long outputs)",
            param="background",
            code="unsupported_parameter",
        )
    previous = body.get("previous_response_id")
    if previous is not None and not isinstance(previous, str):
        raise InvalidRequest(
            f"'previous_response_id' must be a string, got {kind(previous)}",
            param="previous_response_id",
        )
    conversation = body.get("conversation")
    if conversation is not None and not isinstance(conversation, str | dict):
        raise InvalidRequest(
            f"'conversation' must be a conversation id or an object with an 'id', got {kind(conversation)}",
            param="conversation",
        )


def _input_tokens(rules: Rules, tok: Tokenizer, body: Mapping[str, Any], images: ImageRule) -> int:
    items = body.get("input")
    if isinstance(items, str):
        return rules.settings.per_message_tokens + tok.count("user") + tok.count(items)
    if isinstance(items, list):
        check_items(rules.settings, items, "input", "input items and content parts")
        return sum(_item_tokens(rules, tok, item, f"input[{i}]", images) for i, item in enumerate(items))
    if items is None and any(body.get(key) is not None for key in _STORED_STATE):
        return 0  # the server supplies the conversation; we price only what we see
    raise InvalidRequest(
        f"'input' must be a string or an array of input items, got {kind(items)}", param="input"
    )


def _item_tokens(rules: Rules, tok: Tokenizer, item: object, where: str, images: ImageRule) -> int:
    if not isinstance(item, dict):
        raise InvalidRequest(
            f"{where} must be an input item object (a message with 'role' and 'content', or an item "
            f"with a 'type'), got {kind(item)}",
            param=where,
        )
    item_type = item.get("type")
    if item_type is None:
        if "role" in item:
            item_type = "message"
        elif "id" in item:
            item_type = "item_reference"
        else:
            raise InvalidRequest(
                f"{where} needs a 'type', or a 'role' and 'content' for a message", param=where
            )
    if not isinstance(item_type, str):
        raise InvalidRequest(f"{where}.type must be a string, got {kind(item_type)}", param=f"{where}.type")
    s = rules.settings
    if item_type == "message":
        return _message_tokens(rules, tok, item, where, images)
    if item_type == "function_call":
        return s.per_tool_call_tokens + function_tokens(tok, item, where)
    if item_type == "function_call_output":
        output = item.get("output")
        if isinstance(output, str):
            return s.per_message_tokens + tok.count(output)
        if isinstance(output, list):
            return s.per_message_tokens + _parts_tokens(rules, tok, output, f"{where}.output", images)
        raise InvalidRequest(
            f"{where}.output must be a string or an array of content parts, got {kind(output)}",
            param=f"{where}.output",
        )
    if item_type == "reasoning":
        return _reasoning_tokens(rules, tok, item, where)
    if item_type == "item_reference":
        return s.item_reference_tokens
    # Any other item (tool calls and outputs of built-in tools...): its JSON, never 0.
    return max(1, tok.count(compact_json(item, where)))


def _message_tokens(rules: Rules, tok: Tokenizer, item: dict[str, Any], where: str, images: ImageRule) -> int:
    role = item.get("role")
    if not isinstance(role, str) or role not in _RESPONSES_ROLES:
        raise InvalidRequest(
            f"{where}.role must be one of {', '.join(_RESPONSES_ROLES)}; got {show_value(role)}",
            param=f"{where}.role",
        )
    n = rules.settings.per_message_tokens + tok.count(role)
    content = item.get("content")
    if isinstance(content, str):
        return n + tok.count(content)
    if isinstance(content, list):
        return n + _parts_tokens(rules, tok, content, f"{where}.content", images)
    raise InvalidRequest(
        f"{where}.content must be a string or an array of content parts, got {kind(content)}",
        param=f"{where}.content",
    )


def _parts_tokens(rules: Rules, tok: Tokenizer, parts: list[Any], where: str, images: ImageRule) -> int:
    s = rules.settings
    total = 0
    for j, part in enumerate(parts):
        at = f"{where}[{j}]"
        if not isinstance(part, dict):
            raise InvalidRequest(
                f"{at} must be a content part object with a 'type', got {kind(part)}", param=at
            )
        part_type = part.get("type")
        if part_type in ("input_text", "output_text", "refusal"):
            field = "refusal" if part_type == "refusal" else "text"
            text = part.get(field)
            if not isinstance(text, str):
                raise InvalidRequest(
                    f"{at}.{field} must be a string for a '{part_type}' part, got {kind(text)}",
                    param=f"{at}.{field}",
                )
            total += tok.count(text)
        elif part_type == "input_image":
            check_media_url(s, part.get("image_url"), f"{at}.image_url")
            total += image_tokens(s, part.get("image_url"), images, f"{at}.image_url")
        elif part_type == "input_audio":
            total += s.audio_tokens
        elif part_type == "input_file":
            data = part.get("file_data")
            if data is not None and not isinstance(data, str):
                raise InvalidRequest(
                    f"{at}.file_data must be a string, got {kind(data)}", param=f"{at}.file_data"
                )
            check_media_url(s, part.get("file_url"), f"{at}.file_url")
            # Inline data is what the server reads: count it when it is the larger estimate.
            total += s.file_tokens if data is None else max(s.file_tokens, tok.count(data))
        else:
            raise InvalidRequest(
                f"{at}.type must be one of {', '.join(_RESPONSES_PARTS)}; got {show_value(part_type)}",
                param=f"{at}.type",
            )
    return total


def _reasoning_tokens(rules: Rules, tok: Tokenizer, item: dict[str, Any], where: str) -> int:
    total = rules.settings.per_message_tokens
    for part in ("summary", "content"):
        entries = item.get(part)
        if entries is None:
            continue
        if not isinstance(entries, list):
            raise InvalidRequest(
                f"{where}.{part} must be an array of text objects, got {kind(entries)}",
                param=f"{where}.{part}",
            )
        for j, entry in enumerate(entries):
            at = f"{where}.{part}[{j}]"
            if not isinstance(entry, dict):
                raise InvalidRequest(f"{at} must be an object with a 'text', got {kind(entry)}", param=at)
            text = entry.get("text")
            if not isinstance(text, str):
                raise InvalidRequest(f"{at}.text must be a string, got {kind(text)}", param=f"{at}.text")
            total += tok.count(text)
    secret = item.get("encrypted_content")
    if secret is not None:
        if not isinstance(secret, str):
            raise InvalidRequest(
                f"{where}.encrypted_content must be a string, got {kind(secret)}",
                param=f"{where}.encrypted_content",
            )
        # Base64 carries 3 bytes per 4 characters and every token is at least one byte, so the
        # decrypted reasoning cannot hold more tokens than that.
        total += -(-len(secret.encode("utf-8", "surrogatepass")) * 3 // 4)
    return total


def _text_format_tokens(tok: Tokenizer, body: Mapping[str, Any]) -> int:
    text = body.get("text")
    if text is None:
        return 0
    if not isinstance(text, dict):
        raise InvalidRequest(
            f'\'text\' must be an object (e.g. {{"format": {{"type": "text"}}}}), got {kind(text)}',
            param="text",
        )
    fmt = text.get("format")
    if fmt is None:
        return 0
    if not isinstance(fmt, dict) or not isinstance(fmt.get("type"), str):
        raise InvalidRequest(
            "'text.format' must be an object with a string 'type' (text, json_object or json_schema)",
            param="text.format",
        )
    format_type = fmt["type"]
    if format_type not in _TEXT_FORMATS:
        raise InvalidRequest(
            f"'text.format.type' must be one of {', '.join(_TEXT_FORMATS)}; got {show_value(format_type)}",
            param="text.format.type",
        )
    if format_type != "json_schema":
        return 0
    if not isinstance(fmt.get("schema"), dict):
        raise InvalidRequest(
            f"'text.format.schema' must be an object, got {kind(fmt.get('schema'))}",
            param="text.format.schema",
        )
    # The same fields as chat's response_format.json_schema object (name, schema, strict...).
    return tok.count(compact_json({k: v for k, v in fmt.items() if k != "type"}, "text.format"))


def _check_reasoning(body: Mapping[str, Any]) -> None:
    reasoning = body.get("reasoning")
    if reasoning is None:
        return
    if not isinstance(reasoning, dict):
        raise InvalidRequest(
            f'\'reasoning\' must be an object such as {{"effort": "low"}}, got {kind(reasoning)}',
            param="reasoning",
        )
    effort = reasoning.get("effort")
    if effort is not None and (not isinstance(effort, str) or effort not in _REASONING_EFFORTS):
        raise InvalidRequest(
            f"'reasoning.effort' must be one of {', '.join(_REASONING_EFFORTS)} or null; "
            f"got {show_value(effort)}",
            param="reasoning.effort",
        )

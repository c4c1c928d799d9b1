"""Pricing the OpenAI Responses API (``/v1/responses``) like chat, validating as it goes."""

from __future__ import annotations

import base64
from typing import Any

import orjson
import pytest

from classifiers import Cost, InvalidRequest, Pricer, PricingSettings, TokenizerRegistry
from tests.classifiers.support import CTX, LIMITS, count
from tests.classifiers.support import responses as resp


def message(role: str, text: str, pricer: Pricer) -> int:
    """What chat charges for one message with string content."""
    return pricer.settings.per_message_tokens + count(role) + count(text)


async def test_a_string_input_is_priced_as_one_user_message(pricer: Pricer) -> None:
    cost = await pricer.aprice_responses(resp(input="Tell me a story"), **LIMITS)
    assert cost == Cost(
        message("user", "Tell me a story", pricer) + pricer.settings.reply_priming_tokens, 256
    )


async def test_message_items_price_exactly_like_chat_messages(pricer: Pricer) -> None:
    items = [
        {"role": "system", "content": "You are helpful."},
        {"type": "message", "role": "developer", "content": "Be brief."},
        {"role": "user", "content": [{"type": "input_text", "text": "What is this?"}]},
        {
            "type": "message",
            "role": "assistant",
            "content": [{"type": "output_text", "text": "A cat.", "annotations": []}],
        },
    ]
    chat_body = {
        "model": "m",
        "messages": [
            {"role": "system", "content": "You are helpful."},
            {"role": "developer", "content": "Be brief."},
            {"role": "user", "content": "What is this?"},
            {"role": "assistant", "content": "A cat."},
        ],
    }
    expected = await pricer.aprice_chat(chat_body, **LIMITS)
    assert await pricer.aprice_responses(resp(input=items), **LIMITS) == expected


async def test_content_parts_cost_their_constants(pricer: Pricer) -> None:
    s = pricer.settings
    parts = [
        {"type": "input_text", "text": "Compare these"},
        {"type": "input_image", "image_url": "data:image/png;base64,AAAA"},
        {"type": "input_file", "file_id": "file-1"},
        {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}},
        {"type": "refusal", "refusal": "No."},
    ]
    cost = await pricer.aprice_responses(resp(input=[{"role": "user", "content": parts}]), **LIMITS)
    content = count("Compare these") + s.image_tokens + s.file_tokens + s.audio_tokens + count("No.")
    assert cost.prefill == s.per_message_tokens + count("user") + content + s.reply_priming_tokens


async def test_inline_file_data_counts_when_larger_than_the_file_constant(pricer: Pricer) -> None:
    s = pricer.settings
    big = "word " * (2 * s.file_tokens)
    small = "short file"

    async def file_cost(data: str) -> int:
        part = {"type": "input_file", "filename": "a.txt", "file_data": data}
        body = resp(input=[{"role": "user", "content": [part]}])
        return (await pricer.aprice_responses(body, **{**LIMITS, "context_length": 10**6})).prefill

    base = s.per_message_tokens + count("user") + s.reply_priming_tokens
    assert await file_cost(small) == base + s.file_tokens
    assert await file_cost(big) == base + count(big)


async def test_function_call_and_its_output_count_like_chat_tool_calls(pricer: Pricer) -> None:
    s = pricer.settings
    items = [
        {"role": "user", "content": "Weather in Oslo?"},
        {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": '{"city":"Oslo"}'},
        {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
        {
            "type": "function_call_output",
            "call_id": "c2",
            "output": [{"type": "input_text", "text": "rain"}, {"type": "input_image", "file_id": "f"}],
        },
    ]
    expected = (
        message("user", "Weather in Oslo?", pricer)
        + s.per_tool_call_tokens
        + count("get_weather")
        + count('{"city":"Oslo"}')
        + s.per_message_tokens
        + count("sunny")
        + s.per_message_tokens
        + count("rain")
        + s.image_tokens
        + s.reply_priming_tokens
    )
    assert (await pricer.aprice_responses(resp(input=items), **LIMITS)).prefill == expected


async def test_reasoning_items_count_their_texts_and_encrypted_content_by_bytes(pricer: Pricer) -> None:
    s = pricer.settings
    secret = base64.b64encode(b"x" * 3000).decode()  # 4000 characters of ciphertext
    item = {
        "type": "reasoning",
        "id": "rs_1",
        "summary": [{"type": "summary_text", "text": "Thought about it"}],
        "content": [{"type": "reasoning_text", "text": "step one"}],
        "encrypted_content": secret,
    }
    cost = await pricer.aprice_responses(resp(input=[item]), **LIMITS)
    # The decrypted reasoning holds at most 3 bytes per 4 base64 characters, and a token is at
    # least one byte: 3000 tokens bound it from above.
    expected = s.per_message_tokens + count("Thought about it") + count("step one") + 3000
    assert cost.prefill == expected + s.reply_priming_tokens


async def test_item_reference_costs_the_configured_constant(pricer: Pricer) -> None:
    s = pricer.settings
    for item in ({"type": "item_reference", "id": "msg_1"}, {"id": "msg_1"}):
        cost = await pricer.aprice_responses(resp(input=[item]), **LIMITS)
        assert cost.prefill == s.item_reference_tokens + s.reply_priming_tokens


async def test_any_other_typed_item_counts_its_compact_json(pricer: Pricer) -> None:
    call = {"type": "web_search_call", "id": "ws_1", "status": "completed", "action": {"query": "oslo"}}
    empty = {"type": "x"}
    cost = await pricer.aprice_responses(resp(input=[call, empty]), **LIMITS)
    json_tokens = count(orjson.dumps(call).decode()) + count(orjson.dumps(empty).decode())
    assert cost.prefill == json_tokens + pricer.settings.reply_priming_tokens
    assert count(orjson.dumps(empty).decode()) > 0


async def test_instructions_tools_and_json_schema_format_add_like_chat(pricer: Pricer) -> None:
    s = pricer.settings
    base = (await pricer.aprice_responses(resp(), **LIMITS)).prefill
    with_instructions = (
        await pricer.aprice_responses(resp(instructions="Answer in French."), **LIMITS)
    ).prefill
    assert with_instructions == base + message("system", "Answer in French.", pricer)
    tools = [
        {"type": "function", "name": "get_weather", "parameters": {"type": "object"}},
        {"type": "web_search"},
    ]
    with_tools = (await pricer.aprice_responses(resp(tools=tools), **LIMITS)).prefill
    assert with_tools == base + s.tools_overhead_tokens + count(orjson.dumps(tools).decode())
    schema = {"name": "answer", "schema": {"type": "object", "properties": {"city": {"type": "string"}}}}
    fmt = {"type": "json_schema", **schema}
    with_schema = (await pricer.aprice_responses(resp(text={"format": fmt}), **LIMITS)).prefill
    # The same schema costs the same as chat's response_format.json_schema.
    chat_body = {"model": "m", "messages": [{"role": "user", "content": "Hi"}]}
    chat_fmt = {"type": "json_schema", "json_schema": schema}
    chat_delta = (await pricer.aprice_chat({**chat_body, "response_format": chat_fmt}, **LIMITS)).prefill - (
        await pricer.aprice_chat(chat_body, **LIMITS)
    ).prefill
    assert with_schema == base + chat_delta
    for plain in ({"format": {"type": "text"}}, {"format": {"type": "json_object"}}, {"verbosity": "low"}):
        assert (await pricer.aprice_responses(resp(text=plain), **LIMITS)).prefill == base


async def test_decode_is_max_output_tokens_else_the_default_whatever_the_reasoning_effort(
    pricer: Pricer,
) -> None:
    assert (await pricer.aprice_responses(resp(), **LIMITS)).decode == 256
    assert (await pricer.aprice_responses(resp(max_output_tokens=100), **LIMITS)).decode == 100
    assert (await pricer.aprice_responses(resp(max_output_tokens=0), **LIMITS)).decode == 0
    for effort in ("minimal", "low", "medium", "high", None):
        body = resp(max_output_tokens=100, reasoning={"effort": effort, "summary": "auto"})
        assert (await pricer.aprice_responses(body, **LIMITS)).decode == 100
    # `max_tokens` / `n` are not part of this API: only max_output_tokens reserves output.
    assert (await pricer.aprice_responses(resp(max_tokens=5, n=4), **LIMITS)).decode == 256


async def test_decode_is_capped_by_the_context_and_the_prompt_must_fit(pricer: Pricer) -> None:
    prompt = (await pricer.aprice_responses(resp(), **LIMITS)).prefill
    assert await pricer.aprice_responses(resp(max_output_tokens=10**6), **LIMITS) == Cost(
        prompt, CTX - prompt
    )
    with pytest.raises(InvalidRequest) as info:
        await pricer.aprice_responses(resp(input="word " * 200), **{**LIMITS, "context_length": 100})
    assert info.value.code == "context_length_exceeded"
    assert info.value.param == "input"


async def test_max_output_tokens_above_the_limit_is_refused_and_the_default_clamped(pricer: Pricer) -> None:
    limited = {**LIMITS, "max_tokens_limit": 128}
    assert (await pricer.aprice_responses(resp(), **limited)).decode == 128
    assert (await pricer.aprice_responses(resp(max_output_tokens=128), **limited)).decode == 128
    with pytest.raises(InvalidRequest, match="limit of 128") as info:
        await pricer.aprice_responses(resp(max_output_tokens=129), **limited)
    assert info.value.param == "max_output_tokens"


async def test_a_long_request_holds_its_real_size_not_a_flat_cost(pricer: Pricer) -> None:
    text = "The quick brown fox jumps over the lazy dog. " * 3000  # about 30k tokens
    cost = await pricer.aprice_responses(resp(input=text), **{**LIMITS, "context_length": 65536})
    assert cost.prefill >= count(text) > 25_000


async def test_server_side_state_without_input_prices_what_is_visible(pricer: Pricer) -> None:
    s = pricer.settings
    for state in (
        {"previous_response_id": "resp_1"},
        {"conversation": "conv_1"},
        {"conversation": {"id": "c"}},
    ):
        body = {"model": "m", **state, "instructions": "Go on."}
        assert (await pricer.aprice_responses(body, **LIMITS)).prefill == (
            message("system", "Go on.", pricer) + s.reply_priming_tokens
        )


async def test_streaming_flag_is_validated(pricer: Pricer) -> None:
    assert (await pricer.aprice_responses(resp(stream=True), **LIMITS)).prefill > 0


RESPONSES_ERRORS: list[tuple[dict[str, Any], str]] = [
    ({"input": "Hi"}, "model"),
    ({"model": "m"}, "input"),
    (resp(input=5), "input"),
    (resp(input=None), "input"),
    (resp(input=["hi"]), "input[0]"),
    (resp(input=[{"content": "no role or type"}]), "input[0]"),
    (resp(input=[{"role": "robot", "content": "x"}]), "input[0].role"),
    (resp(input=[{"type": "message", "content": "x"}]), "input[0].role"),
    (resp(input=[{"role": "user", "content": 5}]), "input[0].content"),
    (resp(input=[{"role": "user"}]), "input[0].content"),
    (resp(input=[{"role": "user", "content": ["x"]}]), "input[0].content[0]"),
    (resp(input=[{"role": "user", "content": [{"type": "input_text"}]}]), "input[0].content[0].text"),
    (resp(input=[{"role": "user", "content": [{"type": "hologram"}]}]), "input[0].content[0].type"),
    (resp(input=[{"type": "function_call", "name": 3, "arguments": "{}"}]), "input[0].name"),
    (resp(input=[{"type": "function_call", "name": "f", "arguments": {}}]), "input[0].arguments"),
    (resp(input=[{"type": "function_call_output", "output": 5}]), "input[0].output"),
    (resp(input=[{"type": "reasoning", "summary": "x"}]), "input[0].summary"),
    (resp(input=[{"type": "reasoning", "summary": [{"text": 1}]}]), "input[0].summary[0].text"),
    (
        resp(input=[{"type": "reasoning", "summary": [], "encrypted_content": 1}]),
        "input[0].encrypted_content",
    ),
    (resp(input=[{"type": 7}]), "input[0].type"),
    (resp(instructions=5), "instructions"),
    (resp(tools={"type": "web_search"}), "tools"),
    (resp(tools=["web_search"]), "tools"),
    (resp(text="json"), "text"),
    (resp(text={"format": "json"}), "text.format"),
    (resp(text={"format": {"type": "json_schema", "schema": "x"}}), "text.format.schema"),
    (resp(max_output_tokens=-1), "max_output_tokens"),
    (resp(max_output_tokens=True), "max_output_tokens"),
    (resp(max_output_tokens=1.5), "max_output_tokens"),
    (resp(reasoning="high"), "reasoning"),
    (resp(reasoning={"effort": "extreme"}), "reasoning.effort"),
    (resp(reasoning={"effort": 3}), "reasoning.effort"),
    (resp(previous_response_id=5), "previous_response_id"),
    (resp(conversation=5), "conversation"),
    (resp(stream="yes"), "stream"),
]


@pytest.mark.parametrize(("body", "param"), RESPONSES_ERRORS)
async def test_responses_validation_errors_name_the_param(
    pricer: Pricer, body: dict[str, Any], param: str
) -> None:
    with pytest.raises(InvalidRequest) as info:
        await pricer.aprice_responses(body, **LIMITS)
    assert info.value.param == param
    assert info.value.message


SERVER_STATE: list[dict[str, Any]] = [
    {"previous_response_id": "resp_1"},
    {"conversation": "conv_1"},
    {"prompt": {"id": "pmpt_1"}},
    {"input": [{"type": "item_reference", "id": "msg_1"}]},
    {"input": [{"id": "msg_1"}]},  # an item reference without its type
    {"tools": [{"type": "web_search_preview"}]},
    {"tools": [{"type": "function", "name": "f", "parameters": {}}, {"type": "code_interpreter"}]},
    {"tools": [{"type": "mcp", "server_label": "x", "server_url": "http://mcp"}]},
]


@pytest.mark.parametrize("extra", SERVER_STATE)
async def test_with_server_state_at_context_what_the_server_adds_holds_the_whole_context(
    extra: dict[str, Any],
) -> None:
    on = Pricer(TokenizerRegistry(), PricingSettings(server_state_at_context=True))
    body = {**resp(max_output_tokens=500), **extra}
    cost = await on.aprice_responses(body, **LIMITS)
    assert cost.total == CTX and cost.decode == 500
    # Off (the default): only the visible body, as documented.
    assert (await Pricer(TokenizerRegistry()).aprice_responses(body, **LIMITS)).total < 1000


@pytest.mark.parametrize(
    "extra",
    [{}, {"tools": [{"type": "function", "name": "f", "parameters": {}}, {"type": "custom", "name": "g"}]}],
)
async def test_a_request_the_server_adds_nothing_to_is_priced_as_before(extra: dict[str, Any]) -> None:
    on = Pricer(TokenizerRegistry(), PricingSettings(server_state_at_context=True))
    body = {**resp(max_output_tokens=500), **extra}
    assert await on.aprice_responses(body, **LIMITS) == await Pricer(TokenizerRegistry()).aprice_responses(
        body, **LIMITS
    )

from __future__ import annotations

import copy
from typing import Any

import orjson
import pytest

from classifiers import Cost, InvalidRequest, Pricer, PricingSettings, TokenizerRegistry, default_tokenizer
from tests.classifiers.support import CTX, LIMITS, chat, count


def test_cost_total() -> None:
    assert Cost(prefill=10, decode=5).total == 15


async def test_chat_overheads_match_a_hand_count(pricer: Pricer) -> None:
    body = {
        "model": "m",
        "messages": [
            {"role": "system", "content": "You are helpful."},
            {"role": "user", "content": "Hi", "name": "bob"},
        ],
    }
    # system: 3 + "system"(1) + "You are helpful."(4); user: 3 + "user"(1) + "Hi"(1) + name 1 + "bob"(1);
    # reply priming 3.
    assert await pricer.aprice_chat(body, **LIMITS) == Cost(prefill=18, decode=256)


async def test_settings_change_the_overheads() -> None:
    settings = PricingSettings(per_message_tokens=0, reply_priming_tokens=0)
    cost = await Pricer(TokenizerRegistry(), settings).aprice_chat(chat(), **LIMITS)
    assert cost.prefill == count("user") + count("Hi")


async def test_tools_functions_and_schema_add_their_json(pricer: Pricer) -> None:
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
    schema = {"name": "answer", "schema": {"type": "object", "properties": {"city": {"type": "string"}}}}
    base = (await pricer.aprice_chat(chat(), **LIMITS)).prefill
    overhead = pricer.settings.tools_overhead_tokens
    with_tools = (await pricer.aprice_chat(chat(tools=[tool]), **LIMITS)).prefill
    assert with_tools == base + overhead + count(orjson.dumps([tool]).decode())
    with_functions = (await pricer.aprice_chat(chat(functions=[tool["function"]]), **LIMITS)).prefill
    assert with_functions == base + overhead + count(orjson.dumps([tool["function"]]).decode())
    fmt = {"type": "json_schema", "json_schema": schema}
    with_schema = (await pricer.aprice_chat(chat(response_format=fmt), **LIMITS)).prefill
    assert with_schema == base + count(orjson.dumps(schema).decode())
    assert (await pricer.aprice_chat(chat(response_format={"type": "json_object"}), **LIMITS)).prefill == base


async def test_content_parts(pricer: Pricer) -> None:
    s = pricer.settings
    parts = [
        {"type": "text", "text": "What is in this image?"},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
        {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}},
    ]
    body = {"model": "m", "messages": [{"role": "user", "content": parts}]}
    expected = 3 + count("user") + count("What is in this image?") + s.image_tokens + s.audio_tokens + 3
    assert (await pricer.aprice_chat(body, **LIMITS)).prefill == expected


async def test_assistant_tool_calls_with_null_content(pricer: Pricer) -> None:
    call = {
        "id": "c1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city":"Oslo"}'},
    }
    body = {
        "model": "m",
        "messages": [
            {"role": "user", "content": "Weather?"},
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
        ],
    }
    s = pricer.settings
    expected = (
        (3 + count("user") + count("Weather?"))
        + (3 + count("assistant") + s.per_tool_call_tokens + count("get_weather") + count('{"city":"Oslo"}'))
        + (3 + count("tool") + count("sunny") + count('{"tool_call_id":"c1"}'))  # (templates may render it)
        + 3
    )
    assert (await pricer.aprice_chat(body, **LIMITS)).prefill == expected


async def test_decode_reservation_rules(pricer: Pricer) -> None:
    assert (await pricer.aprice_chat(chat(), **LIMITS)).decode == 256  # default
    assert (await pricer.aprice_chat(chat(max_tokens=100), **LIMITS)).decode == 100
    assert (await pricer.aprice_chat(chat(max_tokens=100, max_completion_tokens=40), **LIMITS)).decode == 40
    assert (await pricer.aprice_chat(chat(max_tokens=0), **LIMITS)).decode == 0
    assert (await pricer.aprice_chat(chat(max_tokens=100, n=3), **LIMITS)).decode == 300


async def test_context_caps_each_choice(pricer: Pricer) -> None:
    prompt = (await pricer.aprice_chat(chat(), **LIMITS)).prefill
    cost = await pricer.aprice_chat(chat(max_tokens=10**6, n=2), **LIMITS)
    assert cost == Cost(prefill=prompt, decode=(CTX - prompt) * 2)
    tight = {**LIMITS, "context_length": prompt}
    assert (await pricer.aprice_chat(chat(), **tight)).decode == 0


async def test_prompt_over_context_is_rejected(pricer: Pricer) -> None:
    body = chat(messages=[{"role": "user", "content": "word " * 200}])
    with pytest.raises(InvalidRequest) as info:
        await pricer.aprice_chat(body, **{**LIMITS, "context_length": 100})
    assert info.value.code == "context_length_exceeded"
    assert info.value.param == "messages"
    assert (
        "100" in info.value.message
        and str((await pricer.aprice_chat(body, **LIMITS)).prefill) in info.value.message
    )


async def test_max_tokens_limit(pricer: Pricer) -> None:
    limited = {**LIMITS, "max_tokens_limit": 128}
    assert (await pricer.aprice_chat(chat(max_tokens=128), **limited)).decode == 128
    assert (await pricer.aprice_chat(chat(), **limited)).decode == 128  # the default is clamped, not an error
    with pytest.raises(InvalidRequest, match="limit of 128") as info:
        await pricer.aprice_chat(chat(max_tokens=129), **limited)
    assert info.value.param == "max_tokens"
    with pytest.raises(InvalidRequest) as info:
        await pricer.aprice_chat(chat(max_completion_tokens=1000), **limited)
    assert info.value.param == "max_completion_tokens"


async def test_completion_prompt_shapes(pricer: Pricer) -> None:
    async def price(prompt: Any, **extra: Any) -> Cost:
        return await pricer.aprice_completion(
            {"model": "m", "prompt": prompt, "max_tokens": 10, **extra}, **LIMITS
        )

    assert await price("hello world") == Cost(2, 10)
    assert await price(["hello world", "tiktoken is great!"]) == Cost(8, 20)  # decode per prompt
    assert await price([1, 2, 3, 4]) == Cost(4, 10)
    assert await price([[1, 2, 3], [4, 5], [6]]) == Cost(6, 30)
    assert await price("hello world", n=2) == Cost(2, 20)
    assert await price("hello world", n=2, best_of=3) == Cost(2, 30)
    assert await price("hello", suffix=" world") == Cost(count("hello") + count(" world"), 10)


async def test_completion_context_cap_is_per_prompt(pricer: Pricer) -> None:
    body = {"model": "m", "prompt": [list(range(90)), list(range(10))]}
    cost = await pricer.aprice_completion(body, **{**LIMITS, "default_max_tokens": 50, "context_length": 100})
    assert cost == Cost(prefill=100, decode=10 + 50)


async def test_embeddings(pricer: Pricer) -> None:
    assert await pricer.aprice_embeddings({"model": "e", "input": "hello world"}) == Cost(2, 0)
    assert await pricer.aprice_embeddings({"model": "e", "input": [[1, 2], [3]]}) == Cost(3, 0)
    with pytest.raises(InvalidRequest) as info:
        await pricer.aprice_embeddings({"model": "e", "input": "hello world"}, context_length=1)
    assert info.value.code == "context_length_exceeded"


async def test_stream_with_options_is_fine(pricer: Pricer) -> None:
    body = chat(stream=True, stream_options={"include_usage": True})
    assert (await pricer.aprice_chat(body, **LIMITS)).prefill > 0


def _set(path: tuple[Any, ...], value: Any) -> dict[str, Any]:
    body = copy.deepcopy(chat())
    target: Any = body
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = value
    return body


CHAT_ERRORS: list[tuple[dict[str, Any], str]] = [
    ({"messages": []}, "model"),
    (chat(model=""), "model"),
    (chat(model=3), "model"),
    (chat(messages=[]), "messages"),
    (chat(messages="hi"), "messages"),
    (chat(messages=["hi"]), "messages[0]"),
    (_set(("messages", 0, "role"), 1), "messages[0].role"),
    (_set(("messages", 0, "content"), None), "messages[0].content"),
    (_set(("messages", 0, "content"), 5), "messages[0].content"),
    (_set(("messages", 0, "content"), [{"type": "text", "text": 1}]), "messages[0].content[0].text"),
    (_set(("messages", 0, "content"), [{"type": "hologram"}]), "messages[0].content[0].type"),
    (_set(("messages", 0, "content"), ["hi"]), "messages[0].content[0]"),
    (_set(("messages", 0, "name"), 7), "messages[0].name"),
    (_set(("messages", 0, "tool_calls"), {"function": {}}), "messages[0].tool_calls"),
    (
        _set(("messages", 0, "tool_calls"), [{"function": {"name": "f", "arguments": {}}}]),
        "messages[0].tool_calls[0].function.arguments",
    ),
    (chat(max_tokens=True), "max_tokens"),
    (chat(max_tokens=-1), "max_tokens"),
    (chat(max_tokens=1.5), "max_tokens"),
    (chat(max_tokens="10"), "max_tokens"),
    (chat(max_completion_tokens=False), "max_completion_tokens"),
    (chat(n=0), "n"),
    (chat(n=True), "n"),
    (chat(stream="yes"), "stream"),
    (chat(stream_options={"include_usage": True}), "stream_options"),
    (chat(stream=False, stream_options={"include_usage": True}), "stream_options"),
    (chat(stream=True, stream_options=[1]), "stream_options"),
    (chat(tools={"type": "function"}), "tools"),
    (chat(response_format="json"), "response_format"),
    (chat(response_format={"type": "json_schema", "json_schema": "x"}), "response_format.json_schema"),
]


@pytest.mark.parametrize(("body", "param"), CHAT_ERRORS)
async def test_chat_validation_errors_name_the_param(
    pricer: Pricer, body: dict[str, Any], param: str
) -> None:
    with pytest.raises(InvalidRequest) as info:
        await pricer.aprice_chat(body, **LIMITS)
    assert info.value.param == param
    assert info.value.message


COMPLETION_ERRORS: list[tuple[dict[str, Any], str]] = [
    ({"model": "m"}, "prompt"),
    ({"model": "m", "prompt": []}, "prompt"),
    ({"model": "m", "prompt": 5}, "prompt"),
    ({"model": "m", "prompt": ["a", 1]}, "prompt"),
    ({"model": "m", "prompt": [1, True]}, "prompt"),
    ({"model": "m", "prompt": [1, -2]}, "prompt"),
    ({"model": "m", "prompt": [[1], ["a"]]}, "prompt"),
    ({"model": "m", "prompt": [{"a": 1}]}, "prompt"),
    ({"model": "m", "prompt": "x", "suffix": 1}, "suffix"),
    ({"model": "m", "prompt": "x", "best_of": 0}, "best_of"),
    ({"model": "m", "prompt": "x", "n": 3, "best_of": 2}, "best_of"),
    ({"model": "m", "prompt": "x", "max_tokens": -5}, "max_tokens"),
    ({"model": "m", "prompt": "x", "stream_options": {}}, "stream_options"),
]


@pytest.mark.parametrize(("body", "param"), COMPLETION_ERRORS)
async def test_completion_validation_errors_name_the_param(
    pricer: Pricer, body: dict[str, Any], param: str
) -> None:
    with pytest.raises(InvalidRequest) as info:
        await pricer.aprice_completion(body, **LIMITS)
    assert info.value.param == param


async def test_embeddings_validation(pricer: Pricer) -> None:
    with pytest.raises(InvalidRequest) as info:
        await pricer.aprice_embeddings({"model": "e", "input": None})
    assert info.value.param == "input"


async def test_non_object_body(pricer: Pricer) -> None:
    with pytest.raises(InvalidRequest, match="JSON object"):
        await pricer.aprice_chat([], **LIMITS)  # type: ignore[arg-type]


async def test_long_prompt_counts_exactly(pricer: Pricer) -> None:
    text = "The quick brown fox jumps over the lazy dog. " * 3000
    cost = await pricer.aprice_chat(
        chat(messages=[{"role": "user", "content": text}]), **{**LIMITS, "context_length": 65536}
    )
    assert cost.prefill == 3 + count("user") + len(default_tokenizer().encoding.encode_ordinary(text)) + 3

"""Hostile bodies: each is a clean InvalidRequest (a 400), never a crash, a huge cost or a huge message."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson
import pytest
from tokenizers import Tokenizer as HFBackend
from tokenizers import models, pre_tokenizers

from classifiers import Cost, InvalidRequest, Pricer, PricingSettings, TokenizerRegistry
from classifiers.pricing.values import show_value
from tests.classifiers.support import CTX, LIMITS, chat, responses

MAX_DEPTH = 254  # what the pricer documents (orjson's own serialization limit)


def nested(depth: int) -> Any:
    """A JSON object `depth` containers deep, built from text the way the gateway parses bodies."""
    if depth <= 1000:
        return orjson.loads(b'{"a":' * (depth - 1) + b"{}" + b"}" * (depth - 1))
    value: Any = {}
    for _ in range(depth - 1):  # deeper than orjson.loads accepts: only a Python caller can build it
        value = {"a": value}
    return value


# (how to build a body around a deep value, the pricing call, the param named in the error,
#  the containers the body adds above the value inside the serialized field)
DEEP_SITES: list[tuple[str, Callable[[Any], dict[str, Any]], str, str, int]] = [
    (
        "chat tools",
        lambda v: chat(tools=[{"type": "function", "function": {"name": "f", "parameters": v}}]),
        "chat",
        "tools",
        3,
    ),
    ("chat functions", lambda v: chat(functions=[{"name": "f", "parameters": v}]), "chat", "functions", 2),
    (
        "chat json_schema",
        lambda v: chat(response_format={"type": "json_schema", "json_schema": {"name": "s", "schema": v}}),
        "chat",
        "response_format.json_schema",
        1,
    ),
    (
        "responses tools",
        lambda v: responses(tools=[{"type": "function", "name": "f", "parameters": v}]),
        "responses",
        "tools",
        2,
    ),
    (
        "responses text.format",
        lambda v: responses(text={"format": {"type": "json_schema", "name": "s", "schema": v}}),
        "responses",
        "text.format",
        1,
    ),
    (
        "responses other item",
        lambda v: responses(input=[{"type": "custom_tool_call", "input": v}]),
        "responses",
        "input[0]",
        1,
    ),
]


async def price(pricer: Pricer, api: str, body: dict[str, Any]) -> Cost:
    if api == "chat":
        return await pricer.aprice_chat(body, **LIMITS)
    return await pricer.aprice_responses(body, **{**LIMITS, "context_length": 10**6})


@pytest.mark.parametrize("depth", [255, 600, 990, 5000])
@pytest.mark.parametrize(("site", "build", "api", "param", "above"), DEEP_SITES)
async def test_deeply_nested_json_is_a_clear_400_never_a_recursion_error(
    pricer: Pricer,
    depth: int,
    site: str,
    build: Callable[[Any], dict[str, Any]],
    api: str,
    param: str,
    above: int,
) -> None:
    with pytest.raises(InvalidRequest) as info:
        await price(pricer, api, build(nested(depth)))
    assert info.value.param == param
    assert f"more than {MAX_DEPTH} levels" in info.value.message


@pytest.mark.parametrize(("site", "build", "api", "param", "above"), DEEP_SITES)
async def test_nesting_up_to_the_documented_depth_is_priced(
    pricer: Pricer, site: str, build: Callable[[Any], dict[str, Any]], api: str, param: str, above: int
) -> None:
    assert (await price(pricer, api, build(nested(100)))).prefill > 100
    assert (await price(pricer, api, build(nested(MAX_DEPTH - above)))).prefill > 0
    with pytest.raises(InvalidRequest, match=f"more than {MAX_DEPTH} levels"):
        await price(pricer, api, build(nested(MAX_DEPTH - above + 1)))


async def test_integers_beyond_64_bits_inside_a_schema_are_a_400(pricer: Pricer) -> None:
    # orjson.loads turns such numbers into floats, so only a Python caller can send them.
    body = chat(tools=[{"type": "function", "function": {"name": "f", "parameters": {"maximum": 2**70}}}])
    with pytest.raises(InvalidRequest) as info:
        await pricer.aprice_chat(body, **LIMITS)
    assert info.value.param == "tools"


def test_the_gateways_own_parser_refuses_deeper_bodies_as_invalid_json() -> None:
    # The proxy turns orjson.JSONDecodeError into a 400 invalid_json: nothing deeper reaches a pricer.
    with pytest.raises(orjson.JSONDecodeError):
        orjson.loads(b"[" * 5000 + b"]" * 5000)


@pytest.mark.parametrize("prompt", [[[]], [[1, 2], []], [[], [3]]])
async def test_an_empty_token_id_array_inside_a_prompt_is_refused(pricer: Pricer, prompt: Any) -> None:
    with pytest.raises(InvalidRequest, match="empty") as info:
        await pricer.aprice_completion({"model": "m", "prompt": prompt}, **LIMITS)
    assert info.value.param == "prompt"
    with pytest.raises(InvalidRequest, match="empty") as info:
        await pricer.aprice_embeddings({"model": "e", "input": prompt})
    assert info.value.param == "input"


async def test_empty_string_prompts_stay_legal(pricer: Pricer) -> None:
    assert await pricer.aprice_completion({"model": "m", "prompt": [""], "max_tokens": 1}, **LIMITS) == Cost(
        0, 1
    )
    assert await pricer.aprice_completion({"model": "m", "prompt": "", "max_tokens": 1}, **LIMITS) == Cost(
        0, 1
    )


HUGE = [129, 2**63 - 1, 2**64 - 1, 10**30]


@pytest.mark.parametrize("n", HUGE)
async def test_more_than_128_choices_is_refused_with_the_limit(pricer: Pricer, n: int) -> None:
    for api, body in (("chat", chat(n=n)), ("completion", {"model": "m", "prompt": "x", "n": n})):
        with pytest.raises(InvalidRequest, match="128") as info:
            await getattr(pricer, f"aprice_{api}")(body, **LIMITS)
        assert info.value.param == "n"
    with pytest.raises(InvalidRequest, match="128") as info:
        await pricer.aprice_completion({"model": "m", "prompt": "x", "best_of": n}, **LIMITS)
    assert info.value.param == "best_of"


async def test_128_choices_are_allowed_and_the_cost_stays_in_64_bits(pricer: Pricer) -> None:
    cost = await pricer.aprice_completion(
        {"model": "m", "prompt": "x", "n": 128, "best_of": 128, "max_tokens": 2**64 - 1}, **LIMITS
    )
    assert cost.decode == 128 * (CTX - 1)
    assert cost.total < 2**63
    parsed = orjson.loads(b'{"model": "m", "messages": [{"role": "user", "content": "x"}], "n": 128}')
    assert (await pricer.aprice_chat(parsed, **LIMITS)).decode == 128 * 256


@pytest.mark.parametrize("token", [2**63, 2**64 - 1, 2**70])
async def test_token_ids_beyond_64_bits_are_refused(pricer: Pricer, token: int) -> None:
    for prompt in ([token], [[1, token]]):
        with pytest.raises(InvalidRequest, match="token id") as info:
            await pricer.aprice_completion({"model": "m", "prompt": prompt}, **LIMITS)
        assert info.value.param == "prompt"
    # The largest signed 64-bit id prices (the engine answers whether it is in its vocabulary).
    assert await pricer.aprice_completion(
        {"model": "m", "prompt": [2**63 - 1], "max_tokens": 1}, **LIMITS
    ) == Cost(1, 1)


MEGA = "x" * 1_000_000


def _content(part: dict[str, Any]) -> dict[str, Any]:
    return chat(messages=[{"role": "user", "content": [part]}])


def _rcontent(part: dict[str, Any]) -> dict[str, Any]:
    return responses(input=[{"role": "user", "content": [part]}])


ECHOES: list[tuple[str, str, Callable[[Any], dict[str, Any]]]] = [
    ("chat", "n", lambda v: chat(n=v)),
    ("chat", "max_tokens", lambda v: chat(max_tokens=v)),
    ("chat", "max_completion_tokens", lambda v: chat(max_completion_tokens=v)),
    ("chat", "part type", lambda v: _content({"type": v})),
    ("completion", "best_of", lambda v: {"model": "m", "prompt": "x", "best_of": v}),
    ("completion", "n", lambda v: {"model": "m", "prompt": "x", "n": v}),
    ("responses", "max_output_tokens", lambda v: responses(max_output_tokens=v)),
    ("responses", "reasoning.effort", lambda v: responses(reasoning={"effort": v})),
    ("responses", "role", lambda v: responses(input=[{"role": v, "content": "x"}])),
    ("responses", "part type", lambda v: _rcontent({"type": v})),
    ("responses", "text.format.type", lambda v: responses(text={"format": {"type": v}})),
]


@pytest.mark.parametrize(("api", "field", "build"), ECHOES)
async def test_echoed_client_values_are_truncated(
    pricer: Pricer, api: str, field: str, build: Callable[[Any], dict[str, Any]]
) -> None:
    with pytest.raises(InvalidRequest) as info:
        await getattr(pricer, f"aprice_{api}")(build(MEGA), **LIMITS)
    assert len(info.value.message) < 400
    assert "1000000 chars" in info.value.message


@pytest.mark.parametrize(("api", "field", "build"), ECHOES)
async def test_echoed_deep_containers_never_recurse(
    pricer: Pricer, api: str, field: str, build: Callable[[Any], dict[str, Any]]
) -> None:
    with pytest.raises(InvalidRequest) as info:
        await getattr(pricer, f"aprice_{api}")(build(nested(5000)), **LIMITS)
    assert len(info.value.message) < 400


@pytest.fixture(scope="module")
def hf_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    hf = HFBackend(models.WordLevel({"[UNK]": 0, "hello": 1}, unk_token="[UNK]"))
    hf.pre_tokenizer = pre_tokenizers.Whitespace()
    path = tmp_path_factory.mktemp("hf") / "tokenizer.json"
    hf.save(str(path))
    return path


@pytest.mark.parametrize("model", ["cl100k-model", "bytes-model", "hf-model"])
@pytest.mark.parametrize("text", ["\ud800", "a\udc00b", "hello\x00world", "\x00" * 100, "\ud83d" * 3000])
async def test_lone_surrogates_and_nul_bytes_never_crash_tokenizing(
    hf_path: Path, model: str, text: str
) -> None:
    registry = TokenizerRegistry(
        models={"cl100k-model": "cl100k_base", "bytes-model": "bytes", "hf-model": f"hf:{hf_path}"}
    )
    pricer = Pricer(registry)
    chat_cost = await pricer.aprice_chat(
        {"model": model, "messages": [{"role": "user", "content": text}]}, **LIMITS
    )
    assert chat_cost.prefill > 0
    assert (await pricer.aprice_responses({"model": model, "input": text}, **LIMITS)).prefill > 0
    assert (await pricer.aprice_completion({"model": model, "prompt": [text, text]}, **LIMITS)).prefill > 0
    raw = text.encode("utf-8", "surrogatepass")
    assert (await pricer.aprice_passthrough(raw, model=model, default_max_tokens=0)).prefill > 0


@pytest.mark.parametrize(
    ("value", "shown"),
    [
        ("gpt-4o", "'gpt-4o'"),
        (MEGA, "'" + "x" * 64 + "'…(1000000 chars)"),
        (None, "null"),
        (True, "true"),
        (7, "7"),
        (2**70, "an integer of 71 bits"),
        (1.5, "1.5"),
        ([1, 2], "array"),
        ({"a": 1}, "object"),
    ],
)
def test_show_value_keeps_any_client_value_short(value: object, shown: str) -> None:
    assert show_value(value) == shown
    assert show_value(nested(5000)) == "object"


@pytest.mark.parametrize(
    ("extra", "fits"),
    [
        ({"stop": "x" * 1024}, True),
        ({"stop": ["a"] * 16}, True),
        ({"stop": None}, True),
        ({"logit_bias": {str(i): 1 for i in range(1024)}}, True),
        ({"stop": ["a"] * 17}, False),
        ({"stop": "x" * 1025}, False),
        ({"stop": ["ok", "y" * 5000]}, False),
        ({"stop": [1, 2]}, False),
        ({"stop": {"a": 1}}, False),
        ({"logit_bias": {str(i): 1 for i in range(1025)}}, False),
        ({"logit_bias": [1, 2]}, False),
        ({"bad_words": ["a"] * 16}, True),
        ({"bad_words": ["a"] * 17}, False),
        ({"bad_words": "z" * 1025}, False),
    ],
)
@pytest.mark.parametrize("route", ["chat", "completion"])
async def test_what_an_engine_pays_on_every_step_is_bounded(
    pricer: Pricer, extra: dict[str, Any], fits: bool, route: str
) -> None:
    # 10,000 stop strings are 10,000 searches per generated token in vLLM's API server, whose one
    # loop streams everyone's requests: a token budget does not bound that.
    body = chat(**extra) if route == "chat" else {"model": "m", "prompt": "Hi", **extra}
    price = pricer.aprice_chat if route == "chat" else pricer.aprice_completion
    if fits:
        await price(body, **LIMITS)
        return
    with pytest.raises(InvalidRequest) as info:
        await price(body, **LIMITS)
    assert info.value.param == next(iter(extra))
    assert len(info.value.message) < 200


async def test_a_zero_bound_is_no_bound() -> None:
    open_pricer = Pricer(
        TokenizerRegistry(), PricingSettings(max_stop_sequences=0, max_stop_chars=0, max_logit_bias=0)
    )
    body = chat(stop=["a" * 5000] * 100, logit_bias={str(i): 1 for i in range(5000)})
    assert (await open_pricer.aprice_chat(body, **LIMITS)).prefill > 0


LONG = "word " * 3000  # ~3,000 tokens: above the default 2,048


@pytest.mark.parametrize(
    ("route", "extra", "param"),
    [
        ("chat", {"prompt_logprobs": 1}, "prompt_logprobs"),
        ("chat", {"prompt_logprobs": 0}, "prompt_logprobs"),  # 0 still computes the full logits
        ("chat", {"prompt_logprobs": False}, "prompt_logprobs"),  # read as 0 by a lax parser
        ("completion", {"prompt_logprobs": 5}, "prompt_logprobs"),
        ("completion", {"echo": True, "logprobs": 1}, "echo"),
        ("completion", {"echo": True, "logprobs": 0}, "echo"),
    ],
)
async def test_prompt_logprobs_on_a_long_prompt_are_refused_before_they_reach_the_engine(
    pricer: Pricer, route: str, extra: dict[str, Any], param: str
) -> None:
    # The engine computes the prompt's logits over the whole vocabulary at once, outside the KV
    # cache its memory profile reserved: one such request can take a shared engine down.
    if route == "chat":
        long, short, price = chat(**extra), chat(**extra), pricer.aprice_chat
        long["messages"][0]["content"] = LONG
    else:
        long, short = {"model": "m", "prompt": ["Hi", LONG], **extra}, {"model": "m", "prompt": "Hi", **extra}
        price = pricer.aprice_completion
    await price(short, **LIMITS)
    with pytest.raises(InvalidRequest) as info:
        await price(long, **LIMITS)
    assert (info.value.param, info.value.code) == (param, "prompt_logprobs_too_long")
    assert (
        "pricing.max_prompt_logprobs_tokens" in info.value.message and "has about 300" in info.value.message
    )


async def test_a_long_prompt_without_prompt_logprobs_is_not_refused(pricer: Pricer) -> None:
    for extra in ({"echo": True}, {"logprobs": 5}, {"echo": False, "logprobs": 5}, {"prompt_logprobs": None}):
        await pricer.aprice_completion({"model": "m", "prompt": LONG, **extra}, **LIMITS)
    await pricer.aprice_chat(
        chat(messages=[{"role": "user", "content": LONG}], logprobs=True, top_logprobs=5), **LIMITS
    )
    open_pricer = Pricer(TokenizerRegistry(), PricingSettings(max_prompt_logprobs_tokens=0))
    await open_pricer.aprice_completion({"model": "m", "prompt": LONG, "prompt_logprobs": 20}, **LIMITS)


async def test_off_the_loop_the_refusal_names_the_real_count() -> None:
    pricer = Pricer(TokenizerRegistry(), PricingSettings(inline_max_chars=0))
    try:
        with pytest.raises(InvalidRequest) as info:
            await pricer.aprice_completion({"model": "m", "prompt": LONG, "prompt_logprobs": 1}, **LIMITS)
        real = (await pricer.aprice_completion({"model": "m", "prompt": LONG}, **LIMITS)).prefill
        assert info.value.code == "prompt_logprobs_too_long" and f"has about {real}:" in info.value.message
    finally:
        pricer.close()


def _many(shape: str, n: int) -> tuple[str, dict[str, Any]]:
    texts = [f"t{i}" for i in range(n)]
    if shape == "messages":
        return "chat", chat(messages=[{"role": "user", "content": t} for t in texts])
    if shape == "parts":  # 2 messages + their parts
        half = [{"type": "text", "text": t} for t in texts[: n // 2 - 1]]
        rest = [{"type": "text", "text": t} for t in texts[n // 2 - 1 : n - 2]]
        return "chat", chat(messages=[{"role": "user", "content": half}, {"role": "user", "content": rest}])
    if shape == "prompts":
        return "completion", {"model": "m", "prompt": texts}
    if shape == "inputs":
        return "embeddings", {"model": "m", "input": [[1, 2]] * n}
    return "responses", responses(
        input=[{"role": "user", "content": [{"type": "input_text", "text": t}]} for t in texts[: n // 2]]
    )


async def _price(pricer: Pricer, api: str, body: dict[str, Any]) -> Cost:
    big = {**LIMITS, "context_length": 10**7}
    if api == "embeddings":
        return await pricer.aprice_embeddings(body)
    return await {
        "chat": pricer.aprice_chat,
        "completion": pricer.aprice_completion,
        "responses": pricer.aprice_responses,
    }[api](body, **big)


@pytest.mark.parametrize("shape", ["messages", "parts", "prompts", "inputs", "responses"])
async def test_a_request_holds_at_most_max_items_elements(pricer: Pricer, shape: str) -> None:
    # Pricing walks every element on the event loop: 100,000 tiny ones (4 MB) stalled it 0.1-0.2 s.
    most = pricer.settings.max_items
    api, body = _many(shape, most)
    await _price(pricer, api, body)
    api, body = _many(shape, most + 2)
    with pytest.raises(InvalidRequest) as info:
        await _price(pricer, api, body)
    assert "pricing.max_items" in info.value.message and str(most) in info.value.message
    assert info.value.param == {"completion": "prompt", "embeddings": "input", "responses": "input"}.get(
        api, "messages"
    )
    await _price(Pricer(TokenizerRegistry(), PricingSettings(max_items=0)), api, body)  # 0: no bound


async def test_a_long_token_id_prompt_is_one_element(pricer: Pricer) -> None:
    body = {"model": "m", "prompt": [1] * 50_000}
    assert (await pricer.aprice_completion(body, **{**LIMITS, "context_length": 100_000})).prefill == 50_000

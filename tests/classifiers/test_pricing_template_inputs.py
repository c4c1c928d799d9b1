"""What an engine's chat template renders is priced, whatever field carries it.

vLLM and SGLang render more of a chat request into the prompt than OpenAI's fields: ``documents``,
``chat_template_kwargs``, earlier turns' ``reasoning_content``, any key a template reads from a
message. Each of those used to cost nothing here: a tenant could carry a 30k-token prompt in them
and hold 12 tokens of its budget. A ``chat_template`` of the request's own, or ``prompt_embeds``,
cannot be priced at all and is refused.
"""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from classifiers import Cost, InvalidRequest, Pricer, default_tokenizer
from classifiers.pricing.chat import walk as walk_chat
from classifiers.pricing.settings import Rules
from tests.classifiers.support import count

CTX = 200_000
LIMITS: dict[str, Any] = {"default_max_tokens": 16, "max_tokens_limit": None, "context_length": CTX}
TEXT = "word " * 3000  # 3,000 tokens in cl100k_base


def chat(*messages: dict[str, Any], **extra: Any) -> dict[str, Any]:
    return {"model": "m", "messages": list(messages) or [{"role": "user", "content": "Hi"}], **extra}


async def plain(pricer: Pricer) -> int:
    return (await pricer.aprice_chat(chat(), **LIMITS)).prefill


async def test_documents_cost_their_compact_json(pricer: Pricer) -> None:
    docs = [{"title": "manual", "text": TEXT}, {"title": "faq", "text": "short"}]
    cost = await pricer.aprice_chat(chat(documents=docs), **LIMITS)
    assert cost.prefill == await plain(pricer) + count(orjson.dumps(docs).decode())
    assert cost.prefill > 3000


async def test_chat_template_kwargs_cost_their_compact_json(pricer: Pricer) -> None:
    kwargs = {"enable_thinking": True, "custom_instructions": TEXT}
    cost = await pricer.aprice_chat(chat(chat_template_kwargs=kwargs), **LIMITS)
    assert cost.prefill == await plain(pricer) + count(orjson.dumps(kwargs).decode())
    assert (await pricer.aprice_chat(chat(chat_template_kwargs={}), **LIMITS)).prefill == await plain(pricer)


@pytest.mark.parametrize("field", ["reasoning_content", "reasoning", "thinking", "tool_call_id"])
async def test_a_field_beyond_openais_in_a_message_costs_its_compact_json(pricer: Pricer, field: str) -> None:
    body = chat({"role": "assistant", "content": "4", field: TEXT}, {"role": "user", "content": "Hi"})
    without = chat({"role": "assistant", "content": "4"}, {"role": "user", "content": "Hi"})
    added = (await pricer.aprice_chat(body, **LIMITS)).prefill - (
        await pricer.aprice_chat(without, **LIMITS)
    ).prefill
    assert added == count(orjson.dumps({field: TEXT}).decode())
    assert count(TEXT) <= added <= count(TEXT) + 10  # the value's tokens, and a few for key and quotes


async def test_all_other_fields_of_a_message_are_one_count_and_null_costs_nothing(pricer: Pricer) -> None:
    extra = {"pages": [TEXT, {"more": TEXT}], "tag": "x"}
    body = chat({"role": "user", "content": "Hi", "refusal": None, **extra})
    assert (await pricer.aprice_chat(body, **LIMITS)).prefill == await plain(pricer) + count(
        orjson.dumps(extra).decode()
    )
    assert (
        await pricer.aprice_chat(chat({"role": "user", "content": "Hi", "refusal": None}), **LIMITS)
    ).prefill == await plain(pricer)


def test_a_message_of_many_tiny_fields_is_priced_in_one_count(pricer: Pricer) -> None:
    many = {f"k{i}": 1 for i in range(50_000)}
    body = chat({"role": "user", "content": "Hi", **many})
    calls = 0
    tok = default_tokenizer()
    real = tok.count

    class Counting:
        def count(self, text: str) -> int:
            nonlocal calls
            calls += 1
            return real(text)

    cost = walk_chat(Rules.of(pricer.settings), Counting(), body, 16, None, 10**7)  # type: ignore[arg-type]
    assert cost.prefill >= 50_000 * 3  # each '"kNNNNN":1' is several tokens
    assert calls < 10


async def test_the_openai_fields_are_counted_once(pricer: Pricer) -> None:
    # name and tool_calls keep their own rules (per_name_tokens, per_tool_call_tokens): not counted again
    call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    body = chat({"role": "assistant", "content": None, "name": "bob", "tool_calls": [call]})
    s = pricer.settings
    expected = 3 + count("assistant") + s.per_name_tokens + count("bob") + s.per_tool_call_tokens + count("f")
    assert (await pricer.aprice_chat(body, **LIMITS)).prefill == expected + count(
        "{}"
    ) + s.reply_priming_tokens


async def test_chat_reserves_for_best_of_sequences(pricer: Pricer) -> None:
    # vLLM's chat API took best_of too: that many sequences run, n of them are returned
    cost = await pricer.aprice_chat(chat(n=2, best_of=5, max_tokens=100), **LIMITS)
    assert cost == Cost(await plain(pricer), 500)
    with pytest.raises(InvalidRequest) as info:
        await pricer.aprice_chat(chat(n=3, best_of=2), **LIMITS)
    assert info.value.param == "best_of"


async def test_a_chat_template_sent_with_the_request_is_refused(pricer: Pricer) -> None:
    body = chat(chat_template="{% for i in range(100000) %}{{ messages[0].content }}{% endfor %}")
    with pytest.raises(InvalidRequest) as info:
        await pricer.aprice_chat(body, **LIMITS)
    assert (info.value.param, info.value.code) == ("chat_template", "unsupported_parameter")
    assert "remove it" in info.value.message
    assert (await pricer.aprice_chat(chat(chat_template=None), **LIMITS)).prefill == await plain(pricer)


async def test_prompt_embeds_are_refused(pricer: Pricer) -> None:
    body = {"model": "m", "prompt": "x", "prompt_embeds": "AAAA" * 100_000}
    with pytest.raises(InvalidRequest) as info:
        await pricer.aprice_completion(body, **LIMITS)
    assert (info.value.param, info.value.code) == ("prompt_embeds", "unsupported_parameter")
    assert "text or token ids" in info.value.message


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"documents": "text"}, "documents"),
        ({"documents": ["text"]}, "documents"),
        ({"chat_template_kwargs": ["x"]}, "chat_template_kwargs"),
    ],
)
async def test_template_inputs_of_the_wrong_shape_are_a_clear_400(
    pricer: Pricer, extra: dict[str, Any], param: str
) -> None:
    with pytest.raises(InvalidRequest) as info:
        await pricer.aprice_chat(chat(**extra), **LIMITS)
    assert info.value.param == param and "must be" in info.value.message


async def test_a_deep_value_in_a_message_field_names_the_message(pricer: Pricer) -> None:
    deep: Any = {}
    for _ in range(300):
        deep = {"a": deep}
    for key in ("extra", "x" * 10_000):
        with pytest.raises(InvalidRequest) as info:
            await pricer.aprice_chat(chat({"role": "user", "content": "Hi", key: deep}), **LIMITS)
        assert info.value.param == "messages[0]"
        assert len(info.value.message) < 200


async def test_the_responses_api_prices_and_refuses_them_as_chat_does(pricer: Pricer) -> None:
    # vLLM serves /v1/responses through the model's chat template too
    base = {"model": "m", "input": "Hi"}
    plain_cost = (await pricer.aprice_responses(base, **LIMITS)).prefill
    docs = [{"title": "manual", "text": TEXT}]
    with_docs = (await pricer.aprice_responses(base | {"documents": docs}, **LIMITS)).prefill
    assert with_docs == plain_cost + count(orjson.dumps(docs).decode())
    with pytest.raises(InvalidRequest) as info:
        await pricer.aprice_responses(base | {"chat_template": "{{ messages }}"}, **LIMITS)
    assert info.value.param == "chat_template"

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

from classifiers import Cost, InvalidRequest, Pricer, TokenizerRegistry, default_tokenizer

CTX = 200_000
LIMITS: dict[str, Any] = {"default_max_tokens": 16, "max_tokens_limit": None, "context_length": CTX}
TEXT = "word " * 3000  # 3,000 tokens in cl100k_base


@pytest.fixture(scope="module")
def pricer() -> Pricer:
    return Pricer(TokenizerRegistry())


def count(text: str) -> int:
    return default_tokenizer().count(text)


def chat(*messages: dict[str, Any], **extra: Any) -> dict[str, Any]:
    return {"model": "m", "messages": list(messages) or [{"role": "user", "content": "Hi"}], **extra}


def plain(pricer: Pricer) -> int:
    return pricer.price_chat(chat(), **LIMITS).prefill


def test_documents_cost_their_compact_json(pricer: Pricer) -> None:
    docs = [{"title": "manual", "text": TEXT}, {"title": "faq", "text": "short"}]
    cost = pricer.price_chat(chat(documents=docs), **LIMITS)
    assert cost.prefill == plain(pricer) + count(orjson.dumps(docs).decode())
    assert cost.prefill > 3000


def test_chat_template_kwargs_cost_their_compact_json(pricer: Pricer) -> None:
    kwargs = {"enable_thinking": True, "custom_instructions": TEXT}
    cost = pricer.price_chat(chat(chat_template_kwargs=kwargs), **LIMITS)
    assert cost.prefill == plain(pricer) + count(orjson.dumps(kwargs).decode())
    assert pricer.price_chat(chat(chat_template_kwargs={}), **LIMITS).prefill == plain(pricer)


@pytest.mark.parametrize("field", ["reasoning_content", "reasoning", "thinking", "tool_call_id"])
def test_a_string_field_beyond_openais_in_a_message_costs_its_tokens(pricer: Pricer, field: str) -> None:
    body = chat({"role": "assistant", "content": "4", field: TEXT}, {"role": "user", "content": "Hi"})
    without = chat({"role": "assistant", "content": "4"}, {"role": "user", "content": "Hi"})
    added = pricer.price_chat(body, **LIMITS).prefill - pricer.price_chat(without, **LIMITS).prefill
    assert added == count(TEXT)


def test_any_other_value_in_a_message_costs_its_compact_json_and_null_costs_nothing(pricer: Pricer) -> None:
    extra = {"pages": [TEXT, {"more": TEXT}]}
    body = chat({"role": "user", "content": "Hi", "refusal": None, **extra})
    pages = orjson.dumps(extra["pages"]).decode()
    assert pricer.price_chat(body, **LIMITS).prefill == plain(pricer) + count(pages)


def test_the_openai_fields_are_counted_once(pricer: Pricer) -> None:
    # name and tool_calls keep their own rules (per_name_tokens, per_tool_call_tokens): not counted again
    call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    body = chat({"role": "assistant", "content": None, "name": "bob", "tool_calls": [call]})
    s = pricer.settings
    expected = 3 + count("assistant") + s.per_name_tokens + count("bob") + s.per_tool_call_tokens + count("f")
    assert pricer.price_chat(body, **LIMITS).prefill == expected + count("{}") + s.reply_priming_tokens


def test_chat_reserves_for_best_of_sequences(pricer: Pricer) -> None:
    # vLLM's chat API took best_of too: that many sequences run, n of them are returned
    cost = pricer.price_chat(chat(n=2, best_of=5, max_tokens=100), **LIMITS)
    assert cost == Cost(plain(pricer), 500)
    with pytest.raises(InvalidRequest) as info:
        pricer.price_chat(chat(n=3, best_of=2), **LIMITS)
    assert info.value.param == "best_of"


def test_a_chat_template_sent_with_the_request_is_refused(pricer: Pricer) -> None:
    body = chat(chat_template="{% for i in range(100000) %}{{ messages[0].content }}{% endfor %}")
    with pytest.raises(InvalidRequest) as info:
        pricer.price_chat(body, **LIMITS)
    assert (info.value.param, info.value.code) == ("chat_template", "unsupported_parameter")
    assert "remove it" in info.value.message
    assert pricer.price_chat(chat(chat_template=None), **LIMITS).prefill == plain(pricer)


def test_prompt_embeds_are_refused(pricer: Pricer) -> None:
    body = {"model": "m", "prompt": "x", "prompt_embeds": "AAAA" * 100_000}
    with pytest.raises(InvalidRequest) as info:
        pricer.price_completion(body, **LIMITS)
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
def test_template_inputs_of_the_wrong_shape_are_a_clear_400(
    pricer: Pricer, extra: dict[str, Any], param: str
) -> None:
    with pytest.raises(InvalidRequest) as info:
        pricer.price_chat(chat(**extra), **LIMITS)
    assert info.value.param == param and "must be" in info.value.message


def test_a_deep_value_under_an_odd_key_names_the_message_not_the_key(pricer: Pricer) -> None:
    deep: Any = {}
    for _ in range(300):
        deep = {"a": deep}
    for key, param in (("extra", "messages[0].extra"), ("x" * 10_000, "messages[0]"), ("a b", "messages[0]")):
        with pytest.raises(InvalidRequest) as info:
            pricer.price_chat(chat({"role": "user", "content": "Hi", key: deep}), **LIMITS)
        assert info.value.param == param
        assert len(info.value.message) < 200

"""Token ids a request carries are checked before an engine indexes its tensors with them.

vLLM used ``stop_token_ids`` / ``allowed_token_ids`` / ``logit_bias`` ids as indices on the device
without checking them (#54195, #16529) and sized their sampler rows at 128 / 1,024 ids (#55164):
one request out of range took the whole engine down for everyone on it. The gateway refuses such
requests with a 400 that names the field and the bound."""

from __future__ import annotations

from typing import Any

import pytest

from classifiers import InvalidRequest, Pricer, PricingSettings, TokenizerRegistry

LIMITS: dict[str, Any] = {"default_max_tokens": 16, "max_tokens_limit": None, "context_length": 8192}
VOCAB = 128_256  # Llama 3's


@pytest.fixture(scope="module")
def pricer() -> Pricer:
    return Pricer(TokenizerRegistry(), vocab_sizes=[("llama-*", VOCAB)])


def chat(model: str = "m", **extra: Any) -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "user", "content": "Hi"}], **extra}


def completion(model: str = "m", **extra: Any) -> dict[str, Any]:
    return {"model": model, "prompt": "Hi", **extra}


async def price(pricer: Pricer, body: dict[str, Any]) -> None:
    if "messages" in body:
        await pricer.aprice_chat(body, **LIMITS)
    elif "prompt" in body:
        await pricer.aprice_completion(body, **LIMITS)
    else:
        await pricer.aprice_embeddings(body)


async def refused(pricer: Pricer, body: dict[str, Any], param: str, *words: str) -> str:
    with pytest.raises(InvalidRequest) as info:
        await price(pricer, body)
    assert info.value.param == param
    message = info.value.message
    assert len(message) < 240 and all(w in message for w in words), message
    return message


@pytest.mark.parametrize("build", [chat, completion])
@pytest.mark.parametrize(
    ("key", "most", "setting"),
    [("stop_token_ids", 128, "max_stop_token_ids"), ("allowed_token_ids", 1024, "max_allowed_token_ids")],
)
async def test_token_id_lists_stop_at_the_width_of_the_engines_rows(
    pricer: Pricer, build: Any, key: str, most: int, setting: str
) -> None:
    await price(pricer, build(**{key: list(range(most))}))
    await refused(pricer, build(**{key: list(range(most + 1))}), key, str(most + 1), f"pricing.{setting}")


async def test_a_zero_bound_lets_any_number_of_ids_through() -> None:
    open_pricer = Pricer(TokenizerRegistry(), PricingSettings(max_stop_token_ids=0, max_allowed_token_ids=0))
    await price(open_pricer, chat(stop_token_ids=list(range(5000)), allowed_token_ids=list(range(5000))))


@pytest.mark.parametrize("build", [chat, completion])
@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"stop_token_ids": [2, -1]}, "stop_token_ids"),
        ({"allowed_token_ids": [-7]}, "allowed_token_ids"),
        ({"logit_bias": {"-1": 5}}, "logit_bias"),
    ],
)
async def test_negative_token_ids_are_refused(
    pricer: Pricer, build: Any, extra: dict[str, Any], param: str
) -> None:
    await refused(pricer, build(**extra), param)


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"stop_token_ids": "5"}, "stop_token_ids"),
        ({"stop_token_ids": [1.0]}, "stop_token_ids"),
        ({"stop_token_ids": [True]}, "stop_token_ids"),  # a bool is an int to Python, not to the engine
        ({"allowed_token_ids": {"1": 1}}, "allowed_token_ids"),
        ({"allowed_token_ids": [[1]]}, "allowed_token_ids"),
        ({"stop_token_ids": [2**63]}, "stop_token_ids"),
        ({"logit_bias": {"abc": 1}}, "logit_bias"),
        ({"logit_bias": {" 12": 1}}, "logit_bias"),
        ({"logit_bias": {"+12": 1}}, "logit_bias"),
        ({"logit_bias": {"1_000": 1}}, "logit_bias"),
        ({"logit_bias": {"1e3": 1}}, "logit_bias"),
        ({"logit_bias": {"１２": 1}}, "logit_bias"),  # full-width digits: isdigit() says yes, int() reads 12
        ({"logit_bias": {"9" * 21: 1}}, "logit_bias"),
        ({"logit_bias": {"12": "x"}}, "logit_bias"),
        ({"logit_bias": {"12": True}}, "logit_bias"),
        ({"logit_bias": {"12": None}}, "logit_bias"),
    ],
)
async def test_token_ids_of_the_wrong_shape_are_a_400(
    pricer: Pricer, extra: dict[str, Any], param: str
) -> None:
    for build in (chat, completion):
        await refused(pricer, build(**extra), param)


async def test_well_formed_ids_price_as_before(pricer: Pricer) -> None:
    base = await pricer.aprice_chat(chat(), **LIMITS)
    body = chat(stop_token_ids=[], allowed_token_ids=[0, 5], logit_bias={"0": -100, "50256": 2.5})
    assert await pricer.aprice_chat(body, **LIMITS) == base


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (chat("llama-3.1-8b", stop_token_ids=[VOCAB]), "stop_token_ids"),
        (chat("llama-3.1-8b", allowed_token_ids=[1, VOCAB + 5]), "allowed_token_ids"),
        (chat("llama-3.1-8b", logit_bias={str(VOCAB): 1}), "logit_bias"),
        (completion("llama-3.1-8b", stop_token_ids=[151645]), "stop_token_ids"),  # another model's <|im_end|>
        ({"model": "llama-3.1-8b", "prompt": [1, VOCAB]}, "prompt"),
        ({"model": "llama-3.1-8b", "prompt": [[1], [2, 2**40]]}, "prompt"),
        ({"model": "llama-3.1-8b", "input": [VOCAB]}, "input"),
        ({"model": "llama-3.1-8b", "input": [[3], [VOCAB]]}, "input"),
    ],
)
async def test_ids_outside_a_configured_vocabulary_are_refused_naming_its_size(
    pricer: Pricer, body: dict[str, Any], param: str
) -> None:
    await refused(pricer, body, param, str(VOCAB), "models.*.vocab_size", "llama-3.1-8b")
    # The same ids are the engine's to judge for a model without a configured vocabulary.
    await price(pricer, {**body, "model": "other"})


async def test_the_last_id_of_the_vocabulary_is_accepted(pricer: Pricer) -> None:
    last = VOCAB - 1
    await price(
        pricer, chat("llama-3", stop_token_ids=[last], allowed_token_ids=[last], logit_bias={str(last): 1})
    )
    await price(pricer, {"model": "llama-3", "prompt": [[last], [0, last]]})
    await price(pricer, {"model": "llama-3", "input": [last]})

"""A conservative price for allow-listed pass-through POSTs (/v1/rerank, /v1/score, /v1/audio/...)."""

from __future__ import annotations

import orjson
import pytest

from classifiers import BytesTokenizer, Cost, Pricer, default_tokenizer


async def test_prefill_is_the_whole_body_in_the_models_tokenizer(pricer: Pricer) -> None:
    raw = orjson.dumps({"model": "m", "query": "capital of France", "documents": ["Paris", "Berlin"]})
    cost = await pricer.aprice_passthrough(raw, model="m", default_max_tokens=256, generates=False)
    assert cost == Cost(default_tokenizer().count(raw.decode()), 0)


async def test_an_unknown_model_falls_back_to_the_byte_estimate(pricer: Pricer) -> None:
    raw = b'{"query": "capital of France", "documents": ["Paris", "Berlin"]}'
    cost = await pricer.aprice_passthrough(raw, model=None, default_max_tokens=256, generates=False)
    assert cost.prefill == BytesTokenizer().count(raw.decode())


@pytest.mark.parametrize("raw", [b" ", b"\n", b"{}", b"\xff", b"\x00", b"a"])
@pytest.mark.parametrize("model", ["m", None])
async def test_a_non_empty_body_never_prices_to_zero(pricer: Pricer, raw: bytes, model: str | None) -> None:
    assert (
        await pricer.aprice_passthrough(raw, model=model, default_max_tokens=0, generates=False)
    ).prefill >= 1


async def test_an_empty_body_costs_only_its_decode(pricer: Pricer) -> None:
    assert await pricer.aprice_passthrough(b"", model=None, default_max_tokens=64) == Cost(0, 64)
    assert await pricer.aprice_passthrough(b"", model=None, default_max_tokens=64, generates=False) == Cost(
        0, 0
    )


async def test_binary_bodies_are_read_with_replacement_not_refused(pricer: Pricer) -> None:
    raw = bytes(range(256)) * 8  # e.g. a multipart audio upload
    for model in ("m", None):
        cost = await pricer.aprice_passthrough(raw, model=model, default_max_tokens=0, generates=False)
        assert cost.prefill > 0


async def test_decode_reads_the_bodys_output_limit_conservatively(pricer: Pricer) -> None:
    async def decode(body: object, generates: bool = True) -> int:
        raw = orjson.dumps(body)
        return (
            await pricer.aprice_passthrough(raw, model="m", default_max_tokens=256, generates=generates)
        ).decode

    assert await decode({"max_tokens": 40}) == 40
    assert await decode({"max_completion_tokens": 30}) == 30
    assert await decode({"max_output_tokens": 20}) == 20
    assert await decode({"max_tokens": 40, "max_output_tokens": 90, "max_completion_tokens": 10}) == 90
    assert await decode({"max_tokens": 40}, generates=False) == 40  # an explicit limit always counts
    assert await decode({"query": "x"}) == 256  # a generating route without a limit: the default
    assert await decode({"query": "x"}, generates=False) == 0
    # Values the backend will refuse reserve like an absent field (the backend answers the 400).
    for bad in (-1, True, "10", 1.5, None):
        assert await decode({"max_tokens": bad}) == 256
        assert await decode({"max_tokens": bad}, generates=False) == 0


async def test_non_json_bodies_use_the_route_default(pricer: Pricer) -> None:
    for raw in (b"not json", b"[1, 2]", b'{"max_tokens": 5'):
        assert (await pricer.aprice_passthrough(raw, model=None, default_max_tokens=99)).decode == 99
        assert (
            await pricer.aprice_passthrough(raw, model=None, default_max_tokens=99, generates=False)
        ).decode == 0


async def test_an_optional_context_length_caps_the_decode(pricer: Pricer) -> None:
    raw = orjson.dumps({"max_tokens": 10**6})
    prefill = default_tokenizer().count(raw.decode())
    cost = await pricer.aprice_passthrough(raw, model="m", default_max_tokens=1, context_length=1000)
    assert cost == Cost(prefill, 1000 - prefill)
    big = b"word " * 2000
    assert (
        await pricer.aprice_passthrough(big, model="m", default_max_tokens=50, context_length=100)
    ).decode == 0


async def test_a_huge_output_limit_stays_exact_in_the_stores_arithmetic(pricer: Pricer) -> None:
    raw = b'{"max_tokens": 18446744073709551615}'  # the largest integer orjson reads as an int
    cost = await pricer.aprice_passthrough(raw, model=None, default_max_tokens=0)
    assert cost.decode == 2**32
    assert cost.total < 2**53

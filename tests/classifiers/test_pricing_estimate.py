"""Estimate mode: long never-seen prompts priced at once on a learned tokens-per-character ratio, the
exact count made meanwhile (classifiers/pricing/estimate.py)."""

from __future__ import annotations

import random
import uuid
from collections.abc import AsyncIterator
from typing import Any

import pytest

from classifiers import InvalidRequest, Pricer, PricingSettings, TokenizerRegistry
from classifiers.pricing.estimate import CharRatios, EstimateErrors
from tests.classifiers.support import LIMITS

WIDE: dict[str, Any] = {**LIMITS, "context_length": 1_000_000}
WORDS = "the quick brown fox jumps over a lazy dog while seven engineers debug the scheduler".split()


def prose(words: int, rng: random.Random) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


def body(text: str) -> dict[str, Any]:
    return {"model": "m", "messages": [{"role": "user", "content": text}]}


@pytest.fixture
async def estimating() -> AsyncIterator[Pricer]:
    p = Pricer(TokenizerRegistry(), PricingSettings(estimate_above_chars=20_000))
    yield p
    p.close()


async def train(p: Pricer, key: str, rng: random.Random, texts: int = 8) -> None:
    """Long never-seen texts counted exactly (off the loop): what the ratio is learned from."""
    for _ in range(texts):
        cost = await p.aprice_chat(body(prose(2_500, rng)), **WIDE, fair_key=key)
        assert cost.exact is None


async def test_off_by_default_every_long_prompt_is_counted_exactly() -> None:
    p = Pricer(TokenizerRegistry())
    rng, key = random.Random(1), uuid.uuid4().hex
    try:
        await train(p, key, rng)
        cost = await p.aprice_chat(body(prose(20_000, rng)), **WIDE, fair_key=key)
        assert cost.exact is None
    finally:
        p.close()


async def test_no_estimate_until_the_ratio_is_learned_then_an_estimate_with_its_exact_count(
    estimating: Pricer,
) -> None:
    rng, key = random.Random(2), uuid.uuid4().hex
    await train(estimating, key, rng, texts=7)
    text = prose(20_000, rng)
    assert (await estimating.aprice_chat(body(text), **WIDE, fair_key=key)).exact is None  # 7 < 8 samples
    text = prose(20_000, rng)
    estimate = await estimating.aprice_chat(body(text), **WIDE, fair_key=key)
    assert estimate.exact is not None
    exact = await estimate.exact
    reference = Pricer(TokenizerRegistry(), PricingSettings(encode_threads=0))
    assert exact == await reference.aprice_chat(body(text), **WIDE, fair_key=key)  # the exact walk's cost
    assert exact.exact is None and exact.decode == estimate.decode
    # Same prose as it learned from: the estimate is above the count, by about the margin.
    assert exact.prefill <= estimate.prefill <= exact.prefill * 1.25
    stats = estimating.estimates()
    assert (stats["estimated"], stats["counted"], stats["under"]) == (1, 1, 0)
    assert stats["ratios"]["cl100k_base"]["tenants"] >= 1  # type: ignore[index]


async def test_short_requests_and_long_texts_below_the_threshold_stay_exact(estimating: Pricer) -> None:
    rng, key = random.Random(3), uuid.uuid4().hex
    await train(estimating, key, rng)
    assert (await estimating.aprice_chat(body(prose(20, rng)), **WIDE, fair_key=key)).exact is None
    below = prose(2_000, rng)  # off the loop (over inline_max_chars) but under 20,000 characters
    assert len(below) < 20_000
    assert (await estimating.aprice_chat(body(below), **WIDE, fair_key=key)).exact is None


async def test_near_the_context_length_the_exact_count_decides_and_names_itself(estimating: Pricer) -> None:
    rng, key = random.Random(4), uuid.uuid4().hex
    await train(estimating, key, rng)
    text = prose(20_000, rng)
    reference = Pricer(TokenizerRegistry(), PricingSettings(encode_threads=0))
    exact = await reference.aprice_chat(body(text), **WIDE, fair_key=key)
    # A context the exact prompt fits and the estimate (with its margin) does not: exact, no refusal.
    ctx = exact.prefill + 1
    fits = await estimating.aprice_chat(body(text), **{**WIDE, "context_length": ctx}, fair_key=key)
    assert fits.exact is None and fits.prefill == exact.prefill
    # One the exact prompt does not fit: the refusal carries the real count, not the estimate.
    text = prose(20_000, rng)
    exact = await reference.aprice_chat(body(text), **WIDE, fair_key=key)
    with pytest.raises(InvalidRequest) as refused:
        await estimating.aprice_chat(
            body(text), **{**WIDE, "context_length": exact.prefill - 50}, fair_key=key
        )
    assert refused.value.code == "context_length_exceeded" and str(exact.prefill) in refused.value.message


async def test_a_text_that_tokenizes_far_above_the_ratio_is_estimated_low_and_the_exact_count_says_so(
    estimating: Pricer,
) -> None:
    """A hostile tenant's text (CJK after English prose) beats the ratio; the exact count, made
    anyway, finds it out (the gateway grows the lease by the difference)."""
    rng, key = random.Random(5), uuid.uuid4().hex
    await train(estimating, key, rng)
    hostile = "".join(chr(rng.randrange(0x4E00, 0x9FFF)) for _ in range(25_000))
    estimate = await estimating.aprice_chat(body(hostile), **WIDE, fair_key=key)
    assert estimate.exact is not None
    exact = await estimate.exact
    assert exact.prefill > 2 * estimate.prefill
    stats = estimating.estimates()
    assert stats["under"] == 1
    assert stats["exact_over_estimate"]["max"] > 2  # type: ignore[index]


async def test_a_caller_that_goes_away_cancels_the_exact_count(estimating: Pricer) -> None:
    rng, key = random.Random(6), uuid.uuid4().hex
    await train(estimating, key, rng)
    estimate = await estimating.aprice_chat(body(prose(40_000, rng)), **WIDE, fair_key=key)
    assert estimate.exact is not None
    estimate.exact.cancel()
    with pytest.raises(BaseException):  # noqa: B017  (CancelledError)
        await estimate.exact
    stats = estimating.estimates()
    assert (stats["estimated"], stats["counted"]) == (1, 0)  # no error observed for a count never finished


def test_the_ratio_is_a_high_quantile_of_recent_long_texts_and_ignores_short_ones() -> None:
    ratios = CharRatios()
    for i in range(7):
        ratios.observe("a", "t", 10_000, 2_000 + i)
    ratios.observe("a", "t", 100, 90)  # too short to say anything
    assert ratios.ratio("a", "t") is None
    ratios.observe("a", "t", 10_000, 3_000)
    assert ratios.ratio("a", "t") == pytest.approx(0.3)  # the 90th percentile of 8: the highest
    assert ratios.estimate("a", "t", 1_000, 0.1) == 330
    assert ratios.estimate("a", "other", 1_000, 0.1) is None
    assert ratios.estimate("b", "t", 1_000, 0.1) is None  # another tenant learns its own
    errors = EstimateErrors()
    errors.estimated = 2
    errors.observe(100, 90)
    errors.observe(100, 150)
    snap = errors.snapshot()
    assert (snap["estimated"], snap["counted"], snap["under"]) == (2, 2, 1)
    assert snap["exact_over_estimate"] == {"p50": 0.9, "p90": 1.5, "p99": 1.5, "max": 1.5, "min": 0.9}


async def test_a_tenant_flooding_dense_text_moves_only_its_own_estimates(estimating: Pricer) -> None:
    """Ratios are per tenant: a flood of text with many tokens per character (CJK) raises the
    flooding tenant's estimates, never another's reservations."""
    rng = random.Random(7)
    victim, flooder = uuid.uuid4().hex, uuid.uuid4().hex
    await train(estimating, victim, rng)
    for _ in range(8):
        dense = "".join(chr(rng.randrange(0x4E00, 0x9FFF)) for _ in range(9_000))  # off the loop
        assert (await estimating.aprice_chat(body(dense), **WIDE, fair_key=flooder)).exact is None
    text = prose(20_000, rng)
    estimate = await estimating.aprice_chat(body(text), **WIDE, fair_key=victim)
    assert estimate.exact is not None
    exact = await estimate.exact
    assert estimate.prefill <= exact.prefill * 1.25  # the victim's own ratio, not the flood's
    ratios = estimating.estimates()["ratios"]["cl100k_base"]  # type: ignore[index]
    assert ratios["tenants"] == 2 and ratios["tokens_per_char_max"] > 5 * ratios["tokens_per_char_min"]

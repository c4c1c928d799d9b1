"""The prompt-overhead learner: what engines count beyond the priced prompt, and how it is applied."""

from __future__ import annotations

import pytest

from classifiers.prompt_overhead import (
    MIN_SAMPLES,
    OverheadSetting,
    PromptOverheads,
    corrected,
    plausible,
)


def test_a_constant_template_overhead_is_learned_and_applied_after_min_samples() -> None:
    po = PromptOverheads()
    for _ in range(MIN_SAMPLES - 1):
        assert po.observe("llama", "chat", priced=16, reported=39)
    assert po.learned("llama", "chat") == 0 and po.overhead("llama", "chat") == 0  # not enough yet
    po.observe("llama", "chat", priced=16, reported=39)
    assert po.learned("llama", "chat") == 23 and po.overhead("llama", "chat") == 23
    # Per model and route: a completion prompt renders no chat template.
    assert po.overhead("llama", "completion") == 0 and po.overhead("qwen", "chat") == 0


def test_the_estimate_is_a_decayed_mean_with_the_given_half_life() -> None:
    po = PromptOverheads(half_life=1, min_samples=1)  # each sample weighs half the next one
    po.observe("m", "chat", priced=100, reported=100)
    po.observe("m", "chat", priced=100, reported=110)
    entry = po.get("m", "chat")
    assert entry is not None and entry.difference == pytest.approx((0 * 0.5 + 10) / 1.5)
    assert po.learned("m", "chat") == 7
    # A negative difference (tools priced 69-76, counted 41) is learned too, rounded away from zero.
    neg = PromptOverheads(min_samples=1)
    neg.observe("m", "chat", priced=76, reported=41)
    neg.observe("m", "chat", priced=70, reported=41)
    assert neg.learned("m", "chat") == -32  # mean -32


def test_implausible_samples_are_counted_but_not_learned() -> None:
    assert plausible(16, 39) and plausible(10, 1034)  # a short prompt with a long system prompt
    assert plausible(76, 41) and plausible(100, 25)
    assert not plausible(16, 0)  # the engine filled no prompt count
    assert not plausible(0, 12)  # nothing priced to compare with
    assert not plausible(100, 24)  # under a quarter of the priced prompt
    assert not plausible(10_000, 21_025)  # over twice a large prompt + 1,024
    po = PromptOverheads(min_samples=1)
    assert not po.observe("m", "chat", priced=16, reported=0)
    assert not po.observe("m", "chat", priced=16_386, reported=300)  # an image priced at its most
    po.observe("m", "chat", priced=16, reported=39)
    entry = po.get("m", "chat")
    assert entry is not None and (entry.samples, entry.rejected) == (1, 2)
    assert po.learned("m", "chat") == 23


def test_at_most_max_keys_models_are_learned() -> None:
    po = PromptOverheads(max_keys=2, min_samples=1)
    assert po.observe("a", "chat", 10, 20) and po.observe("b", "chat", 10, 20)
    assert not po.observe("c", "chat", 10, 20)
    assert po.overhead("c", "chat") == 0 and len(po) == 2 and po.untracked == 1
    assert po.observe("a", "chat", 10, 20)  # known pairs keep learning


def test_configured_overhead_wins_on_template_routes_and_learning_can_be_off() -> None:
    po = PromptOverheads(min_samples=1)
    po.observe("m", "chat", 16, 39)
    po.observe("m", "completion", 16, 17)
    pinned = OverheadSetting(configured=20, learn=True, pattern="m*")
    assert po.overhead("m", "chat", pinned) == 20
    assert po.overhead("m", "responses", pinned) == 20  # even before anything is learned
    assert po.overhead("m", "completion", pinned) == 1  # no chat template there: learned
    off = OverheadSetting(configured=None, learn=False, pattern="m*")
    assert po.overhead("m", "chat", off) == 0 and po.overhead("m", "completion", off) == 0
    assert po.overhead("m", "chat", OverheadSetting(configured=0)) == 0  # 0 pins no correction


def test_a_negative_overhead_never_takes_more_than_half_the_priced_prompt() -> None:
    assert corrected(16, 23) == 39
    assert corrected(76, -35) == 41
    assert corrected(10, -30) == 5 and corrected(11, -30) == 6
    assert corrected(1, -5) == 1 and corrected(0, -5) == 0 and corrected(0, 3) == 3


def test_snapshot_reports_means_overheads_and_errors_before_and_after() -> None:
    po = PromptOverheads(min_samples=2)
    po.observe("m", "chat", priced=16, reported=39)  # admitted at 16: off by 23
    po.observe("m", "chat", priced=16, reported=39, charged=39)  # admitted corrected: exact
    po.observe("m", "completion", priced=5, reported=0)  # rejected
    snap = po.snapshot(lambda model: OverheadSetting(None, True, "m*"))
    d = 0.5 ** (1 / 64)
    assert (snap["half_life_requests"], snap["min_samples"], snap["untracked"]) == (64, 2, 0)
    chat, completion = snap["models"]  # type: ignore[misc]
    assert chat == {
        "model": "m",
        "route": "chat",
        "pattern": "m*",
        "samples": 2,
        "rejected": 0,
        "mean_priced": 16.0,
        "mean_reported": 39.0,
        "learned_overhead": 23,
        "configured_overhead": None,
        "learning": True,
        "applied_overhead": 23,
        "error_before": 23.0,
        "error_after": pytest.approx(23 * d / (d + 1), abs=0.1),  # the newer sample weighs more
    }
    assert completion["samples"] == 0 and completion["rejected"] == 1
    assert completion["learned_overhead"] is None and completion["applied_overhead"] == 0


def test_a_learned_overhead_moves_prices_at_most_max_learned_either_way() -> None:
    from classifiers.prompt_overhead import MAX_LEARNED, PromptOverheads

    learner = PromptOverheads()
    for _ in range(20):  # one tenant's prompts the engine counts ~900 tokens above their price
        assert learner.observe("m", "chat", 1000, 1900)
    assert learner.learned("m", "chat") == 900
    assert learner.overhead("m", "chat") == MAX_LEARNED
    for _ in range(200):
        learner.observe("n", "chat", 2000, 600)
    assert learner.overhead("n", "chat") == -MAX_LEARNED

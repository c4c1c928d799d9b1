"""Unit tests of budgets.retry: the release-rate EWMA and the retry-after estimate."""

from __future__ import annotations

import math

import pytest

from budgets import policy
from budgets.policy import PolicyState
from budgets.retry import ReleaseRate, retry_after
from tests.budgets.support import P, Q, demand, layout, shared


def test_rate_converges_to_a_steady_rate_and_decays_when_idle() -> None:
    meter = ReleaseRate(tau_s=10.0)
    assert meter.value(0.0) == 0.0
    for i in range(1, 201):  # 50 tokens every 0.5 s = 100 tokens/s for 100 s
        meter.add(50, i * 0.5)
    assert meter.value(100.0) == pytest.approx(100.0, rel=0.05)
    assert meter.value(110.0) == pytest.approx(meter.value(100.0) / math.e)


def busy_state() -> PolicyState:
    state = PolicyState(layout([shared(P, 100), shared(Q, 1000)], ["a", "b"]))
    assert policy.grant_immediately(state, demand("b", 80, P))
    return state


def test_estimate_is_tokens_needed_over_release_rate() -> None:
    state = busy_state()
    policy.enqueue(state, demand("b", 100, P, tier="critical"), now=0.0)  # ahead of a standard ticket
    rates = {P: ReleaseRate(tau_s=10.0, rate=20.0, last=0.0)}
    # needed = 100 queued ahead + 50 - (90 - 80 free under standard's ceiling) = 140 at 20/s
    assert retry_after(state, demand("a", 50, P, Q, tier="standard"), rates, now=0.0) == pytest.approx(7.0)
    # Batch (70 % ceiling: -10 free) also waits behind the standard-or-better queue.
    assert retry_after(state, demand("a", 50, P, tier="batch"), rates, now=0.0) == pytest.approx(8.0)


def test_estimate_is_clamped() -> None:
    state = busy_state()
    fast = {P: ReleaseRate(tau_s=10.0, rate=1e6, last=0.0)}
    assert retry_after(state, demand("a", 50, P), fast, now=0.0) == 1.0
    # Nothing released recently: the tier's whole queue wait (critical: 30 s), not infinity.
    assert retry_after(state, demand("a", 50, P), {}, now=0.0) == 30.0
    slow = {P: ReleaseRate(tau_s=10.0, rate=0.001, last=0.0)}
    assert retry_after(state, demand("a", 50, P, tier="batch"), slow, now=0.0) == 600.0
    # Fits right now (e.g. only its own tenant pool was full): the minimum.
    assert retry_after(state, demand("a", 5, P), {}, now=0.0) == 1.0

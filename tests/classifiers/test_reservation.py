"""Output reservations: the limit, a fixed number, or a learned quantile that follows the workload."""

from __future__ import annotations

import random

from classifiers.reservation import OutputEstimator, ReservationSettings, bins


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def estimator(clock: Clock | None = None, **settings: object) -> OutputEstimator:
    return OutputEstimator(ReservationSettings(**settings), clock=clock or Clock())  # type: ignore[arg-type]


def test_max_tokens_mode_reserves_the_limit_and_fixed_caps_it() -> None:
    e = estimator()
    k = e.key("t", "m", "c", 100)
    assert e.reserve(k, 4096) == 4096
    f = estimator(mode="fixed", fixed_tokens=300)
    assert f.reserve(k, 4096) == 300 and f.reserve(k, 100) == 100


def test_a_learned_key_reserves_its_limit_until_it_has_enough_samples() -> None:
    e = estimator(mode="learned", min_samples=10)
    k = e.key("t", "m", "c", 100)
    for _ in range(9):
        e.observe(k, 50)
        assert e.reserve(k, 4096) == 4096
    e.observe(k, 50)
    assert e.reserve(k, 4096) == 56  # the upper edge of 50's bin


def test_the_learned_estimate_is_a_high_quantile_rounded_up_and_never_above_the_limit() -> None:
    rng = random.Random(1)
    e = estimator(mode="learned", quantile=0.95)
    k = e.key("t", "m", "c", 100)
    outputs = [max(1, int(rng.lognormvariate(4.86, 0.66))) for _ in range(2000)]  # median ~129
    for n in outputs:
        e.observe(k, n)
    true_p95 = sorted(outputs)[int(0.95 * len(outputs))]
    got = e.reserve(k, 4096)
    assert true_p95 <= got <= true_p95 * 1.2 + 1  # one bin at most above the truth
    assert e.reserve(k, 100) == 100  # never more than the request asked for
    assert got in bins()


def test_the_estimate_follows_a_changing_workload() -> None:
    clock = Clock()
    e = estimator(clock, mode="learned", half_life_s=60.0, min_samples=5)
    k = e.key("t", "m", "c", 100)
    for _ in range(200):
        e.observe(k, 40)
        clock.t += 0.5
    assert e.reserve(k, 4096) < 50
    for _ in range(200):  # answers get long; the old short ones fade with the half-life
        e.observe(k, 900)
        clock.t += 0.5
    assert e.reserve(k, 4096) >= 900


def test_keys_are_split_by_prompt_length_and_bounded_in_number() -> None:
    e = estimator(mode="learned", min_samples=1, max_keys=3, prompt_buckets=(1000,))
    short, long_ = e.key("t", "m", "c", 10), e.key("t", "m", "c", 5000)
    assert short != long_
    e.observe(short, 10)
    e.observe(long_, 2000)
    assert e.reserve(short, 4096) < e.reserve(long_, 4096)
    for tenant in ("a", "b", "c"):
        e.observe(e.key(tenant, "m", "c", 10), 10)
    assert len(e) == 3  # the least recently used keys went first
    assert e.reserve(short, 4096) == 4096  # evicted: back to cold start

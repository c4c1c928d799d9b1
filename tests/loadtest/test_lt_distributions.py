import random
import statistics

import pytest

from loadtest.distributions import Fixed, LogNormal, SpecError, Uniform, parse_length_dist


def test_fixed_and_int_shorthand() -> None:
    rng = random.Random(1)
    assert parse_length_dist(28000, "x") == Fixed(28000)
    assert {parse_length_dist({"dist": "fixed", "value": 5}, "x").sample(rng) for _ in range(10)} == {5}


def test_uniform_stays_in_bounds_and_covers_them() -> None:
    rng = random.Random(2)
    dist = parse_length_dist({"dist": "uniform", "low": 10, "high": 20}, "x")
    assert isinstance(dist, Uniform)
    values = [dist.sample(rng) for _ in range(2000)]
    assert min(values) == 10 and max(values) == 20


@pytest.mark.parametrize(("median", "p99"), [(1020, 4142), (129, 601), (13, 249)])
def test_lognormal_fit_reproduces_median_and_p99(median: int, p99: int) -> None:
    dist = LogNormal.fit(median, p99)
    rng = random.Random(3)
    values = sorted(dist.sample(rng) for _ in range(20000))
    assert statistics.median(values) == pytest.approx(median, rel=0.05)
    assert values[int(0.99 * len(values))] == pytest.approx(p99, rel=0.12)


def test_lognormal_clips_to_min_max() -> None:
    dist = parse_length_dist({"dist": "lognormal", "median": 100, "sigma": 2.0, "min": 50, "max": 150}, "x")
    rng = random.Random(4)
    values = [dist.sample(rng) for _ in range(1000)]
    assert min(values) == 50 and max(values) == 150


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ({"dist": "lognormal", "median": 100}, "exactly one of 'sigma' or 'p99'"),
        ({"dist": "uniform", "low": 5, "high": 2}, "high (2) < low (5)"),
        ({"dist": "zipf"}, "expected fixed, uniform, lognormal or trace"),
        ({"dist": "fixed", "value": 3, "extra": 1}, "prompt_tokens.extra: unknown key"),
        (0, "positive token count"),
    ],
)
def test_bad_distributions_name_the_problem(raw: object, message: str) -> None:
    with pytest.raises(SpecError) as err:
        parse_length_dist(raw, "classes.short.prompt_tokens")
    assert message in str(err.value)
    assert "classes.short.prompt_tokens" in str(err.value)

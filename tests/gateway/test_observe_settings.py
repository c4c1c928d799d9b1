"""The observability config section: defaults, values, and error messages that name the field."""

from __future__ import annotations

import pytest

from gateway.observe.settings import ObserveConfigError, ObserveSettings


def test_defaults() -> None:
    s = ObserveSettings.from_dict(None)
    assert s.window_s == 10.0 and s.hol.threshold == 0.7 and s.shape.split_at == 10.0
    assert s == ObserveSettings.from_dict({})


def test_values() -> None:
    s = ObserveSettings.from_dict(
        {
            "window_s": 2,
            "windows": 40,
            "hol": {"lookback_windows": 10, "min_windows": 5, "threshold": 0.6},
            "shape": {"split_at": 8, "two_services_at": 40},
            "scrape": {"interval_s": 1, "kv_threshold": 0.9},
            "slos": {"short": {"ttft_p99_s": 0.5, "queue_wait_p99_s": 0.2}, "long": {"ttft_p99_s": 5}},
        }
    )
    assert s.window_s == 2.0 and s.windows == 40 and s.hol.min_windows == 5
    assert s.scrape.interval_s == 1.0 and s.scrape.kv_threshold == 0.9
    assert s.slos["short"].queue_wait_p99_s == 0.2 and s.slos["long"].queue_wait_p99_s is None


@pytest.mark.parametrize(
    ("raw", "msg"),
    [
        ({"window_s": -1}, "observability.window_s: expected a positive number, got -1"),
        (
            {"scrape": {"intervl_s": 1}},
            "observability.scrape.intervl_s: unknown key (did you mean 'interval_s'?)",
        ),
        ({"hol": {"threshold": 2}}, "observability.hol.threshold: expected a number in (0, 1], got 2"),
        ({"hol": {"min_windows": 20}}, "observability.hol.min_windows: must be <= lookback_windows (12)"),
        (
            {"hol": {"min_swing_s": -0.1}},
            "observability.hol.min_swing_s: expected a non-negative number, got -0.1",
        ),
        ({"shape": {"split_at": 60}}, "observability.shape.two_services_at: must be >= split_at (60)"),
        ({"slos": {"short": {"ttft_p99": 1}}}, "observability.slos.short.ttft_p99: unknown key"),
        ({"slos": []}, "observability.slos: expected a mapping, got a list"),
        ({"windows": True}, "observability.windows: expected an integer >= 2, got true"),
    ],
)
def test_errors_name_the_field(raw: dict[str, object], msg: str) -> None:
    with pytest.raises(ObserveConfigError) as e:
        ObserveSettings.from_dict(raw)
    assert str(e.value).startswith(msg)

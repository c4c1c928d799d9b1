"""Quota windows (budgets/quota.py): calendar boundaries, time zones, month ends, daylight saving,
rolling buckets and Retry-After, on explicit wall-clock instants."""

from __future__ import annotations

from datetime import datetime
from zoneinfo import ZoneInfo

import pytest

from budgets.quota import ModelPrice, QuotaSpec, Window, cost_micros, retry_after_s, window_length

UTC = ZoneInfo("UTC")


def at(text: str, tz: str = "UTC") -> float:
    return datetime.fromisoformat(text).replace(tzinfo=ZoneInfo(tz)).timestamp()


def test_window_lengths() -> None:
    assert window_length("minute") == 60 and window_length("month") == 30 * 86_400
    assert window_length("90s") == 90 and window_length("15m") == 900 and window_length("2d") == 172_800
    assert window_length("0s") is None and window_length("fortnight") is None and window_length("5w") is None


def test_a_calendar_month_ends_at_the_next_first_whatever_its_length() -> None:
    w = Window("month")
    assert w.bounds(at("2026-02-28T23:59:59")) == (at("2026-02-01T00:00:00"), at("2026-03-01T00:00:00"))
    assert w.bounds(at("2026-12-31T12:00:00")) == (at("2026-12-01T00:00:00"), at("2027-01-01T00:00:00"))
    assert w.bounds(at("2028-02-29T10:00:00"))[1] == at("2028-03-01T00:00:00")  # leap year
    # the instant the month changes belongs to the new month
    assert w.bucket(at("2026-03-01T00:00:00")) == int(at("2026-03-01T00:00:00"))


def test_month_in_a_time_zone_with_a_reset_hour() -> None:
    w = Window("month", timezone="America/New_York", reset_s=6 * 3600)
    # 05:59 on the 1st in New York is still last month's window
    assert w.bounds(at("2026-12-01T05:59:00", "America/New_York")) == (
        at("2026-11-01T06:00:00", "America/New_York"),
        at("2026-12-01T06:00:00", "America/New_York"),
    )
    assert w.bounds(at("2026-12-01T06:00:00", "America/New_York"))[0] == at(
        "2026-12-01T06:00:00", "America/New_York"
    )


def test_days_across_daylight_saving_are_23_and_25_hours() -> None:
    w = Window("day", timezone="Europe/Berlin")
    spring = w.bounds(at("2026-03-29T12:00:00", "Europe/Berlin"))
    autumn = w.bounds(at("2026-10-25T12:00:00", "Europe/Berlin"))
    assert spring[1] - spring[0] == 23 * 3600
    assert autumn[1] - autumn[0] == 25 * 3600
    assert spring[0] == at("2026-03-29T00:00:00", "Europe/Berlin")


def test_a_day_that_starts_inside_a_daylight_saving_gap_starts_at_the_change() -> None:
    # Santiago skips 00:00-01:00 on 2026-09-06: that day starts when the clocks jump
    w = Window("day", timezone="America/Santiago")
    start, end = w.bounds(at("2026-09-06T12:00:00", "America/Santiago"))
    assert datetime.fromtimestamp(start, ZoneInfo("America/Santiago")).hour == 1
    assert end - start == 23 * 3600
    assert w.bounds(start - 1)[1] == start  # the day before ends where it starts


def test_weeks_start_on_monday_and_hours_follow_half_hour_zones() -> None:
    w = Window("week")
    assert w.bounds(at("2026-12-06T18:00:00")) == (at("2026-11-30T00:00:00"), at("2026-12-07T00:00:00"))
    h = Window("hour", timezone="Asia/Kolkata")
    start, end = h.bounds(at("2026-12-05T10:15:00"))
    assert datetime.fromtimestamp(start, ZoneInfo("Asia/Kolkata")).minute == 0
    assert end - start == 3600 and start <= at("2026-12-05T10:15:00") < end


def test_fixed_windows_in_seconds_are_aligned_to_the_epoch() -> None:
    w = Window("90s")
    assert w.bucket(1000.0) == 990 and w.oldest(1000.0) == 990 and w.frees_at(990, 1000.0) == 1080


def test_rolling_windows_count_sixty_buckets() -> None:
    w = Window("hour", rolling=True)
    assert w.bucket_s == 60
    now = 1_000_020.0  # a bucket start
    assert w.bucket(now + 59) == now and w.oldest(now) == now - 3600
    assert w.frees_at(int(now), now) == now + 60 + 3600
    assert w.oldest(now + 60 + 3600) == now + 60  # the moment it frees, the bucket is out
    assert Window("minute", rolling=True).bucket_s == 1
    assert w.tag != Window("hour").tag and Window("day", timezone="Asia/Tokyo").tag != Window("day").tag


def test_retry_after() -> None:
    q = QuotaSpec("q", "a", "tokens", 100, Window("minute"))
    now = 600.0 + 45  # 15 s before the minute ends
    assert retry_after_s(q, 10, {600: 95}, now) == pytest.approx(15.0)
    assert retry_after_s(q, 5, {600: 95}, now) == 0.0
    assert retry_after_s(q, 101, {}, now) is None  # more than the whole window: never
    r = QuotaSpec("r", "a", "tokens", 100, Window("hour", rolling=True))
    buckets = {0: 40, 60: 40, 120: 20}
    assert retry_after_s(r, 30, buckets, 1000.0) == pytest.approx(60 + 3600 - 1000)  # the 40 at 0 frees it
    assert retry_after_s(r, 70, buckets, 1000.0) == pytest.approx(120 + 3600 - 1000)


def test_cost_in_micro_units() -> None:
    price = ModelPrice(input=2.5, output=10.0, cached_input=1.25)
    assert cost_micros(1000, 0, 100, price) == 2500 + 1000
    assert cost_micros(1000, 400, 100, price) == 600 * 2.5 + 400 * 1.25 + 1000
    assert cost_micros(1, 0, 0, ModelPrice(0.15, 0.6)) == 1  # rounded up, never free
    assert ModelPrice(3.0, 15.0).cached_input == 3.0


def test_unknown_window_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown window"):
        Window("fortnight")

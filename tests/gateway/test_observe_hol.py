"""Rolling class windows and the head-of-line correlation, on a fake clock."""

from __future__ import annotations

import math
import random

import pytest

from gateway.observe.hol import hol_pairs, pearson
from gateway.observe.percentile import percentile
from gateway.observe.windows import ClassWindows
from tests.gateway.gw_support import Clock


def test_pearson_basics() -> None:
    assert pearson([1, 2, 3], [2, 4, 6]) == pytest.approx(1.0)
    assert pearson([1, 2, 3], [3, 2, 1]) == pytest.approx(-1.0)
    assert pearson([1, 2, 3], [5, 5, 5]) is None  # constant series: undefined, not 0 or NaN
    assert pearson([1], [1]) is None
    r = pearson([1, 2, 3, 4], [1, 3, 2, 4])
    assert r is not None and 0 < r < 1


def test_percentile_interpolates_between_ranks_of_values_in_any_order() -> None:
    # One function for the gateway's windows and the load tester's reports.
    assert percentile([], 50) is None
    assert percentile([7.0], 99) == 7.0
    assert percentile([4.0, 1.0, 3.0, 2.0], 50) == 2.5
    xs = [float(i) for i in range(100, -1, -1)]  # 0..100, reversed
    assert percentile(xs, 99) == pytest.approx(99.0)
    assert percentile(xs, 0) == 0.0 and percentile(xs, 100) == 100.0


def test_windows_close_on_time_and_weight_inflight_by_time() -> None:
    clock = Clock()
    w = ClassWindows(window_s=10, keep=5, clock=clock)
    w.admitted("long", 1000)  # t=0
    clock.t = 5
    w.released("long", 1000)  # 1000 tokens for half the window
    for i in range(100):
        w.record("short", ttft_s=0.01 * (i + 1), queue_wait_s=0.001, backend_s=0.5, e2e_s=0.6)
    clock.t = 10
    assert w.roll() == 0  # window [0, 10) still takes late samples until t=20
    clock.t = 20
    assert w.roll() == 1
    (lw,) = w.history("long")
    assert (lw.start, lw.end) == (0, 10)
    assert lw.inflight_tokens_avg == pytest.approx(500.0)
    assert lw.inflight_tokens_max == 1000
    assert lw.admitted == 1 and lw.admitted_cost_sum == 1000
    (sw,) = w.history("short")
    assert sw.count == 100
    # 0.01 .. 1.00, interpolated between ranks
    assert sw.ttft.p99 == pytest.approx(0.9901) and sw.ttft.p50 == pytest.approx(0.505)
    assert sw.backend.p99 == 0.5
    # idle time still produces windows, and a request still in flight keeps accruing
    w.admitted("long", 200)  # t=20
    clock.t = 45
    assert w.roll() == 2
    hist = w.history("long")
    assert [x.end for x in hist] == [10, 20, 30]
    assert [x.inflight_tokens_avg for x in hist] == [pytest.approx(500.0), 0.0, pytest.approx(200.0)]
    assert w.inflight("long") == 200
    assert len(w.history("short")) == 3 and w.history("short")[-1].ttft.p99 is None


def test_latency_counts_in_the_window_the_request_arrived_in() -> None:
    clock = Clock()
    w = ClassWindows(window_s=10, clock=clock)
    clock.t = 12  # in window [10, 20): a request that arrived at t=8 finishes now
    w.record("short", ttft_s=3.0, e2e_s=4.0)
    w.record("short", ttft_s=0.1, e2e_s=1.0)  # arrived at 11: this window
    clock.t = 25  # window [0, 10) closes at 20; a request from t=9 is too late for it now
    w.record("short", ttft_s=9.0, e2e_s=16.0)
    clock.t = 30
    w.roll()
    first, second = w.history("short")
    assert first.ttft.p99 == 3.0 and first.count == 1
    # The oldest window still open took it: its p99 is that of {0.1, 9.0}.
    assert second.ttft.p99 == pytest.approx(0.1 + 0.99 * 8.9) and second.count == 2


def test_window_samples_are_bounded() -> None:
    clock = Clock()
    w = ClassWindows(window_s=10, keep=3, max_samples=64, clock=clock)
    for i in range(10_000):
        w.record("c", ttft_s=float(i))
    clock.t = 20
    w.roll()
    (cw,) = w.history("c")
    assert cw.count == 10_000
    assert cw.ttft.p99 is not None and cw.ttft.p99 > 5000  # a uniform sample keeps the tail's scale
    assert w.recent("c")["ttft"].p99 is not None


def _simulate(
    coupled: bool, windows: int = 16, seed: int = 1, base_s: float = 0.05, stall_s: float = 0.8
) -> ClassWindows:
    """Short traffic every window; a long class on in alternate bursts. When coupled (shared
    backend, no chunked prefill) the short TTFT rises while long requests are in flight."""
    rng = random.Random(seed)
    clock = Clock()
    w = ClassWindows(window_s=10, keep=30, clock=clock)
    for k in range(windows):
        base = k * 10.0
        active = (k // 2) % 2 == 1
        if active:
            clock.t = base + 0.1
            w.admitted("long", 30_000)
        for i in range(50):
            clock.t = base + 0.2 + i * 0.15
            w.admitted("short", 300)
            slow = stall_s if (active and coupled) else 0.0
            w.released("short", 300)
            w.record("short", ttft_s=base_s + slow * rng.random() + 0.01 * base_s * rng.random())
        if active:
            clock.t = base + 9.9
            w.released("long", 30_000)
            w.record("long", ttft_s=1.0 + 0.2 * rng.random())
    clock.t = (windows + 1) * 10.0
    w.roll()
    return w


def test_hol_fingerprint_high_when_coupled_low_when_isolated() -> None:
    coupled = hol_pairs(_simulate(True), lookback=12, min_windows=6)
    assert [(p.victim, p.aggressor) for p in coupled] == [("short", "long")]  # larger cost = aggressor
    (p,) = coupled
    assert p.r_inflight is not None and p.r_inflight > 0.8
    assert p.score > 0.8 and p.windows == 12
    (q,) = hol_pairs(_simulate(False), lookback=12, min_windows=6)
    assert q.score < 0.5


def test_a_fast_class_whose_p99_doubles_by_milliseconds_with_the_long_load_is_not_blocked() -> None:
    # 15 ms -> ~30 ms exactly when the long class is busy: r ~ 1 and a 2x swing, but 15 ms of
    # scheduling noise (a 2-core box running gateway and engines) is not head-of-line blocking.
    w = _simulate(True, base_s=0.015, stall_s=0.017)
    (p,) = hol_pairs(w, lookback=12, min_windows=6, min_swing=2.0, min_swing_s=0.05)
    assert p.r_inflight is not None and p.r_inflight > 0.8
    assert p.swing is not None and p.swing >= 2.0 and p.swing_s < 0.05
    assert p.score == 0.0 and p.as_dict()["correlation"] == 0.0
    # the same series with the absolute floor off is scored on its correlation
    (q,) = hol_pairs(w, lookback=12, min_windows=6, min_swing=2.0, min_swing_s=0.0)
    assert q.score > 0.8
    # and a real stall (hundreds of ms) clears both floors
    (r,) = hol_pairs(_simulate(True), lookback=12, min_windows=6, min_swing=2.0, min_swing_s=0.05)
    assert r.swing_s > 0.5 and r.score > 0.8


def test_hol_needs_min_windows() -> None:
    (p,) = hol_pairs(_simulate(True, windows=4), lookback=12, min_windows=6)
    assert p.r_inflight is None and p.r_p99 is None and p.score == 0.0
    d = p.as_dict()
    assert d["correlation"] == 0.0 and d["windows"] == 4


def test_hol_no_pairs_with_one_class() -> None:
    clock = Clock()
    w = ClassWindows(window_s=1, clock=clock)
    w.admitted("only", 10)
    clock.t = 5
    assert w.roll() == 4
    assert hol_pairs(w) == []
    assert not math.isnan(w.history("only")[-1].inflight_tokens_avg)

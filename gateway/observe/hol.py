"""The head-of-line fingerprint: does one class's p99 follow another class's load?

In continuous batching a long prefill stalls every co-batched decode, so when long requests are
in flight the short class's TTFT p99 rises with them, window after window. A victim class's
per-window p99 TTFT is correlated (Pearson) over the last N windows with an aggressor class's

- per-window p99 TTFT (both slow together), and
- per-window time-weighted in-flight tokens (the victim is slow *when the aggressor is loaded*).

The pair's score is the in-flight correlation (the aggressor's load is the cause; its p99 is
only a symptom, measured on fewer windows and noisier), or the p99 one when the in-flight
series is flat. It is 0 unless the victim's p99 really moved: its largest window p99 at least
``min_swing`` times its smallest *and* at least ``min_swing_s`` seconds above it. A steady class's
jitter can correlate with anything over a dozen windows, and it is not being blocked; the ratio
alone is not enough, because a 15 ms p99 doubles on one scheduling hiccup (a 2x swing of 20 ms
is noise on any real engine, where a long prefill stalls decodes for hundreds of milliseconds). Aggressors are only classes whose requests are on
average larger than the victim's: a short class cannot head-of-line block a long one.
Windows in which the victim completed nothing carry no p99 and are skipped.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from gateway.observe.windows import ClassWindow, ClassWindows


def pearson(xs: Sequence[float], ys: Sequence[float]) -> float | None:
    """Pearson correlation, or None when undefined (fewer than 2 points or a constant series)."""
    n = len(xs)
    if n != len(ys) or n < 2:
        return None
    mx = sum(xs) / n
    my = sum(ys) / n
    sxy = sxx = syy = 0.0
    for x, y in zip(xs, ys, strict=True):
        dx, dy = x - mx, y - my
        sxy += dx * dy
        sxx += dx * dx
        syy += dy * dy
    # Relative floors: a series that only wobbles in its last bits is constant for our purposes.
    if sxx <= 1e-18 * max(1.0, mx * mx) * n or syy <= 1e-18 * max(1.0, my * my) * n:
        return None
    return max(-1.0, min(1.0, sxy / math.sqrt(sxx * syy)))


@dataclass(frozen=True, slots=True)
class HolPair:
    victim: str
    aggressor: str
    r_p99: float | None  # victim p99 TTFT vs aggressor p99 TTFT
    r_inflight: float | None  # victim p99 TTFT vs aggressor in-flight tokens
    windows: int  # windows the correlation used
    victim_p99_ttft_s: float | None  # in the latest window
    aggressor_p99_ttft_s: float | None
    aggressor_inflight_tokens: float  # latest window, time-weighted average
    swing: float | None = None  # victim's max / min window p99 over the windows used
    min_swing: float = 0.0
    swing_s: float = 0.0  # victim's max - min window p99 over the windows used
    min_swing_s: float = 0.0

    @property
    def score(self) -> float:
        if self.swing is None or self.swing < self.min_swing or self.swing_s < self.min_swing_s:
            return 0.0
        r = self.r_inflight if self.r_inflight is not None else self.r_p99
        return 0.0 if r is None else r

    def as_dict(self) -> dict[str, object]:
        return {
            "victim": self.victim,
            "aggressor": self.aggressor,
            "correlation": round(self.score, 4),
            "r_p99": None if self.r_p99 is None else round(self.r_p99, 4),
            "r_inflight": None if self.r_inflight is None else round(self.r_inflight, 4),
            "windows": self.windows,
            "swing": None if self.swing is None else round(self.swing, 2),
            "swing_s": round(self.swing_s, 4),
            "victim_p99_ttft_s": self.victim_p99_ttft_s,
            "aggressor_p99_ttft_s": self.aggressor_p99_ttft_s,
            "aggressor_inflight_tokens": round(self.aggressor_inflight_tokens, 1),
        }


def _mean_cost(ws: Sequence[ClassWindow]) -> float | None:
    n = sum(w.admitted for w in ws)
    return None if n == 0 else sum(w.admitted_cost_sum for w in ws) / n


def hol_pairs(
    windows: ClassWindows,
    lookback: int = 12,
    min_windows: int = 6,
    min_swing: float = 2.0,
    min_swing_s: float = 0.0,
) -> list[HolPair]:
    """Every (victim, aggressor) pair with a larger-cost aggressor, correlated over the last
    ``lookback`` windows; pairs with fewer than ``min_windows`` usable windows, or whose victim's
    p99 never swung by ``min_swing`` x and ``min_swing_s`` seconds (max vs min window p99),
    score 0."""
    recent = {k: windows.history(k)[-lookback:] for k in windows.classes()}
    cost = {k: _mean_cost(ws) for k, ws in recent.items()}
    out: list[HolPair] = []
    for victim, vws in recent.items():
        vc = cost[victim]
        if vc is None:
            continue
        for aggressor, aws in recent.items():
            ac = cost[aggressor]
            if aggressor == victim or ac is None or ac <= vc:
                continue
            # An aggressor window missing from its history (the class was not seen yet) had
            # nothing in flight: that is data for the in-flight signal, not a gap.
            by_end = {w.end: w for w in aws}
            xs: list[float] = []
            ys_p99: list[float] = []
            xs_p99: list[float] = []
            ys_in: list[float] = []
            for vw in vws:
                if vw.ttft.p99 is None:
                    continue
                aw = by_end.get(vw.end)
                xs.append(vw.ttft.p99)
                ys_in.append(aw.inflight_tokens_avg if aw is not None else 0.0)
                if aw is not None and aw.ttft.p99 is not None:
                    xs_p99.append(vw.ttft.p99)
                    ys_p99.append(aw.ttft.p99)
            swing = max(xs) / min(xs) if xs and min(xs) > 0 else None
            swing_s = max(xs) - min(xs) if xs else 0.0
            r_in = pearson(xs, ys_in) if len(xs) >= min_windows else None
            r_p = pearson(xs_p99, ys_p99) if len(xs_p99) >= min_windows else None
            last_v = vws[-1] if vws else None
            last_a = aws[-1] if aws else None
            out.append(
                HolPair(
                    victim=victim,
                    aggressor=aggressor,
                    r_p99=r_p,
                    r_inflight=r_in,
                    windows=len(xs),
                    victim_p99_ttft_s=last_v.ttft.p99 if last_v else None,
                    aggressor_p99_ttft_s=last_a.ttft.p99 if last_a else None,
                    aggressor_inflight_tokens=last_a.inflight_tokens_avg if last_a else 0.0,
                    swing=swing,
                    min_swing=min_swing,
                    swing_s=swing_s,
                    min_swing_s=min_swing_s,
                )
            )
    out.sort(key=lambda p: p.score, reverse=True)
    return out

"""Rolling fixed-length windows of per-class latency and in-flight tokens.

Prometheus histograms answer "what was p99 over the last 5 minutes" cluster-wide; the HOL
fingerprint needs a *series* of p99s per class, window by window, inside the gateway, so it can
correlate classes without a Prometheus server. Recording is O(1) (an append, a counter update);
percentiles are computed once per class when a window closes.

A request's latencies belong to the window in which it *arrived*, not the one in which it
finished: a short request stalled behind a long prefill finishes a little later, and counting it
then would smear the stall into the next window (where the long request may be gone). So a
window keeps taking late samples for one more window after it ends, and is closed then; in-flight
tokens are integrated over time and final at the window's end. History therefore trails the
clock by one window.

Each window keeps at most ``max_samples`` values per signal (reservoir sampling beyond that), so
memory stays bounded at any request rate.
"""

from __future__ import annotations

import random
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from gateway.observe.percentile import percentile

SIGNALS = ("ttft", "queue_wait", "backend", "e2e")


@dataclass(frozen=True, slots=True)
class Quantiles:
    p50: float | None
    p99: float | None


@dataclass(frozen=True, slots=True)
class ClassWindow:
    """One class in one closed window."""

    start: float
    end: float
    count: int  # requests that arrived in the window and have completed
    errors: int
    ttft: Quantiles
    queue_wait: Quantiles
    backend: Quantiles
    e2e: Quantiles
    inflight_tokens_avg: float  # time-weighted over the window
    inflight_tokens_max: int
    admitted: int
    admitted_cost_sum: int


class _Reservoir:
    __slots__ = ("cap", "seen", "values")

    def __init__(self, cap: int) -> None:
        self.cap = cap
        self.values: list[float] = []
        self.seen = 0

    def add(self, v: float, rng: random.Random) -> None:
        self.seen += 1
        if len(self.values) < self.cap:
            self.values.append(v)
        else:
            # random() is one C call; randrange is three Python frames, on every completed request.
            # (Uniform on [0, seen) to within 2**-53: seen is far below 2**53.)
            j = int(rng.random() * self.seen)
            if j < self.cap:
                self.values[j] = v

    def quantiles(self) -> Quantiles:
        if not self.values:
            return Quantiles(None, None)
        return Quantiles(percentile(self.values, 50), percentile(self.values, 99))


class _Slot:
    """One class's samples for one window, still open for late (slow) requests."""

    __slots__ = ("admitted", "cost_sum", "count", "errors", "inflight_avg", "peak", "samples")

    def __init__(self, cap: int) -> None:
        self.samples = {s: _Reservoir(cap) for s in SIGNALS}
        self.count = 0
        self.errors = 0
        self.admitted = 0
        self.cost_sum = 0
        self.inflight_avg = 0.0
        self.peak = 0


class _ClassState:
    __slots__ = ("area", "cur", "history", "inflight", "last_t", "peak", "prev", "recent")

    def __init__(self, now: float, keep: int, cap: int) -> None:
        self.cur = _Slot(cap)
        self.prev: _Slot | None = None
        # The last ``cap`` values per signal regardless of windows: the "right now" summary.
        self.recent: dict[str, deque[float]] = {s: deque(maxlen=cap) for s in SIGNALS}
        self.inflight = 0
        self.area = 0.0  # token-seconds in flight since the current window started
        self.last_t = now
        self.peak = 0
        self.history: deque[ClassWindow] = deque(maxlen=keep)


class ClassWindows:
    """Per-class windows of ``window_s`` seconds; the last ``keep`` closed ones are kept."""

    def __init__(
        self,
        window_s: float = 10.0,
        keep: int = 30,
        max_samples: int = 2048,
        clock: Callable[[], float] = time.monotonic,
        seed: int = 0,
    ) -> None:
        self.window_s = window_s
        self.keep = keep
        self.max_samples = max_samples
        self.clock = clock
        self._rng = random.Random(seed)
        self._classes: dict[str, _ClassState] = {}
        now = clock()
        self._start = now  # of the current window; the previous one is [start - window_s, start)
        self._end = now + window_s
        self._prev_open = False
        self.windows_closed = 0

    # ---- request path (cheap) ----

    def admitted(self, klass: str, cost: int) -> None:
        now = self._tick()
        st = self._state(klass, now)
        st.area += st.inflight * (now - st.last_t)
        st.last_t = now
        st.inflight += cost
        if st.inflight > st.peak:
            st.peak = st.inflight
        st.cur.admitted += 1
        st.cur.cost_sum += cost

    def released(self, klass: str, cost: int) -> None:
        now = self._tick()
        st = self._state(klass, now)
        st.area += st.inflight * (now - st.last_t)
        st.last_t = now
        st.inflight = max(0, st.inflight - cost)

    def record(
        self,
        klass: str,
        *,
        queue_wait_s: float | None = None,
        ttft_s: float | None = None,
        backend_s: float | None = None,
        e2e_s: float | None = None,
        ok: bool = True,
    ) -> None:
        """A completed request; ``e2e_s`` (its age) places it in the window it arrived in."""
        now = self._tick()
        st = self._state(klass, now)
        slot = st.cur
        if e2e_s is not None and now - e2e_s < self._start and st.prev is not None:
            slot = st.prev  # arrived in the previous window (or earlier: the oldest still open)
        rng = self._rng
        for sig, v in (
            ("queue_wait", queue_wait_s),
            ("ttft", ttft_s),
            ("backend", backend_s),
            ("e2e", e2e_s),
        ):
            if v is not None:
                slot.samples[sig].add(v, rng)
                st.recent[sig].append(v)
        slot.count += 1
        if not ok:
            slot.errors += 1

    # ---- readers ----

    def roll(self) -> int:
        """Close every window that is due; returns how many closed. Called by a ticker too, so
        idle periods still produce (empty) windows and in-flight time keeps accruing."""
        before = self.windows_closed
        self._tick()
        return self.windows_closed - before

    def classes(self) -> list[str]:
        return sorted(self._classes)

    def history(self, klass: str) -> list[ClassWindow]:
        st = self._classes.get(klass)
        return [] if st is None else list(st.history)

    def inflight(self, klass: str) -> int:
        st = self._classes.get(klass)
        return 0 if st is None else st.inflight

    def inflight_all(self) -> dict[str, int]:
        return {k: st.inflight for k, st in self._classes.items()}

    def recent(self, klass: str) -> dict[str, Quantiles]:
        """p50/p99 per signal over the class's last ``max_samples`` completions."""
        st = self._classes.get(klass)
        out: dict[str, Quantiles] = {}
        for sig in SIGNALS:
            vals = st.recent[sig] if st is not None else ()
            out[sig] = Quantiles(percentile(vals, 50), percentile(vals, 99))
        return out

    # ---- internals ----

    def _tick(self) -> float:
        now = self.clock()
        while now >= self._end:
            self._boundary(self._end)
        return now

    def _state(self, klass: str, now: float) -> _ClassState:
        st = self._classes.get(klass)
        if st is None:
            st = _ClassState(self._start, self.keep, self.max_samples)
            if self._prev_open:
                st.prev = _Slot(self.max_samples)  # a late request of a brand-new class lands here
            self._classes[klass] = st
        return st

    def _boundary(self, b: float) -> None:
        """The current window ends at ``b``: its in-flight integral is final, the previous
        window stops taking late samples and is closed, and a new window starts."""
        w = self.window_s
        for st in self._classes.values():
            st.area += st.inflight * (b - st.last_t)
            st.cur.inflight_avg = st.area / w
            st.cur.peak = st.peak
            st.area = 0.0
            st.last_t = b
            st.peak = st.inflight
            if self._prev_open:
                st.history.append(self._closed(st.prev or _Slot(0), b - 2 * w, b - w))
            st.prev, st.cur = st.cur, _Slot(self.max_samples)
        if self._prev_open:
            self.windows_closed += 1
        self._prev_open = True
        self._start = b
        self._end = b + w

    @staticmethod
    def _closed(s: _Slot, start: float, end: float) -> ClassWindow:
        return ClassWindow(
            start=start,
            end=end,
            count=s.count,
            errors=s.errors,
            ttft=s.samples["ttft"].quantiles(),
            queue_wait=s.samples["queue_wait"].quantiles(),
            backend=s.samples["backend"].quantiles(),
            e2e=s.samples["e2e"].quantiles(),
            inflight_tokens_avg=s.inflight_avg,
            inflight_tokens_max=s.peak,
            admitted=s.admitted,
            admitted_cost_sum=s.cost_sum,
        )

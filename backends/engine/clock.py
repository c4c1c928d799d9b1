"""Clocks for the engine: real monotonic time for serving, a virtual clock for deterministic tests.

On the virtual clock time only moves when the engine says a step took ``step_time_s``, so a
simulated run is exactly reproducible and takes no wall time.
"""

from __future__ import annotations

import time
from typing import Protocol


class Clock(Protocol):
    def now(self) -> float: ...


class RealClock:
    def now(self) -> float:
        return time.monotonic()


class VirtualClock:
    def __init__(self, start: float = 0.0) -> None:
        self._now = start

    def now(self) -> float:
        return self._now

    def advance(self, seconds: float) -> None:
        if seconds < 0:
            raise ValueError("time cannot go backwards")
        self._now += seconds

    def advance_to(self, t: float) -> None:
        if t > self._now:
            self._now = t

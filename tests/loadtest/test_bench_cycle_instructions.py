"""The memory-store instruction harness runs on a clock of operations, so its two runs age alike."""

from __future__ import annotations

import asyncio
import runpy
from pathlib import Path

HARNESS = Path(__file__).resolve().parents[2] / "loadtest" / "bench" / "cycle_instructions.py"


def test_the_measured_cycles_run_on_a_clock_that_moves_per_read_not_with_wall_time() -> None:
    cycles = runpy.run_path(str(HARNESS))["_cycles"]
    short = asyncio.run(cycles(50, 500, 100, None, 0.001))
    long = asyncio.run(cycles(50, 500, 200, None, 0.001))
    again = asyncio.run(cycles(50, 500, 200, None, 0.001))
    assert short[0] == 100 and long[0] == 200
    assert long == again  # the same operations read the same instants, however long they took
    # A whole number of reads per cycle (two, today): the clock counts operations.
    reads = (long[1] - short[1]) / 100 / 0.001
    assert reads >= 1 and abs(reads - round(reads)) < 1e-6

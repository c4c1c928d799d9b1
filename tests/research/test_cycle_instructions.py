"""The memory-store instruction harness runs on a clock of operations, so its two runs age alike."""

from __future__ import annotations

import asyncio
import runpy
from pathlib import Path

HARNESS = Path(__file__).resolve().parents[2] / "research" / "cycle_instructions.py"


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


def test_every_event_of_a_callgrind_file_is_read_by_name(tmp_path: Path) -> None:
    events = runpy.run_path(str(HARNESS))["callgrind_events"]
    with_cache = tmp_path / "cache.out"
    with_cache.write_text(
        "version: 1\ncreator: callgrind-3.19.0\nevents: Ir Dr Dw I1mr D1mr D1mw ILmr DLmr DLmw\n"
        "fn=main\n1 5 2 1\nsummary: 1000 400 300 7 60 20 5 3 2\ntotals: 1000 400 300 7 60 20 5 3 2\n"
    )
    assert events(with_cache) == {
        "Ir": 1000, "Dr": 400, "Dw": 300, "I1mr": 7, "D1mr": 60, "D1mw": 20, "ILmr": 5, "DLmr": 3, "DLmw": 2,
    }  # fmt: skip
    plain = tmp_path / "plain.out"
    plain.write_text("events: Ir\nfn=main\n1 5\nsummary: 1234\n")
    assert events(plain) == {"Ir": 1234}

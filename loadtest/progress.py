"""A one-line progress display on stderr (no dependency; redrawn in place with a carriage return)."""

from __future__ import annotations

import sys
from typing import TextIO


class Progress:
    def __init__(
        self, label: str, total: int, duration_s: float, enabled: bool, stream: TextIO | None = None
    ):
        self._label = label
        self._total = total
        self._duration_s = duration_s
        self._enabled = enabled
        self._stream = stream if stream is not None else sys.stderr
        self._width = 0

    def update(self, elapsed_s: float, sent: int, done: int, errors: int, in_flight: int) -> None:
        if not self._enabled:
            return
        frac = min(1.0, sent / self._total) if self._total else 1.0
        filled = int(frac * 20)
        bar = "#" * filled + "-" * (20 - filled)
        line = (
            f"\r{self._label} [{bar}] {elapsed_s:5.1f}/{self._duration_s:.0f}s "
            f"sent {sent}/{self._total} done {done} in-flight {in_flight} errors {errors}"
        )
        pad = max(0, self._width - len(line))
        self._width = len(line)
        self._stream.write(line + " " * pad)
        self._stream.flush()

    def close(self) -> None:
        if self._enabled and self._width:
            self._stream.write("\n")
            self._stream.flush()

"""Progress on stderr (no dependency): on a terminal one line redrawn in place with a carriage return;
anywhere else (a pipe, a CI log, ``| tee``) a plain line every ``line_interval_s`` seconds of the run
and one at the end, so a long run never looks stuck."""

from __future__ import annotations

import sys
from typing import TextIO


def _is_terminal(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # closed or not a real file
        return False


class Progress:
    def __init__(
        self,
        label: str,
        total: int,
        duration_s: float,
        enabled: bool,
        stream: TextIO | None = None,
        line_interval_s: float = 10.0,
    ):
        self._label = label
        self._total = total
        self._duration_s = duration_s
        self._enabled = enabled
        self._stream = stream if stream is not None else sys.stderr
        self._redraw = _is_terminal(self._stream)
        self._line_interval_s = line_interval_s
        self._next_line_s = line_interval_s
        self._last = ""
        self._width = 0

    def _text(self, elapsed_s: float, sent: int, done: int, errors: int, in_flight: int) -> str:
        return (
            f"{elapsed_s:5.1f}/{self._duration_s:.0f}s "
            f"sent {sent}/{self._total} done {done} in-flight {in_flight} errors {errors}"
        )

    def update(self, elapsed_s: float, sent: int, done: int, errors: int, in_flight: int) -> None:
        if not self._enabled:
            return
        text = self._text(elapsed_s, sent, done, errors, in_flight)
        self._last = text
        if not self._redraw:
            if elapsed_s >= self._next_line_s:
                while self._next_line_s <= elapsed_s:
                    self._next_line_s += self._line_interval_s
                self._stream.write(f"{self._label}: {text}\n")
                self._stream.flush()
            return
        frac = min(1.0, sent / self._total) if self._total else 1.0
        filled = int(frac * 20)
        bar = "#" * filled + "-" * (20 - filled)
        line = f"\r{self._label} [{bar}] {text}"
        pad = max(0, self._width - len(line))
        self._width = len(line)
        self._stream.write(line + " " * pad)
        self._stream.flush()

    def close(self) -> None:
        if not self._enabled:
            return
        if self._redraw:
            if self._width:
                self._stream.write("\n")
        elif self._last:
            self._stream.write(f"{self._label}: finished: {self._last}\n")
        self._stream.flush()

"""Progress on stderr: redrawn in place on a terminal, plain lines anywhere else."""

from __future__ import annotations

import io

from loadtest.progress import Progress


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_in_a_pipe_is_a_plain_line_every_interval_and_one_at_the_end() -> None:
    out = io.StringIO()
    p = Progress("gw", total=100, duration_s=30, enabled=True, stream=out, line_interval_s=10)
    for t in range(31):  # the runner updates twice a second; once a second is enough here
        p.update(float(t), sent=t * 3, done=t * 2, errors=0, in_flight=t)
    p.close()
    lines = out.getvalue().splitlines()
    assert "\r" not in out.getvalue()
    assert [ln.split()[1] for ln in lines[:3]] == ["10.0/30s", "20.0/30s", "30.0/30s"]
    assert lines[-1].startswith("gw: finished:") and len(lines) == 4


def test_progress_on_a_terminal_is_redrawn_in_place() -> None:
    out = _Terminal()
    p = Progress("gw", total=10, duration_s=5, enabled=True, stream=out)
    p.update(1.0, sent=2, done=1, errors=0, in_flight=1)
    p.update(2.0, sent=4, done=3, errors=0, in_flight=1)
    p.close()
    text = out.getvalue()
    assert text.count("\r") == 2 and text.endswith("\n") and text.count("\n") == 1


def test_disabled_progress_writes_nothing() -> None:
    out = io.StringIO()
    p = Progress("gw", total=10, duration_s=5, enabled=False, stream=out, line_interval_s=1)
    p.update(3.0, sent=2, done=1, errors=0, in_flight=1)
    p.close()
    assert out.getvalue() == ""

"""Azure LLM inference trace (2023) parsing, windowing and scaling.

The CSV format (the Azure LLM inference trace 2023's; any file in it can be replayed)::

    TIMESTAMP,ContextTokens,GeneratedTokens
    2023-11-16 18:15:46.6805900,374,44

one request per row: its arrival time (``YYYY-MM-DD HH:MM:SS`` with an optional fraction of any
length; seven digits, which ``datetime.fromisoformat`` rejects on some Pythons, so they are parsed by
hand), its prompt tokens and its output tokens. Rows need not be sorted; extra columns are ignored.

The files are never copied into the project. A scenario names a trace by file name; it is looked up
as an absolute path, next to the scenario file, then in the folder given with ``--traces DIR`` (or
``$TOKENGATE_TRACES``). Without the file, a known trace is replaced by its fitted stand-in.
"""

from __future__ import annotations

import csv
import os
import random
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from loadtest.distributions import LogNormal, SpecError

TRACES_ENV = "TOKENGATE_TRACES"


@dataclass(frozen=True)
class TraceRecord:
    at_s: float  # seconds since the trace's first request
    prompt_tokens: int
    output_tokens: int


@dataclass(frozen=True)
class TraceFit:
    """Published summary of a trace, used for the synthetic stand-in when the file is absent."""

    rate_per_s: float
    prompt: LogNormal
    output: LogNormal


# Fitted to the figures in shared/traces/README.md (median, p99, max); rates are whole-hour means.
KNOWN_TRACE_FITS: dict[str, TraceFit] = {
    "azure_llm_2023_conv.csv": TraceFit(
        rate_per_s=5.5,
        prompt=LogNormal.fit(1020, 4142, low=2, high=14050),
        output=LogNormal.fit(129, 601, low=1, high=1000),
    ),
    "azure_llm_2023_code.csv": TraceFit(
        rate_per_s=2.6,
        prompt=LogNormal.fit(1469, 7436, low=2, high=7437),
        output=LogNormal.fit(13, 249, low=1, high=1899),
    ),
}


def repo_root() -> Path:
    return Path(__file__).resolve().parent.parent


def default_traces_dir() -> Path | None:
    """The folder given with ``--traces`` (kept in ``$TOKENGATE_TRACES``), or None."""
    env = os.environ.get(TRACES_ENV)
    return Path(env) if env else None


def use_traces_dir(folder: Path) -> Path:
    """Look trace files up in ``folder`` from now on (``--traces DIR``); it must exist."""
    resolved = folder.expanduser().resolve()
    if not resolved.is_dir():
        raise SpecError(f"--traces {folder}: no such folder (it should hold the trace CSV files)")
    os.environ[TRACES_ENV] = str(resolved)
    return resolved


def resolve_trace_path(name: str, base_dir: Path | None = None) -> Path | None:
    """Finds a trace by absolute path, relative to ``base_dir`` (the scenario's folder) or in the traces dir."""
    candidate = Path(name)
    options = [candidate] if candidate.is_absolute() else []
    if not candidate.is_absolute():
        if base_dir is not None:
            options.append(base_dir / candidate)
        folder = default_traces_dir()
        if folder is not None:
            options.append(folder / candidate.name)
    for option in options:
        if option.is_file():
            return option
    return None


def _parse_timestamp(text: str) -> tuple[int, float]:
    """(whole seconds, fraction): kept apart so relative times keep sub-microsecond precision."""
    date_part, _, time_part = text.strip().partition(" ")
    hms, _, frac = time_part.partition(".")
    base = datetime.fromisoformat(f"{date_part} {hms}")
    return int(base.timestamp()), (float("0." + frac) if frac else 0.0)


def load_trace(path: Path) -> list[TraceRecord]:
    """Reads a trace CSV; times are made relative to the first request and sorted."""
    rows: list[tuple[tuple[int, float], int, int]] = []
    with path.open(newline="") as fh:
        reader = csv.DictReader(fh)
        missing = {"TIMESTAMP", "ContextTokens", "GeneratedTokens"} - set(reader.fieldnames or [])
        if missing:
            raise SpecError(f"{path}: missing trace column(s) {sorted(missing)}")
        for line_no, row in enumerate(reader, start=2):
            try:
                rows.append(
                    (
                        _parse_timestamp(row["TIMESTAMP"]),
                        int(row["ContextTokens"]),
                        int(row["GeneratedTokens"]),
                    )
                )
            except ValueError as exc:
                raise SpecError(f"{path}:{line_no}: bad trace row {row!r}: {exc}") from exc
    if not rows:
        raise SpecError(f"{path}: empty trace")
    rows.sort(key=lambda r: r[0])
    s0, f0 = rows[0][0]
    return [TraceRecord((s - s0) + (f - f0), max(1, p), max(1, g)) for (s, f), p, g in rows]


@dataclass(frozen=True)
class TraceWindow:
    """How a trace is cut and scaled to fit a scenario.

    ``time_scale`` > 1 replays faster (arrival gaps divided by it); ``size_scale`` multiplies token
    counts; ``sample`` keeps a seeded fraction of requests, which lowers the rate without distorting
    the sizes; ``max_prompt_tokens`` / ``max_output_tokens`` clip after scaling.
    """

    start_s: float = 0.0
    time_scale: float = 1.0
    size_scale: float = 1.0
    sample: float = 1.0
    max_prompt_tokens: int | None = None
    max_output_tokens: int | None = None

    def _scale_tokens(self, value: int, cap: int | None) -> int:
        scaled = max(1, round(value * self.size_scale))
        return min(scaled, cap) if cap is not None else scaled

    def apply(self, records: list[TraceRecord], duration_s: float, rng: random.Random) -> list[TraceRecord]:
        """Records whose scaled arrival falls in [0, duration_s), in order."""
        out: list[TraceRecord] = []
        end_trace_s = self.start_s + duration_s * self.time_scale
        for rec in records:
            if rec.at_s < self.start_s:
                continue
            if rec.at_s >= end_trace_s:
                break
            if self.sample < 1.0 and rng.random() >= self.sample:
                continue
            out.append(
                TraceRecord(
                    (rec.at_s - self.start_s) / self.time_scale,
                    self._scale_tokens(rec.prompt_tokens, self.max_prompt_tokens),
                    self._scale_tokens(rec.output_tokens, self.max_output_tokens),
                )
            )
        return out

    def synthetic_fit(self, fit: TraceFit) -> TraceFit:
        """The fit of what ``apply`` would produce, for the synthetic stand-in."""
        prompt = fit.prompt.scaled(self.size_scale)
        output = fit.output.scaled(self.size_scale)
        if self.max_prompt_tokens is not None:
            prompt = LogNormal(
                prompt.median, prompt.sigma, prompt.low, min(prompt.high, self.max_prompt_tokens)
            )
        if self.max_output_tokens is not None:
            output = LogNormal(
                output.median, output.sigma, output.low, min(output.high, self.max_output_tokens)
            )
        return TraceFit(fit.rate_per_s * self.time_scale * self.sample, prompt, output)

"""Length distributions for prompt and output token counts.

Every distribution samples from a caller-owned ``random.Random`` so a workload's seed fixes the whole
schedule; nothing here keeps global random state.
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from gateway.config.fields import ConfigError, check_keys, integer, positive_number

# z-score of the 99th percentile of a standard normal: lognormal fits from (median, p99) use it.
Z_P99 = 2.326347874


# A workload or scenario file is malformed; the message names the field. The same toolkit and
# error as the gateway's config (gateway.config.fields), so both read and complain alike.
SpecError = ConfigError


class LengthDist(Protocol):
    def sample(self, rng: random.Random) -> int: ...

    def describe(self) -> str: ...


@dataclass(frozen=True)
class Fixed:
    value: int

    def sample(self, rng: random.Random) -> int:
        return self.value

    def describe(self) -> str:
        return f"fixed {self.value}"


@dataclass(frozen=True)
class Uniform:
    low: int
    high: int

    def sample(self, rng: random.Random) -> int:
        return rng.randint(self.low, self.high)

    def describe(self) -> str:
        return f"uniform {self.low}..{self.high}"


@dataclass(frozen=True)
class LogNormal:
    """Lognormal given by its median and log-space sigma, clipped to [low, high].

    ``fit`` builds one from a median and a p99, which is how published trace summaries are usually given.
    """

    median: float
    sigma: float
    low: int = 1
    high: int = 1_000_000

    @staticmethod
    def fit(median: float, p99: float, low: int = 1, high: int = 1_000_000) -> LogNormal:
        if p99 <= median:
            raise SpecError(f"lognormal fit needs p99 > median, got median={median} p99={p99}")
        return LogNormal(median, math.log(p99 / median) / Z_P99, low, high)

    def sample(self, rng: random.Random) -> int:
        value = rng.lognormvariate(math.log(self.median), self.sigma)
        return max(self.low, min(self.high, round(value)))

    def scaled(self, factor: float) -> LogNormal:
        return LogNormal(
            self.median * factor,
            self.sigma,
            max(1, round(self.low * factor)),
            max(1, round(self.high * factor)),
        )

    def describe(self) -> str:
        return f"lognormal median {self.median:g} sigma {self.sigma:.3f} [{self.low}, {self.high}]"


@dataclass(frozen=True)
class Empirical:
    """Resamples observed values (e.g. a trace column) uniformly with replacement."""

    values: tuple[int, ...]
    source: str = "empirical"

    def sample(self, rng: random.Random) -> int:
        return self.values[rng.randrange(len(self.values))]

    def describe(self) -> str:
        return f"{self.source} ({len(self.values)} values)"


def _int_field(d: Mapping[str, Any], key: str, where: str, minimum: int = 1) -> int:
    return integer(d, key, where, None, minimum=minimum)


def _num_field(d: Mapping[str, Any], key: str, where: str) -> float:
    return positive_number(d, key, where, None)


def parse_length_dist(raw: Any, where: str, *, empirical: Sequence[int] | None = None) -> LengthDist:
    """Builds a distribution from its YAML form.

    Forms: an integer (fixed); ``{dist: fixed, value}``; ``{dist: uniform, low, high}``;
    ``{dist: lognormal, median, sigma | p99, min?, max?}``. ``{dist: trace, ...}`` is resolved by the
    caller, which passes the trace column as ``empirical``.
    """
    if isinstance(raw, int) and not isinstance(raw, bool):
        if raw < 1:
            raise SpecError(f"{where}: expected a positive token count, got {raw}")
        return Fixed(raw)
    if not isinstance(raw, Mapping):
        raise SpecError(f"{where}: expected an integer or a mapping with 'dist', got {raw!r}")
    kind = raw.get("dist")
    if kind == "fixed":
        check_keys(raw, ["dist", "value"], where)
        return Fixed(_int_field(raw, "value", where))
    if kind == "uniform":
        check_keys(raw, ["dist", "low", "high"], where)
        low, high = _int_field(raw, "low", where), _int_field(raw, "high", where)
        if high < low:
            raise SpecError(f"{where}: high ({high}) < low ({low})")
        return Uniform(low, high)
    if kind == "lognormal":
        check_keys(raw, ["dist", "median", "sigma", "p99", "min", "max"], where)
        median = _num_field(raw, "median", where)
        low = _int_field(raw, "min", where) if "min" in raw else 1
        high = _int_field(raw, "max", where) if "max" in raw else 1_000_000
        if high < low:
            raise SpecError(f"{where}: max ({high}) < min ({low})")
        if ("sigma" in raw) == ("p99" in raw):
            raise SpecError(f"{where}: lognormal needs exactly one of 'sigma' or 'p99'")
        if "sigma" in raw:
            return LogNormal(median, _num_field(raw, "sigma", where), low, high)
        return LogNormal.fit(median, _num_field(raw, "p99", where), low, high)
    if kind == "trace":
        if not empirical:
            raise SpecError(f"{where}: 'dist: trace' needs a readable trace file")
        return Empirical(tuple(empirical), source=str(raw.get("file", "trace")))
    raise SpecError(f"{where}.dist: expected fixed, uniform, lognormal or trace, got {kind!r}")

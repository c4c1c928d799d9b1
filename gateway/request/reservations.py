"""Per request: how many output tokens to reserve, and learning from what it really produced.

The pricer gives the request's limit (``Cost.decode``: max_tokens or the default, per choice, times
the choices). ``Reservations`` turns it into what the request holds while it runs, per its pool's and
class's ``reservation`` settings (``classifiers.reservation``): the limit (``max_tokens``, the
default), a fixed number, or a learned quantile. Two safety valves:

* **KV feedback.** While a pool's backends report KV-cache usage at or above ``kv_high`` (scraped from
  their ``/metrics``), new requests to it reserve their limit again, until every backend of the pool
  is back at or below ``kv_low``: when the engine is short of memory, estimates are not gambled on.
* **Growth.** A stream whose output outgrows its reservation extends its lease (``gateway.request.proxy``), up
  to the limit; a non-streaming request settles at release (its real output is recorded).
* **The tenant's budget holds the limit.** For a tenant with ``budget_tokens`` the demand carries the
  limit (``Demand.decode_limit``): its budget holds what the request may produce, the shared pools
  the reservation, so a tenant that trains its estimates low cannot run more than its budget.

``oracle_header`` (benchmarks only) reserves exactly what ``x-tokengate-oracle-output`` says: the
arm every estimate is measured against.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace

from classifiers import Cost
from classifiers.reservation import OutputEstimator, ReservationKey, ReservationSettings


@dataclass(frozen=True, slots=True)
class ReservationConfig:
    settings: ReservationSettings = field(default_factory=ReservationSettings)
    grow: bool = True  # streams extend their lease before the output outgrows it
    grow_factor: float = 2.0  # each extension multiplies the reservation by this (up to the limit)
    kv_high: float = 0.90
    kv_low: float = 0.75
    oracle_header: bool = False


@dataclass(frozen=True, slots=True)
class Reserved:
    """What one request reserves for output, and what it may grow to."""

    decode: int  # output tokens held now (all sequences)
    limit: int  # the request's limit (all sequences): the most a lease grows to
    sequences: int  # how many sequences share the decode (choices x prompts)
    estimator: OutputEstimator | None = None  # learned: where the real output goes at release
    key: ReservationKey | None = None

    @property
    def reduced(self) -> bool:
        return self.decode < self.limit


class Reservations:
    def __init__(
        self,
        default: ReservationConfig,
        by_pool: dict[str, ReservationSettings],
        by_class: dict[str, ReservationSettings],
        kv_usage: Callable[[str], float | None],
    ) -> None:
        """``kv_usage(pool)``: the fullest KV-cache usage (0-1) among the pool's backends as last
        scraped, None when none exports it."""
        self.default = default
        self._by_pool = by_pool
        self._by_class = by_class
        self._kv_usage = kv_usage
        self._estimators: dict[ReservationSettings, OutputEstimator] = {}
        self._conservative: set[str] = set()  # pools whose backends' KV is (still) too full

    def settings_for(self, pool: str, klass: str) -> ReservationSettings:
        return self._by_class.get(klass) or self._by_pool.get(pool) or self.default.settings

    def estimator(self, settings: ReservationSettings) -> OutputEstimator:
        est = self._estimators.get(settings)
        if est is None:
            est = self._estimators[settings] = OutputEstimator(settings)
        return est

    def carry_over(self, old: Reservations) -> None:
        """Keep what was learned across a reconfiguration (estimators with unchanged settings)."""
        self._estimators.update(old._estimators)
        self._conservative = set(old._conservative)

    def reserve(
        self, *, cost: Cost, tenant: str, model: str, klass: str, pool: str, oracle: int | None = None
    ) -> Reserved:
        limit = cost.decode
        sequences = max(1, round(limit / cost.per_choice)) if cost.per_choice > 0 else 1
        settings = self.settings_for(pool, klass)
        if limit <= 0:
            return Reserved(limit, limit, sequences)
        if oracle is not None and self.default.oracle_header:
            return Reserved(min(limit, max(1, oracle) * sequences), limit, sequences)
        if settings.mode == "max_tokens":
            return Reserved(limit, limit, sequences)
        est = self.estimator(settings)
        key = est.key(tenant, model, klass, cost.prefill // sequences)
        if self._kv_tight(pool):
            return Reserved(limit, limit, sequences, est, key)
        per_choice = est.reserve(key, cost.per_choice)
        return Reserved(min(limit, per_choice * sequences), limit, sequences, est, key)

    def observe(self, reserved: Reserved, completion_tokens: int | None) -> None:
        if reserved.estimator is None or reserved.key is None or completion_tokens is None:
            return
        reserved.estimator.observe(reserved.key, -(-completion_tokens // reserved.sequences))

    def _kv_tight(self, pool: str) -> bool:
        """Hysteresis on the pool's fullest backend: tight from kv_high until back at kv_low."""
        fullest = self._kv_usage(pool)
        if fullest is None:
            return pool in self._conservative
        if pool in self._conservative:
            if fullest <= self.default.kv_low:
                self._conservative.discard(pool)
        elif fullest >= self.default.kv_high:
            self._conservative.add(pool)
        return pool in self._conservative

    def tight_pools(self) -> list[str]:
        return sorted(self._conservative)

    def learned(self, limit: int = 50) -> list[dict[str, object]]:
        out: list[dict[str, object]] = []
        for settings, est in self._estimators.items():
            out += [{**row, "quantile": settings.quantile} for row in est.snapshot(limit)]
        return out[:limit]


def with_decode(cost: Cost, decode: int) -> Cost:
    return replace(cost, decode=decode)

"""Honest ``retry_after_s`` for refusals: how long until this demand could plausibly be granted.

Per pool, the store keeps an exponentially weighted rate of tokens released per second. For each
pool of the demand::

    free   = limit(pool, tier) - in_flight(pool)
    needed = tokens waiting on the pool in this tier or better + cost - free
    wait   = 0 if needed <= 0 else needed / rate(pool)          (infinite when rate is 0)

The estimate is the worst pool's wait, clamped to ``[1, max(1, tier.max_queue_wait_s)]``: sooner
than a second only invites a retry storm, and beyond the tier's own queue wait the estimate says
nothing useful. A pool that released nothing recently has a rate near zero, so the answer is the
upper clamp: that is the honest answer when nothing is moving. Tokens "ahead" ignore fair-share
order (a tenant may be served before some of them), so the estimate errs on the long side.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from budgets.policy import PolicyState, pool_limit, tokens_ahead
from budgets.types import Demand

# Averaging window of the release rate: long enough to smooth out one big lease, short enough to
# follow a change of load within a minute.
RATE_TAU_S = 10.0
MIN_RETRY_S = 1.0


@dataclass(slots=True)
class ReleaseRate:
    """EWMA of a rate of events: r <- r * exp(-dt / tau) + amount / tau (unbiased for steady rates)."""

    tau_s: float = RATE_TAU_S
    rate: float = 0.0
    last: float | None = None

    def add(self, amount: float, now: float) -> None:
        # value(now) inlined: every release adds to one meter per pool of its demand.
        last, tau = self.last, self.tau_s
        if last is None:
            self.rate = amount / tau
        elif now > last:
            self.rate = self.rate * math.exp((last - now) / tau) + amount / tau
        else:
            self.rate += amount / tau
        self.last = now

    def value(self, now: float) -> float:
        if self.last is None:
            return 0.0
        dt = max(0.0, now - self.last)
        return self.rate * math.exp(-dt / self.tau_s)


def retry_after(state: PolicyState, demand: Demand, rates: Mapping[str, ReleaseRate], now: float) -> float:
    layout = state.layout
    tier = layout.tiers[demand.tier]
    upper = max(MIN_RETRY_S, tier.max_queue_wait_s)
    worst = 0.0
    for name in demand.pools:
        pool = layout.pools.get(name)
        if pool is None:
            continue
        free = pool_limit(pool, tier) - state.in_flight.get(name, 0)
        needed = tokens_ahead(state, name, tier.rank) + demand.held_in(name) - free
        if needed <= 0:
            continue
        meter = rates.get(name)
        rate = meter.value(now) if meter is not None else 0.0
        worst = max(worst, needed / rate if rate > 0 else math.inf)
    return min(max(worst, MIN_RETRY_S), upper)

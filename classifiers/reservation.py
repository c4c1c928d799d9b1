"""How many output tokens to reserve: the request's limit, a fixed number, or a learned estimate.

Every request holds prompt + reserved output for its whole life. Reserving the request's limit
(``max_tokens``, or the default when it sets none) is safe but wasteful: real answers are mostly far
shorter (Azure 2023 conversation trace: output p50 129, p99 601 tokens, while clients send
``max_tokens`` of 4k–32k), so a pool sized to the backend's KV cache admits a fraction of what the
backend could hold. ``learned`` reserves a high quantile of what similar requests really produced:

    reserve = min(the request's limit, q-quantile of observed output tokens for the key)

The key is (tenant, model, class, prompt-length bucket). Observations are the completion tokens each
response reports (``usage``), kept per key in a histogram of log-spaced bins with exponential decay
(``half_life_s``), so the estimate follows a changing workload and old behaviour fades. Until a key
has ``min_samples`` of (decayed) weight, the request's limit is reserved (cold start). The estimate is
rounded up to its bin's upper edge (bins grow by ~19 %), which errs on the side of reserving more.

Memory is bounded: at most ``max_keys`` keys, least recently used evicted first; a key is 64 floats.
The state is per gateway process (not shared through the budget store): an estimate converges from a
few dozen local samples, sharing it would cost a store write per request, and an estimate that is too
low is corrected while the request runs (the lease grows, ``gateway.request.proxy``) — so replicas gain little
from agreeing exactly.
"""

from __future__ import annotations

import math
import time
from bisect import bisect_left
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Literal

Mode = Literal["max_tokens", "learned", "fixed"]

# Bin i holds outputs in (EDGES[i-1], EDGES[i]]; bin 0 holds 0..1. 64 bins reach ~2^17 tokens.
_BINS = 64
_GROWTH = 1.2
EDGES: tuple[int, ...] = tuple(sorted({max(1, math.ceil(_GROWTH**i)) for i in range(_BINS * 2)}))[:_BINS]


def _bin(tokens: int) -> int:
    """The first bin whose upper edge holds ``tokens`` (the last bin holds everything above)."""
    return min(_BINS - 1, bisect_left(EDGES, tokens))


@dataclass(frozen=True, slots=True)
class ReservationSettings:
    mode: Mode = "max_tokens"
    quantile: float = 0.95
    fixed_tokens: int = 256  # mode fixed: reserve min(limit, this)
    min_samples: float = 20.0  # decayed weight a key needs before its estimate is used
    half_life_s: float = 600.0  # an observation's weight halves in this time
    prompt_buckets: tuple[int, ...] = (256, 2048, 16384)  # prompt-length edges: keys split by them
    max_keys: int = 10_000


@dataclass(slots=True)
class _Histogram:
    weights: list[float] = field(default_factory=lambda: [0.0] * _BINS)
    total: float = 0.0
    updated_at: float = 0.0

    def decay_to(self, now: float, half_life_s: float) -> None:
        dt = now - self.updated_at
        if dt > 0 and self.total > 0:
            f = 0.5 ** (dt / half_life_s)
            self.weights = [w * f for w in self.weights]
            self.total *= f
        self.updated_at = max(self.updated_at, now)

    def quantile(self, q: float) -> int:
        target = q * self.total
        acc = 0.0
        for i, w in enumerate(self.weights):
            acc += w
            if acc >= target and w > 0:
                return EDGES[i]
        return EDGES[-1]


@dataclass(frozen=True, slots=True)
class ReservationKey:
    tenant: str
    model: str
    klass: str
    bucket: int


class OutputEstimator:
    """Learns output lengths per key and turns a request's limit into a reservation."""

    def __init__(self, settings: ReservationSettings, clock: Callable[[], float] = time.monotonic) -> None:
        self.settings = settings
        self._clock = clock
        self._keys: OrderedDict[ReservationKey, _Histogram] = OrderedDict()

    def key(self, tenant: str, model: str, klass: str, prompt_tokens: int) -> ReservationKey:
        bucket = sum(1 for edge in self.settings.prompt_buckets if prompt_tokens >= edge)
        return ReservationKey(tenant, model, klass, bucket)

    def reserve(self, key: ReservationKey, limit: int) -> int:
        """Output tokens to reserve for a request whose limit is ``limit`` (never more than it)."""
        s = self.settings
        if s.mode == "max_tokens" or limit <= 0:
            return limit
        if s.mode == "fixed":
            return min(limit, s.fixed_tokens)
        h = self._keys.get(key)
        if h is None:
            return limit
        h.decay_to(self._clock(), s.half_life_s)
        if h.total < s.min_samples:
            return limit
        return min(limit, h.quantile(s.quantile))

    def observe(self, key: ReservationKey, output_tokens: int) -> None:
        """One finished request's real output (from the backend's usage)."""
        if self.settings.mode != "learned" or output_tokens < 0:
            return
        h = self._keys.get(key)
        if h is None:
            if len(self._keys) >= self.settings.max_keys:
                self._keys.popitem(last=False)
            h = self._keys[key] = _Histogram(updated_at=self._clock())
        else:
            self._keys.move_to_end(key)
        h.decay_to(self._clock(), self.settings.half_life_s)
        h.weights[_bin(output_tokens)] += 1.0
        h.total += 1.0

    def __len__(self) -> int:
        return len(self._keys)

    def snapshot(self, limit: int = 50) -> list[dict[str, object]]:
        """The most recently used keys with their weight and estimate (for /stats)."""
        out: list[dict[str, object]] = []
        now = self._clock()
        for key in list(reversed(self._keys))[:limit]:
            h = self._keys[key]
            h.decay_to(now, self.settings.half_life_s)
            out.append(
                {
                    "tenant": key.tenant,
                    "model": key.model,
                    "class": key.klass,
                    "prompt_bucket": key.bucket,
                    "weight": round(h.total, 2),
                    "estimate": h.quantile(self.settings.quantile) if h.total > 0 else None,
                }
            )
        return out


def bins() -> Sequence[int]:
    """The histogram's bin upper edges (tests, docs)."""
    return EDGES

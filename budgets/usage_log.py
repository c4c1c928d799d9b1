"""Usage kept for billing: per hour, per tenant, API key and model, what requests used — beyond any
quota window, for as long as ``keep_s``.

A *row* is ``(hour, tenant, key, model)`` with the counts :data:`COUNTS` (cost in micro-units of
the currency, budgets.quota.MICRO). Replicas add to the same rows (the Redis log: one hash per hour,
``T:usage:<hour>``, fields ``<tenant> US <key> US <model> US <count>`` incremented with HINCRBY, so
adds from every replica sum exactly); reading a range of hours returns every row in it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

COUNTS = ("requests", "prompt_tokens", "cached_tokens", "completion_tokens", "cost_micros", "estimated")
HOUR = 3600
SEP = "\x1f"  # between a row's parts in the Redis field (replaced in what a client could name)

RowKey = tuple[str, str, str]  # (tenant, key id, model)


def hour_of(t: float) -> int:
    return int(t // HOUR) * HOUR


def clean(part: str) -> str:
    return part.replace(SEP, " ")


@dataclass(frozen=True, slots=True)
class UsageRow:
    hour: int  # epoch seconds, the hour's start
    tenant: str
    key: str  # the key's id (its SHA-256, hex), "" in open mode
    model: str
    counts: tuple[int, ...]  # as COUNTS


@runtime_checkable
class UsageLog(Protocol):
    """``add`` sums ``rows`` (row key -> counts) into ``hour``, kept ``keep_s`` after its last add;
    ``read`` returns every row of the given hours. Both raise StoreUnavailable when the log cannot
    be reached (the caller keeps what it could not add and tries again)."""

    async def add(self, hour: int, rows: Mapping[RowKey, Sequence[int]], keep_s: int) -> None: ...

    async def read(self, hours: Sequence[int]) -> list[UsageRow]: ...


class MemoryUsageLog:
    """The log of one process (the memory store's)."""

    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self._clock = clock
        self._hours: dict[int, dict[RowKey, list[int]]] = {}
        self._until: dict[int, float] = {}  # hour -> when it is forgotten

    async def add(self, hour: int, rows: Mapping[RowKey, Sequence[int]], keep_s: int) -> None:
        self._forget()
        cells = self._hours.setdefault(hour, {})
        for (tenant, key, model), counts in rows.items():
            cell = cells.setdefault((clean(tenant), clean(key), clean(model)), [0] * len(COUNTS))
            for i, n in enumerate(counts):
                cell[i] += int(n)
        self._until[hour] = self._clock() + keep_s

    async def read(self, hours: Sequence[int]) -> list[UsageRow]:
        self._forget()
        return [
            UsageRow(h, t, k, m, tuple(c))
            for h in hours
            for (t, k, m), c in sorted(self._hours.get(h, {}).items())
        ]

    def _forget(self) -> None:
        now = self._clock()
        for h in [h for h, until in self._until.items() if until <= now]:
            self._hours.pop(h, None)
            self._until.pop(h, None)

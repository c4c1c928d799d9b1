"""Usage for billing: every request that ran is counted once, when its lease is released, into rows of
(hour, tenant, API key, model) — requests, prompt, cached and completion tokens, cost at the model's
price, and how many of them had no usage from the engine — and added to the store's usage log every
``flush_s`` (budgets/usage_log.py). The admin API exports the rows of a time range as CSV or JSON.

What a request counts is what its quotas settle to: the engine's usage; without it (a stream cut
before its usage event) the priced prompt and the output reserved, counted in ``estimated``. A
request that never ran (refused, or abandoned while queued) counts nothing.

Counts wait in this process for at most ``flush_s``: a replica that dies loses what it had not added
yet (a second's worth). A store that cannot be reached keeps them here, and they are added when it
can be again (up to ``_MOST_PENDING`` rows; beyond that the oldest hours are dropped, logged).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from budgets.background import BackgroundTask
from budgets.usage_log import COUNTS, RowKey, UsageLog, hour_of

log = logging.getLogger("tokengate.billing")

_MOST_PENDING = 100_000


class UsageRecorder:
    def __init__(
        self, usage_log: UsageLog, *, keep_s: int, flush_s: float = 1.0, wall: Callable[[], float] = time.time
    ) -> None:
        self.log = usage_log
        self.keep_s = keep_s
        self.flush_s = flush_s
        self._wall = wall
        self._pending: dict[int, dict[RowKey, list[int]]] = {}
        self._loop = BackgroundTask("usage-log", self._forever, log)
        self._lock = asyncio.Lock()

    def record(
        self,
        tenant: str,
        key: str,
        model: str,
        prompt: int,
        cached: int,
        completion: int,
        cost: int,
        estimated: bool,
    ) -> None:
        rows = self._pending.setdefault(hour_of(self._wall()), {})
        cell = rows.get((tenant, key, model))
        if cell is None:
            cell = rows[tenant, key, model] = [0] * len(COUNTS)
        cell[0] += 1
        cell[1] += prompt
        cell[2] += cached
        cell[3] += completion
        cell[4] += cost
        cell[5] += estimated

    def start(self) -> None:
        self._loop.start()

    async def close(self) -> None:
        await self._loop.stop()
        try:
            await self.flush()
        except Exception as exc:
            log.error("usage of %d rows not added to the usage log at shutdown: %s", self.pending(), exc)

    def pending(self) -> int:
        return sum(len(rows) for rows in self._pending.values())

    async def flush(self) -> None:
        """Add what was counted; what could not be added stays for the next flush."""
        async with self._lock:
            taken, self._pending = self._pending, {}
            failed: Exception | None = None
            for hour in sorted(taken):
                if failed is None:
                    try:
                        await self.log.add(hour, taken[hour], self.keep_s)
                        continue
                    except Exception as exc:
                        failed = exc
                self._merge(hour, taken[hour])
            if failed is not None:
                self._bound()
                raise failed

    def _merge(self, hour: int, rows: dict[RowKey, list[int]]) -> None:
        mine = self._pending.setdefault(hour, {})
        for key, counts in rows.items():
            cell = mine.get(key)
            if cell is None:
                mine[key] = counts
            else:
                for i, n in enumerate(counts):
                    cell[i] += n

    def _bound(self) -> None:
        while self.pending() > _MOST_PENDING and len(self._pending) > 1:
            hour = min(self._pending)
            dropped = self._pending.pop(hour)
            log.error(
                "usage log unreachable: %d rows of hour %d dropped (too many waiting)", len(dropped), hour
            )

    async def _forever(self) -> None:
        failing = False
        while True:
            await asyncio.sleep(self.flush_s)
            if not self._pending:
                continue
            try:
                await self.flush()
                if failing:
                    log.info("usage log reachable again: counts added")
                failing = False
            except Exception as exc:
                if not failing:
                    log.warning("usage log unreachable, counts kept here until it is back: %s", exc)
                failing = True

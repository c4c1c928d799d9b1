"""Live leases of this process, heartbeated by one background task.

One task renews every live lease each ``ttl/3`` (not one timer per request), so a crashed
gateway's leases expire within a TTL while a live one never loses a long stream's tokens.
At shutdown whatever is still registered is released (the last line of "release exactly once").
"""

from __future__ import annotations

import asyncio
import logging

from budgets.background import BackgroundTask
from budgets.types import BudgetStore

log = logging.getLogger("tokengate.leases")


class LeaseKeeper:
    def __init__(self, store: BudgetStore, ttl_s: float) -> None:
        self._store = store
        self._period = max(ttl_s / 3.0, 0.01)
        self._live: dict[str, None] = {}  # insertion-ordered set
        self._beat = BackgroundTask("tokengate-heartbeat", self._run, log)

    def __len__(self) -> int:
        return len(self._live)

    def add(self, lease_id: str) -> None:
        self._live[lease_id] = None

    def discard(self, lease_id: str) -> None:
        self._live.pop(lease_id, None)

    def start(self) -> None:
        self._beat.start()

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self._period)
            if not self._live:
                continue
            try:
                await self._store.heartbeat(list(self._live))
            except Exception:  # a missed beat is survivable; a dead task is not
                log.exception("lease heartbeat failed")

    async def close(self) -> int:
        """Stop beating and release every lease still registered; returns how many."""
        await self._beat.stop()
        released = 0
        for lease_id in list(self._live):
            self._live.pop(lease_id, None)
            try:
                if await self._store.release(lease_id):
                    released += 1
            except Exception:
                log.exception("releasing lease %s at shutdown failed", lease_id)
        return released

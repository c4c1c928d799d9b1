"""Where quota windows live: the ledger seam and its in-process implementation.

The rules are budgets/quota.py; a ledger keeps their state — in this process (:class:`MemoryQuotas`)
or cluster-wide in Redis (budgets/redis/quotas.py), with one contract suite for both
(tests/budgets/test_contract_quotas.py). Reservations expire ``ttl_s`` after their last heartbeat
(the gateway beats them with its leases) and are then settled at the amount reserved, so a gateway
that died mid-request never leaves a window holding its reservation for good.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from typing import Protocol, runtime_checkable

from budgets import quota
from budgets.background import BackgroundTask
from budgets.quota import Charge, Refused, Reserved
from budgets.types import StoreUnavailable

_log = logging.getLogger(__name__)


@runtime_checkable
class QuotaLedger(Protocol):
    """Contract (budgets/quota.py has the rules):
    - ``reserve`` takes every charge or none; a refusal names the first enforced charge that did
      not fit and its window's buckets. Raises StoreUnavailable when the ledger cannot be reached.
    - ``settle`` is idempotent by reservation id: True the first time, False afterwards (also after
      the reservation expired, or was lost with the store's data). ``actual``: per charge, the
      amount used; None settles at the amount reserved.
    - ``heartbeat`` keeps reservations alive; ``expire`` settles those not beaten within ``ttl_s``.
    - ``usage`` reads (used, reserved) of quota windows, each given as (key, oldest bucket).
    - ``reset`` forgets the use counted under each key (reservations stay); the total forgotten."""

    ttl_s: float

    async def start(self) -> None: ...

    async def close(self) -> None: ...

    async def reserve(self, rid: str, charges: Sequence[Charge]) -> Reserved | Refused: ...

    async def settle(self, rid: str, actual: Sequence[int] | None = None) -> bool: ...

    async def heartbeat(self, rids: Sequence[str]) -> None: ...

    async def expire(self) -> int: ...

    async def usage(self, windows: Sequence[tuple[str, int]]) -> list[tuple[int, int]]: ...

    async def reset(self, keys: Sequence[str]) -> int: ...


class MemoryQuotas:
    """QuotaLedger for one process; ``start()`` runs the expiry until ``close()``. ``clock`` drives
    reservation expiry only (the windows follow the wall-clock ``now`` the charges were made at)."""

    def __init__(self, ttl_s: float = 10.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.ttl_s = ttl_s
        self._clock = clock
        self._state = quota.LedgerState()
        self._expiry = BackgroundTask("quota-expiry", self._expire_forever, _log)
        self._closed = False

    async def start(self) -> None:
        self._expiry.start()

    async def close(self) -> None:
        self._closed = True
        await self._expiry.stop()

    async def reserve(self, rid: str, charges: Sequence[Charge]) -> Reserved | Refused:
        if self._closed:
            raise StoreUnavailable("shutting down")
        return quota.reserve(self._state, rid, charges, self._clock() + self.ttl_s)

    async def settle(self, rid: str, actual: Sequence[int] | None = None) -> bool:
        return quota.settle(self._state, rid, actual)

    async def heartbeat(self, rids: Sequence[str]) -> None:
        quota.heartbeat(self._state, rids, self._clock() + self.ttl_s)

    async def expire(self) -> int:
        return quota.expire(self._state, self._clock())

    async def usage(self, windows: Sequence[tuple[str, int]]) -> list[tuple[int, int]]:
        return [quota.usage(self._state, key, oldest) for key, oldest in windows]

    async def reset(self, keys: Sequence[str]) -> int:
        return sum(quota.reset(self._state, key) for key in keys)

    def held(self) -> int:
        """Reservations not settled yet (tests and /stats)."""
        return len(self._state.held)

    async def _expire_forever(self) -> None:
        while True:
            await asyncio.sleep(max(0.05, self.ttl_s / 4))
            try:
                quota.expire(self._state, self._clock())
            except Exception:
                _log.exception("quota expiry failed")

"""Fail-open admission while Redis is down: an embedded MemoryStore with this replica's share.

With ``fail_mode: open`` a down store admits against this *fallback*, whose capacities are the
layout's divided by ``replicas``. It cannot see what Redis admitted before the outage, so while
Redis is down for all R replicas a pool of capacity C runs at most (pre-outage requests still
running, <= C) + R * floor(C/R) tokens: 2 * C at worst, C once the pre-outage requests have ended
(docs/redis.md has the partition case).

The fallback knows which leases it granted (``holds``) until a recovery hands them over to Redis:
``adopt`` takes one out of its table (it stays counted here until ``forget``, so a failed recovery
leaves the local share exactly as full as it was, ``keep`` puts it back), and its waiting tickets
leave as ``Moved`` (``hand_over_waiting``), oldest first.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

from budgets.memory import MemoryStore
from budgets.redis.held import HeldLeases
from budgets.types import BudgetLayout, Demand, Lease, StoreSnapshot


class Moved(Exception):
    """Raised in a fallback waiter's acquire: the recovery moved its ticket into Redis.

    ``call`` is the acquire script call already submitted for it (under a new ``lease_id``), in
    the order the fallback received the tickets.
    """

    def __init__(self, lease_id: str, call: asyncio.Future[Any]) -> None:
        super().__init__(lease_id)
        self.lease_id = lease_id
        self.call = call


def scaled_layout(layout: BudgetLayout, replicas: int) -> BudgetLayout:
    """Each replica's conservative share of every pool, for fail-open admission."""
    n = max(1, replicas)
    pools = {name: replace(p, capacity=p.capacity // n) for name, p in layout.pools.items()}
    return replace(layout, pools=pools)


class Fallback:
    def __init__(
        self,
        layout: BudgetLayout,
        replicas: int,
        clock: Callable[[], float],
        *,
        in_redis: HeldLeases,
        on_unclaimed: Callable[[Lease | BaseException], None],
    ) -> None:
        """``in_redis``: the store's Redis leases (a grant the recovery already adopted is one).
        ``on_unclaimed``: an outcome a cancelled waiter never took that is not the fallback's to
        undo (a ``Moved`` ticket, or a lease adopted into Redis)."""
        self._replicas = replicas
        self._in_redis = in_redis
        self._on_unclaimed = on_unclaimed
        self._store = MemoryStore(scaled_layout(layout, replicas), clock, on_unclaimed=self._unclaimed)
        self._local: dict[str, Lease] = {}  # granted here, not (yet) adopted into Redis

    async def start(self) -> None:
        await self._store.start()

    async def close(self) -> None:
        await self._store.close()

    async def apply_layout(self, layout: BudgetLayout) -> None:
        await self._store.apply_layout(scaled_layout(layout, self._replicas))

    # ---- admission while Redis is down ----

    async def admit(self, demand: Demand, max_wait_s: float) -> Lease | Moved:
        """Admit locally; a ticket still waiting when Redis is back comes out ``Moved``."""
        try:
            lease = await self._store.acquire(demand, max(0.0, max_wait_s))
        except Moved as moved:
            return moved
        # A grant whose waiter resumes only after the recovery moved it into Redis is already
        # held as a Redis lease.
        if lease.id not in self._in_redis:
            self._local[lease.id] = lease
        return lease

    def holds(self, lease_id: str) -> bool:
        return lease_id in self._local

    async def release(self, lease_id: str, actual_decode: int | None) -> None:
        self._local.pop(lease_id, None)
        await self._store.release(lease_id, actual_decode)

    async def extend(self, lease_id: str, tokens: int) -> int | None:
        over = await self._store.extend(lease_id, tokens)
        lease = self._local.get(lease_id)
        if over is not None and lease is not None:  # its move into Redis carries the grown cost
            self._local[lease_id] = replace(
                lease, demand=replace(lease.demand, decode=lease.demand.decode + tokens)
            )
        return over

    async def heartbeat(self, lease_ids: Sequence[str]) -> None:
        await self._store.heartbeat(lease_ids)

    async def reap_expired(self) -> int:
        return await self._store.reap_expired()

    async def snapshot(self) -> StoreSnapshot:
        return await self._store.snapshot()

    def _unclaimed(self, outcome: Lease | BaseException) -> None:
        if isinstance(outcome, Lease) and self._local.pop(outcome.id, None) is not None:
            return  # granted here, released by the MemoryStore already
        self._on_unclaimed(outcome)

    # ---- the hand-over to Redis (a recovery) ----

    def pause(self) -> None:
        """Grant nothing more (from the moment Redis answers again)."""
        self._store.pause()

    def resume(self) -> None:
        self._store.resume()

    def leases(self) -> list[Lease]:
        """Every lease the fallback counts; local ones it reaped meanwhile are dropped."""
        leases = self._store.leases()
        live = {lease.id for lease in leases}
        for lease_id in [i for i in self._local if i not in live]:
            del self._local[lease_id]  # reaped: nothing runs under it any more
        return leases

    def live_ids(self) -> set[str]:
        return {lease.id for lease in self._store.leases()}

    def adopt(self, lease_id: str) -> None:
        """Redis holds it from now on (the MemoryStore keeps counting it until ``forget``)."""
        self._local.pop(lease_id, None)

    def keep(self, lease: Lease) -> None:
        """The recovery failed after ``adopt``: the lease is local again."""
        self._local[lease.id] = lease

    def forget(self, lease_id: str) -> None:
        """Stop counting a lease (counted in Redis now, or released there)."""
        self._store.forget(lease_id)

    def hand_over_waiting(self, move: Callable[[Demand], Moved]) -> int:
        """Fail every waiting ticket with ``move(demand)``, oldest first; how many there were."""
        return self._store.hand_over_waiting(move)

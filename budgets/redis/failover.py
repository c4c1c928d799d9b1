"""The Redis store's outage handling: down and up again.

On a failed call (budgets/redis/transport.py) the store is *down* until a probe (the store's
maintenance loop calls ``recover``) succeeds. While down, ``fail_mode: closed`` refuses at once
(the gateway answers 503) and ``fail_mode: open`` admits against the fallback
(budgets/redis/fallback.py); releases and withdrawals that could not reach Redis wait here
(``defer_release``, ``defer_withdraw``) until the recovery applies them.

**Recovery** (the probe succeeded, Redis lost the layout, or its incarnation token ``T:epoch``
changed), in this order: the fallback stops granting; the layout is re-applied; this replica's
in-flight leases (Redis's and the fallback's) are registered in Redis before any pending release
or withdrawal can make Redis grant; if Redis lost its data, new grants are held back until
``replicas`` replicas have re-registered theirs (budgets/redis/settle.py); then the store is up,
and the fallback's waiting tickets are queued in Redis oldest first, each with what is left of its
wait. From then on every running request is counted in Redis, which grants nothing on a full pool.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

from budgets.redis.fallback import Fallback, Moved
from budgets.redis.held import Held, HeldLeases
from budgets.redis.keys import KeyLayout, pack_demand, usage_arg
from budgets.redis.options import RedisOptions
from budgets.redis.settle import SettleGate
from budgets.redis.transport import Down, Transport
from budgets.types import Demand, Lease

_log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Resync:
    """The store's part of a recovery; its calls are internal (they run while the store is down)."""

    write_layout: Callable[[], Awaitable[None]]  # the layout this replica knows, into Redis
    reregister: Callable[[], Awaitable[None]]  # heartbeat every Redis lease held; lost ones restored
    restore: Callable[[Sequence[Lease]], Awaitable[None]]  # register leases Redis does not know
    new_lease_id: Callable[[], str]


def _why(err: BaseException) -> str:
    """What went wrong, for the log: a timeout's text is empty."""
    if str(err):
        return str(err)
    return "no answer within the call timeout" if isinstance(err, TimeoutError) else type(err).__name__


class Failover:
    def __init__(
        self,
        options: RedisOptions,
        transport: Transport,
        keys: KeyLayout,
        *,
        held: HeldLeases,
        fallback: Fallback | None,
        settle: SettleGate,
        resync: Resync,
    ) -> None:
        self._opts = options
        self._transport = transport
        self._keys = keys
        self._held = held
        self._fallback = fallback
        self._settle = settle
        self._resync = resync
        self._down = False
        self._recovering = asyncio.Lock()
        self._epoch: str | None = None  # Redis's incarnation token as last seen (see sync_epoch)
        # Redis lost its data and no recovery has finished since: sync_epoch stored the new token
        # already, so a retry after a failed attempt must not take "no change" for "nothing lost".
        self._data_lost = False
        self._pending_release: dict[str, int | None] = {}
        self._pending_withdraw: dict[str, int] = {}  # lease id -> seq (a seq may recur after a restart)
        self._pending_abandon: set[str] = set()

    @property
    def down(self) -> bool:
        return self._down

    def mark_down(self, err: BaseException) -> None:
        why = _why(err)
        if not self._down:
            self._down = True
            _log.warning("budget store unreachable (%s); fail_mode=%s", why, self._opts.fail_mode)
        # Held-back calls try again (through the fallback in open mode) instead of waiting for a
        # settle that can no longer be observed.
        self._settle.fail(Down(why))

    def defer_release(self, lease_id: str, actual_decode: int | None) -> None:
        """A release Redis has not applied: the recovery applies it."""
        self._pending_release[lease_id] = actual_decode

    def defer_withdraw(self, seq: int, lease_id: str) -> None:
        """A withdrawal Redis has not applied: the recovery applies it (a grant it finds is given back)."""
        self._pending_withdraw[lease_id] = seq

    def defer_abandon(self, lease_id: str) -> None:
        """An acquire whose reply was lost (sent, then Redis timed out or the connection broke): it
        may have run, granting a lease or queuing a ticket nobody waits for. The recovery takes
        back whichever it finds, instead of leaving a lease to its TTL."""
        self._pending_abandon.add(lease_id)

    # ---- Redis's incarnation ----

    async def sync_epoch(self) -> bool:
        """Read Redis's incarnation token, creating it if Redis has none; True if it changed.

        A Redis that restarted empty (or was flushed, or failed over to an empty replica) has no
        token, so the first replica back writes a new one and the others see a different one.
        """
        async with self._transport.client.pipeline(transaction=False) as pipe:
            pipe.set(self._keys.epoch, secrets.token_hex(8), nx=True)
            pipe.get(self._keys.epoch)
            _created, epoch = await self._transport.call(pipe.execute())
        changed = epoch != self._epoch
        self._epoch = epoch
        return bool(changed)

    def is_new_epoch(self, epoch: str | None) -> bool:
        """``epoch`` (read from Redis) says Redis lost its data since this replica last synced."""
        return epoch != self._epoch

    async def redis_restarted(self) -> bool:
        return self.is_new_epoch(await self._transport.call(self._transport.client.get(self._keys.epoch)))

    async def recover_from(self, reason: str) -> None:
        """A call that worked found Redis without its data: down, then recovered; Down if that failed."""
        self.mark_down(RuntimeError(reason))
        if not await self.recover():
            raise Down("redis lost its data and recovery failed")

    # ---- recovery ----

    async def recover(self) -> bool:
        """Bring a down store back: layout, in-flight leases, pending work, waiting tickets.

        True when up again. From the moment Redis answers, the fallback grants nothing more; its
        leases are registered in Redis (with this replica's other in-flight leases) before any
        release or withdrawal can make Redis grant something, and its waiting tickets are queued
        in Redis only after that, oldest first.
        """
        async with self._recovering:
            if not self._down:
                return True
            if not await self._transport.ping():
                return False
            fallback = self._fallback
            if fallback is not None:
                fallback.pause()
            adopted: list[Lease] = []
            try:
                await self._resync.write_layout()
                if await self.sync_epoch():
                    self._data_lost = True
                await self._resync.reregister()
                adopted = await self._adopt_local()
                settled = not self._data_lost or await self._settle.join()
                await self._apply_pending()
            except Down:
                self._unadopt(adopted)
                if fallback is not None:
                    fallback.resume()
                return False
            # From here to the end nothing awaits: no acquire can slip in between.
            self._down = False
            self._data_lost = False
            if not settled:
                self._settle.hold_back()
            if fallback is not None:
                for lease in adopted:
                    fallback.forget(lease.id)  # counted in Redis now, and only there
                moved = fallback.hand_over_waiting(self._move)
                fallback.resume()
                if moved:
                    _log.warning("moved %d waiting requests from the local budget into redis", moved)
            _log.warning("budget store reachable again")
            return True

    async def _apply_pending(self) -> None:
        # Until these loops find nothing left, callers may still add to them (releases and
        # withdrawals wait for the recovery while the store is down).
        while self._pending_abandon or self._pending_withdraw or self._pending_release:
            if self._pending_abandon:
                lease_id = next(iter(self._pending_abandon))
                await self._transport.eval("withdraw", ["", lease_id, "1"], internal=True)
                self._pending_abandon.discard(lease_id)
            elif self._pending_withdraw:
                lease_id, seq = next(iter(self._pending_withdraw.items()))
                await self._transport.eval("withdraw", [str(seq), lease_id, "1"], internal=True)
                self._pending_withdraw.pop(lease_id, None)
            else:
                lease_id, actual = next(iter(self._pending_release.items()))
                await self._transport.eval("release", [lease_id, usage_arg(actual)], internal=True)
                self._pending_release.pop(lease_id, None)

    async def _adopt_local(self) -> list[Lease]:
        """Register the fallback's leases in Redis and hold them as Redis leases from now on.

        The fallback's own table is the truth (a grant whose waiter has not resumed yet is in it,
        not yet in the fallback's local leases); it is paused, so nothing is added while this
        runs. It keeps counting them until the recovery succeeds (``forget``) or fails
        (``_unadopt``), so a failed recovery leaves its local share exactly as full as it was.
        """
        fallback = self._fallback
        if fallback is None:
            return []
        local = fallback.leases()
        if not local:
            return []
        await self._resync.restore(local)
        still = fallback.live_ids()
        for lease in local:
            if fallback.holds(lease.id) or lease.id in still:
                # Held as a Redis lease now (a waiter that resumes later finds it so).
                fallback.adopt(lease.id)
                self._held[lease.id] = Held(lease)
            else:
                # Released locally while we were registering it: take it back out of Redis.
                self._pending_release[lease.id] = None
        return local

    def _unadopt(self, adopted: list[Lease]) -> None:
        """A recovery failed after _adopt_local: the fallback's leases are local again."""
        for lease in adopted:
            if self._held.pop(lease.id, None) is not None:
                assert self._fallback is not None
                self._fallback.keep(lease)
            elif self._fallback is not None:
                self._fallback.forget(lease.id)  # released meanwhile; its Redis release is pending

    def _move(self, demand: Demand) -> Moved:
        """A fallback ticket into the shared queue (called oldest first, by hand_over_waiting)."""
        lease_id = self._resync.new_lease_id()
        return Moved(lease_id, self._settle.submit([lease_id, *pack_demand(demand)]))

"""The embedded, process-local BudgetStore: budgets.policy plus futures for waiters and a reaper.

Everything that touches the state runs synchronously on the event loop thread, between awaits, so a
grant pass is atomic without locks. Two clocks are involved on purpose: the injectable ``clock``
drives every decision (ticket age for backfill, lease expiry, release rates), while ``max_wait_s``
and the reaper's period are real event-loop time (they are about how long a caller waits).

The Redis store embeds one as its fail-open fallback and, when Redis is back, takes everything out
of it without letting it grant anything more: ``pause``/``resume``, ``leases``, ``forget`` and
``hand_over_waiting`` exist for that hand-over (budgets/redis/).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import secrets
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from budgets import policy
from budgets.background import BackgroundTask
from budgets.min_tree import MostlyInOrder
from budgets.retry import ReleaseRate, retry_after
from budgets.types import (
    BudgetLayout,
    Demand,
    Lease,
    PoolState,
    QueueFull,
    QueueTimeout,
    StoreSnapshot,
    StoreUnavailable,
)

_log = logging.getLogger(__name__)

_NO_DEADLINE = (float("inf"), 0)  # above every (deadline, seq)
_NO_EXPIRY = (float("inf"), "")  # above every (expires_at, lease id)


@dataclass(slots=True)
class _Live:
    lease: Lease
    expires_at: float
    n: int  # grant order: expired leases are reaped in this order


class MemoryStore:
    """BudgetStore for one process. ``start()`` runs the lease reaper until ``close()``.

    ``reap_interval_s`` defaults to a quarter of the layout's lease TTL (at least 50 ms), so an
    abandoned lease is returned at most ~1.25 TTL after its last heartbeat. Requests may wait at
    most ``min(max_wait_s, tier.max_queue_wait_s)``.

    ``on_unclaimed(outcome)`` is called when a waiter is cancelled after its outcome was already
    decided (a grant, given back here before the call, or an exception set by
    ``hand_over_waiting``): the owner of the store may have acted on that outcome elsewhere.
    """

    def __init__(
        self,
        layout: BudgetLayout,
        clock: Callable[[], float] = time.monotonic,
        *,
        reap_interval_s: float | None = None,
        on_unclaimed: Callable[[Lease | BaseException], None] | None = None,
    ) -> None:
        self._clock = clock
        self._state = policy.PolicyState(layout)
        self._leases: dict[str, _Live] = {}
        # (expires_at, lease id) by lease id, so that a reap looks only at leases that may have
        # expired; a lease that leaves or is heartbeaten moves its entry at once (heartbeats and
        # grants come in clock order: the FIFO's end).
        self._expiry: MostlyInOrder[str, tuple[float, str]] = MostlyInOrder(_NO_EXPIRY)
        self._grants = itertools.count()
        self._waiters: dict[int, asyncio.Future[Lease | None]] = {}  # None: its deadline passed
        # Waiters' deadlines (loop time, seq) by seq, and one loop timer for the earliest: a timer
        # per waiter cost a TimerHandle, its arguments and a slot in the loop's own heap (ordered by
        # a Python-level comparison) for every waiting request, all walked by each full garbage
        # collection. A waiter that leaves takes its deadline out (a lazy heap's leftovers were
        # rebuilt away in one O(waiters) step); deadlines mostly come in order, kept in a FIFO.
        self._deadlines: MostlyInOrder[int, tuple[float, int]] = MostlyInOrder(_NO_DEADLINE)
        self._deadline_timer: asyncio.TimerHandle | None = None
        self._deadline_at = float("inf")
        self._deadline_loop: asyncio.AbstractEventLoop | None = None  # the timer's
        self._rates: dict[str, ReleaseRate] = {}
        self._reap_interval_s = reap_interval_s
        self._reaper = BackgroundTask("budget-reaper", self._reap_forever, _log)
        self._on_unclaimed = on_unclaimed
        self._paused = False
        self._started = False
        self._closed = False
        # A random prefix per store keeps ids unique across restarts and replicas; the counter
        # keeps minting cheap.
        self._id_prefix = secrets.token_hex(6)
        self._id_counter = itertools.count(1)

    # ---- lifecycle ----

    async def start(self) -> None:
        if self._closed:
            raise StoreUnavailable("store is closed")
        self._reaper.start()
        self._started = True

    async def close(self) -> None:
        self._closed = True
        self._started = False
        await self._reaper.stop()
        waiters, self._waiters = self._waiters, {}
        if self._deadline_timer is not None:
            self._deadline_timer.cancel()
            self._deadline_timer, self._deadline_at = None, float("inf")
        self._deadlines = MostlyInOrder(_NO_DEADLINE)
        now = self._clock()
        for seq, fut in waiters.items():
            policy.withdraw(self._state, seq, now)
            if not fut.done():
                fut.set_exception(StoreUnavailable("shutting down"))

    async def healthy(self) -> bool:
        return self._started and not self._closed

    def describe(self) -> dict[str, object]:
        return {"kind": "memory"}

    async def apply_layout(self, layout: BudgetLayout) -> None:
        for ticket, err in policy.apply_layout(self._state, layout):
            fut = self._waiter_gone(ticket.seq)
            if fut is not None and not fut.done():
                fut.set_exception(err)
        self._grant(self._clock())

    # ---- hand-over (the Redis store's fail-open recovery) ----

    def pause(self) -> None:
        """Grant nothing until ``resume()``: new demands and waiting tickets stay queued."""
        self._paused = True

    def resume(self) -> None:
        self._paused = False
        self._grant(self._clock())

    def leases(self) -> list[Lease]:
        """Every live lease, including grants whose waiter has not resumed yet."""
        return [live.lease for live in self._leases.values()]

    def forget(self, lease_id: str) -> bool:
        """Drop a lease another store has taken over: its tokens come back here, nothing else."""
        live = self._lease_gone(lease_id)
        if live is None:
            return False
        now = self._clock()
        policy.release(self._state, live.lease.demand, None, now)
        self._grant(now)
        return True

    def hand_over_waiting(self, outcome: Callable[[Demand], BaseException]) -> int:
        """Withdraw every waiting ticket, oldest first; each waiter's ``acquire`` raises
        ``outcome(demand)``, called in that order. Returns how many were handed over."""
        tickets = sorted(self._state.waiting.values(), key=lambda t: t.seq)
        now = self._clock()
        for ticket in tickets:
            policy.withdraw(self._state, ticket.seq, now)
            fut = self._waiter_gone(ticket.seq)
            if fut is not None and not fut.done():
                fut.set_exception(outcome(ticket.demand))
        self._grant(self._clock())  # withdrawn tickets may have held pools for themselves
        return len(tickets)

    # ---- acquire / release ----

    async def acquire(self, demand: Demand, max_wait_s: float) -> Lease:
        if self._closed:
            raise StoreUnavailable("shutting down")
        state = self._state
        policy.check_demand(state.layout, demand)
        now = self._clock()
        if not self._paused and policy.grant_immediately(state, demand):
            return self._mint(demand, now, now)
        # Enqueue and run a pass even when the tenant's queue is full: a demand the pass grants at
        # once (say a higher tier than the tenant's queued work) never waits, so it is not refused.
        ticket = policy.enqueue(state, demand, now)
        mine = self._grant(now, own=ticket.seq)
        if mine is not None:
            return mine
        tenant = state.layout.tenants[demand.tenant]
        ahead = state.tenant_waiting.get(demand.tenant, 0) - 1
        if ahead >= tenant.max_queue_len:
            self._withdraw(ticket.seq, now)
            raise QueueFull(
                f"tenant {demand.tenant} already has {ahead} requests waiting (max_queue_len "
                f"{tenant.max_queue_len})",
                retry_after_s=retry_after(state, demand, self._rates, now),
            )
        wait_s = min(max_wait_s, state.layout.tiers[demand.tier].max_queue_wait_s)
        if wait_s > 0:
            loop = asyncio.get_running_loop()
            fut: asyncio.Future[Lease | None] = loop.create_future()
            self._waiters[ticket.seq] = fut
            # The future itself is awaited (asyncio.wait would add a waiter future, callbacks and a
            # loop hop per grant); the deadline resolves it with None, after which no grant is
            # handed to it (a grant racing the deadline finds it done and is given back).
            self._add_deadline(loop, loop.time() + wait_s, ticket.seq)
            try:
                lease = await fut
            except asyncio.CancelledError:
                self._abandon(ticket.seq, fut)
                raise
            if lease is not None:
                return lease
            self._waiters.pop(ticket.seq, None)  # (its deadline left with the timer's call)
        now = self._clock()
        self._withdraw(ticket.seq, now)
        raise QueueTimeout(
            f"waited {wait_s:.3g}s for {demand.cost} tokens in tier {demand.tier} without a grant",
            retry_after_s=retry_after(state, demand, self._rates, now),
        )

    async def release(self, lease_id: str, actual_decode: int | None = None) -> bool:
        # actual_decode is the backend's completion-token count; policy.release clamps it.
        live = self._lease_gone(lease_id)
        if live is None:
            return False
        now = self._clock()
        self._return(live.lease.demand, actual_decode, now)
        if self._state.waiting:
            self._grant(now)
        return True

    async def extend(self, lease_id: str, tokens: int) -> int | None:
        live = self._leases.get(lease_id)
        if live is None or tokens <= 0:
            return None if live is None else 0
        demand, over = policy.extend(self._state, live.lease.demand, tokens)
        live.lease = replace(live.lease, demand=demand)
        return over

    async def heartbeat(self, lease_ids: Sequence[str]) -> None:
        expires_at = self._clock() + self._state.layout.policy.lease_ttl_s
        for lease_id in lease_ids:
            live = self._leases.get(lease_id)
            if live is not None and live.expires_at != expires_at:
                live.expires_at = expires_at
                self._expire_at(expires_at, lease_id)

    async def reap_expired(self) -> int:
        """Return expired leases' tokens to their pools; the number of leases reaped."""
        return self._reap()

    async def snapshot(self) -> StoreSnapshot:
        state = self._state
        layout = state.layout
        pools = {
            name: PoolState(name, spec.capacity, state.in_flight.get(name, 0), spec.shared)
            for name, spec in layout.pools.items()
        }
        # Pools removed by a layout change while leases still hold tokens in them: capacity 0.
        for name, used in state.in_flight.items():
            if name not in pools:
                pools[name] = PoolState(name, 0, used, True)
        queue_depth = dict.fromkeys(layout.tiers, 0)
        queue_depth.update(state.tier_waiting)
        tenant_depth = dict.fromkeys(layout.tenants, 0)
        tenant_depth.update(state.tenant_waiting)
        return StoreSnapshot(
            pools=pools,
            queue_depth=queue_depth,
            tenant_queue_depth=tenant_depth,
            virtual_service=dict(state.counters),
            leases=len(self._leases),
        )

    # ---- internals (synchronous: each runs atomically on the loop) ----

    def _mint(self, demand: Demand, now: float, enqueued_at: float) -> Lease:
        lease = Lease(
            id=f"{self._id_prefix}-{next(self._id_counter):x}",
            demand=demand,
            granted_at=now,
            queued_s=now - enqueued_at,
        )
        expires_at = now + self._state.layout.policy.lease_ttl_s
        self._leases[lease.id] = _Live(lease, expires_at, next(self._grants))
        self._expiry.add(lease.id, (expires_at, lease.id))
        return lease

    def _add_deadline(self, loop: asyncio.AbstractEventLoop, deadline: float, seq: int) -> None:
        self._deadlines.add(seq, (deadline, seq))
        # (A store used from a new event loop re-arms there: the old loop's timer may never run.)
        if deadline < self._deadline_at or loop is not self._deadline_loop:
            self._arm_deadline(loop, self._deadlines.lowest()[0])

    def _waiter_gone(self, seq: int) -> asyncio.Future[Lease | None] | None:
        """Take a waiter out, with its deadline (the timer stays: it finds nothing due)."""
        self._deadlines.discard(seq)
        return self._waiters.pop(seq, None)

    def _arm_deadline(self, loop: asyncio.AbstractEventLoop, at: float) -> None:
        if self._deadline_timer is not None:
            self._deadline_timer.cancel()
        self._deadline_timer = loop.call_at(at, self._expire_due, loop)
        self._deadline_at, self._deadline_loop = at, loop

    def _expire_due(self, loop: asyncio.AbstractEventLoop) -> None:
        """The earliest deadline came: every waiter whose deadline has passed wakes with None."""
        self._deadline_timer, self._deadline_at = None, float("inf")
        # Within a millisecond counts as come: uvloop's timers have millisecond resolution and may
        # fire that much early (a timer per waiter expired its waiter then too).
        deadlines, waiters, now = self._deadlines, self._waiters, loop.time() + 0.001
        while True:
            at, seq = deadlines.lowest()
            if not at <= now:  # (also when none is left: _NO_DEADLINE is infinite)
                break
            deadlines.discard(seq)
            fut = waiters.get(seq)
            if fut is not None and not fut.done():
                fut.set_result(None)
        if deadlines:
            self._arm_deadline(loop, at)

    def _expire_at(self, expires_at: float, lease_id: str) -> None:
        self._expiry.add(lease_id, (expires_at, lease_id))  # (moves the lease's entry)

    def _lease_gone(self, lease_id: str) -> _Live | None:
        self._expiry.discard(lease_id)
        return self._leases.pop(lease_id, None)

    def _grant(self, now: float, own: int | None = None) -> Lease | None:
        """Run a grant pass and hand each grant to its waiter; returns ``own``'s lease if granted."""
        if self._paused:
            return None
        mine: Lease | None = None
        orphaned = False
        for ticket in policy.grant_pass(self._state, now):
            lease = self._mint(ticket.demand, now, ticket.enqueued_at)
            if ticket.seq == own:
                mine = lease
                continue
            fut = self._waiter_gone(ticket.seq)
            if fut is None or fut.done():
                # Nobody can take it any more: give it straight back (nothing was served), then
                # pass again.
                self._drop_lease(lease.id, now, 0)
                orphaned = True
            else:
                fut.set_result(lease)
        if orphaned:
            self._grant(now)
        return mine

    def _drop_lease(self, lease_id: str, now: float, actual_decode: int | None) -> None:
        live = self._lease_gone(lease_id)
        if live is not None:
            self._return(live.lease.demand, actual_decode, now)

    def _return(self, demand: Demand, actual_decode: int | None, now: float) -> None:
        policy.release(self._state, demand, actual_decode, now)
        for name in demand.pools:
            meter = self._rates.get(name)
            if meter is None:
                meter = self._rates[name] = ReleaseRate()
            meter.add(demand.held_in(name), now)

    def _withdraw(self, seq: int, now: float) -> None:
        # A withdrawn ticket may have been holding pools for itself: others may now be granted.
        if policy.withdraw(self._state, seq, now) is not None:
            self._grant(now)

    def _abandon(self, seq: int, fut: asyncio.Future[Lease | None]) -> None:
        """The waiter was cancelled: withdraw its ticket, or give back a grant that raced it."""
        self._waiter_gone(seq)
        now = self._clock()
        if fut.done() and not fut.cancelled():  # (cancelled: by the task's cancel, while waiting)
            outcome: Lease | BaseException | None = fut.exception()
            if outcome is None:
                outcome = fut.result()
                if outcome is None:  # its deadline had passed: the ticket is still queued
                    self._withdraw(seq, now)
                    return
                self._drop_lease(outcome.id, now, 0)  # never reached its caller: nothing served
                self._grant(now)
            if self._on_unclaimed is not None:
                self._on_unclaimed(outcome)
        else:
            fut.cancel()
            self._withdraw(seq, now)

    def _reap(self) -> int:
        now = self._clock()
        expiry, leases = self._expiry, self._leases
        expired: list[_Live] = []
        while True:
            expires_at, lease_id = expiry.lowest()
            if not expires_at <= now:  # (also when none is left: _NO_EXPIRY is infinite)
                break
            expiry.discard(lease_id)
            expired.append(leases[lease_id])
        expired.sort(key=lambda live: live.n)  # grant order, as the leases were granted
        for live in expired:
            self._drop_lease(live.lease.id, now, None)  # usage unknown: the whole reservation is charged
        if expired:
            self._grant(now)
        policy.forget_idle(self._state, now)
        return len(expired)

    async def _reap_forever(self) -> None:
        while True:
            interval = self._reap_interval_s
            if interval is None:
                interval = max(0.05, self._state.layout.policy.lease_ttl_s / 4)
            await asyncio.sleep(interval)
            try:
                self._reap()
            except Exception:
                # A dead reaper would leak every abandoned lease from now on: log and keep going.
                _log.exception("budget reaper failed")

"""The cluster-wide BudgetStore: pools, the one wait queue and leases live in Redis.

Every decision (validation, fast-path grant, enqueue, the grant pass, release, reap) runs inside
one Lua script call (budgets/redis/lua, a port of budgets/policy.py), so replicas never race each
other and the Redis store decides exactly what the memory store would. Time is Redis server TIME.

This module is the BudgetStore protocol and the wiring; around the scripts its collaborators add
what a shared, remote store needs: the transport (budgets/redis/transport.py: bounded calls, the
lean connection, batching), the replies parser (replies.py), and the outage handling
(failover.py, with the fail-open fallback in fallback.py and the settle after data loss in
settle.py). The store itself keeps:

- **Wake-ups.** A ticket granted by any replica's script is announced on the owner's channel
  ``T:wake:<replica>``; waiters also poll their ticket every ``poll_interval_s``, so a lost message
  delays a grant but never loses it. A ticket that vanished (Redis restarted) is enqueued again.
- **Leases.** Lease ids are chosen by the owner (``<replica>-<n>``); heartbeats extend them; a lease
  Redis does not know but this replica still holds (Redis restarted, or it was reaped after missed
  heartbeats) is re-registered unconditionally: the request is running whatever Redis remembers,
  so it must be counted; an overcommitted pool simply drains before new grants. Releases of
  unknown ids leave a short tombstone so a racing re-registration cannot resurrect them.
- **Liveness.** Each replica refreshes ``T:replicas`` from its maintenance loop; the reap script
  withdraws waiting tickets of replicas whose liveness expired. A SIGKILLed replica's leases are
  not heartbeated and come back when they expire (one lease TTL).
- **The layout.** Written by ``apply_layout``, announced on ``T:layout``; the other replicas adopt
  it (and tell their layout listeners) when the announcement or their maintenance poll sees it.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import logging
import secrets
import time
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, NoReturn

from redis.asyncio import Redis

from budgets import policy
from budgets.redis import replies
from budgets.redis.failover import Failover, Resync
from budgets.redis.fallback import Fallback, Moved
from budgets.redis.held import Held, HeldLeases
from budgets.redis.keys import KeyLayout, layout_args, layout_from_json, pack_demand, usage_arg
from budgets.redis.options import RedisOptions
from budgets.redis.quotas import RedisQuotas
from budgets.redis.replies import Granted, Invalid, Outcome, Queued, QueueIsFull, Release, Withdrawn
from budgets.redis.settle import SettleGate
from budgets.redis.snapshot import held_snapshot, read_snapshot
from budgets.redis.transport import Down, Transport
from budgets.redis.usage_log import RedisUsageLog
from budgets.types import (
    BudgetLayout,
    Demand,
    Lease,
    NeverFits,
    QueueFull,
    QueueTimeout,
    StoreSnapshot,
    StoreUnavailable,
    UnknownTenantOrTier,
)

_log = logging.getLogger(__name__)

_REAP_BATCH = 1000
EARLY_WAKES = 1024  # wake-ups kept for waiters not registered yet


@dataclass(slots=True)
class _Waiter:
    seq: int
    lease_id: str
    demand: Demand
    future: asyncio.Future[replies.WakeUp] = field(
        default_factory=lambda: asyncio.get_running_loop().create_future()
    )


class RedisStore:
    def __init__(
        self,
        layout: BudgetLayout,
        options: RedisOptions | None = None,
        *,
        clock: Callable[[], float] | None = None,
        client: Redis | None = None,
        replica_id: str | None = None,
    ) -> None:
        self._opts = options or RedisOptions()
        self._layout = layout
        self._keys = KeyLayout(self._opts.key_prefix)
        self._clock = clock
        self._replica = replica_id or secrets.token_hex(6)
        self._ids = itertools.count(1)
        self._held: HeldLeases = {}
        self._waiters: dict[int, _Waiter] = {}
        # Wake-ups that came before their waiter registered (below, _on_wake), oldest first.
        self._early: dict[tuple[int, str], replies.WakeUp] = {}  # by (seq, lease id)
        self._listeners: list[Callable[[BudgetLayout], None]] = []
        self._releasing: dict[str, asyncio.Future[Any]] = {}  # write-behind releases on their way
        self._last_beat_sent = 0.0  # loop time of the last liveness refresh sent (see _granted_after)
        self._layout_ver = 0
        self._tasks: list[asyncio.Task[None]] = []
        self._background: set[asyncio.Task[Any]] = set()
        self._started = False
        self._closed = False
        self.restored_leases = 0  # leases re-registered after Redis forgot them (observability)
        self._transport = Transport(
            self._opts,
            self._keys,
            self._replica,
            client=client,
            clock=clock,
            is_down=lambda: self._failover.down,
            on_down=lambda err: self._failover.mark_down(err),
            on_wake=self._on_wake,
        )
        self._settle = SettleGate(
            self._transport,
            self._keys,
            self._replica,
            replicas=self._opts.replicas,
            poll_s=self._opts.poll_interval_s,
            window_s=lambda: self.settle_s,
            spawn=self._spawn,
            closed=lambda: self._closed,
        )
        self._fallback: Fallback | None = None
        if self._opts.fail_mode == "open":
            self._fallback = Fallback(
                layout,
                self._opts.replicas,
                clock or time.monotonic,
                in_redis=self._held,
                on_unclaimed=self._unclaimed,
            )
        self._failover = Failover(
            self._opts,
            self._transport,
            self._keys,
            held=self._held,
            fallback=self._fallback,
            settle=self._settle,
            resync=Resync(
                write_layout=lambda: self._apply(self._layout, internal=True),
                reregister=self._reregister,
                restore=self._restore_internal,
                new_lease_id=self._new_lease_id,
            ),
        )

    # ---- properties for the gateway and tests ----

    def quota_ledger(self, ttl_s: float) -> RedisQuotas:
        """Quota windows in this store's Redis, under its domain's keys (budgets/redis/quotas.py)."""
        return RedisQuotas(
            self._transport,
            ttl_s=ttl_s,
            fail_open=self._opts.fail_mode == "open",
            replicas=self._opts.replicas,
        )

    def usage_log(self) -> RedisUsageLog:
        """Usage for billing in this store's Redis (budgets/redis/usage_log.py)."""
        return RedisUsageLog(self._transport)

    @property
    def replica_id(self) -> str:
        return self._replica

    @property
    def degraded(self) -> bool:
        """Redis is unreachable right now (requests fail fast or use the local fallback)."""
        return self._failover.down

    @property
    def settling(self) -> bool:
        """Redis lost its data and new grants wait until the other replicas re-registered theirs."""
        return self._settle.active

    @property
    def held_back(self) -> int:
        """Acquire calls waiting for the settle to end."""
        return self._settle.held_back

    @property
    def settle_s(self) -> float:
        """The longest grants are held back after Redis lost its data (RedisOptions.settle_window_s)."""
        return self._opts.settle_window_s(self._layout.policy.lease_ttl_s)

    @property
    def script_reloads(self) -> int:
        """Lua code loaded again after Redis had lost it (restarted or flushed; observability)."""
        return self._transport.script_reloads

    @property
    def lua_mode(self) -> str:
        """``functions`` (the Redis 7 function library) or ``scripts`` (EVALSHA; Redis 6)."""
        return self._transport.lua_mode

    @property
    def ops_per_batch(self) -> float:
        """Acquires and releases per batch script call so far (observability, benchmarks)."""
        return self._transport.ops_per_batch

    @property
    def layout(self) -> BudgetLayout:
        """The layout this replica last applied or saw announced."""
        return self._layout

    @property
    def keys(self) -> KeyLayout:
        return self._keys

    # ---- lifecycle ----

    async def start(self) -> None:
        if self._closed:
            raise StoreUnavailable("store is closed")
        if self._started:
            return
        self._started = True
        if self._fallback is not None:
            await self._fallback.start()
        try:
            await self._apply(self._layout)
            await self._failover.sync_epoch()
            sent = asyncio.get_running_loop().time()
            await self._transport.eval("reap", [str(_REAP_BATCH)])  # also announces this replica as alive
            self._last_beat_sent = sent
        except Down:
            _log.warning("redis at %s unreachable at start; store is down until it answers", self._opts.url)
        loop = asyncio.get_running_loop()
        self._tasks = [
            loop.create_task(self._listen(), name="redis-store-listen"),
            loop.create_task(self._maintain(), name="redis-store-maintain"),
        ]

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._started = False
        for task in self._tasks:
            task.cancel()
        if self._tasks:
            await asyncio.wait(self._tasks, timeout=1.0)
        self._tasks = []
        self._settle.fail(StoreUnavailable("shutting down"))
        waiters, self._waiters = self._waiters, {}
        for w in waiters.values():
            if not self._failover.down:
                with contextlib.suppress(Down):
                    await self._transport.eval("withdraw", [str(w.seq), w.lease_id, "1"])
            if not w.future.done():
                w.future.set_exception(StoreUnavailable("shutting down"))
        if self._background:
            await asyncio.wait(list(self._background), timeout=self._opts.op_timeout_s)
        await self._transport.drain(self._opts.op_timeout_s)
        if self._fallback is not None:
            await self._fallback.close()
        await self._transport.close()

    def describe(self) -> dict[str, object]:
        """The domain, how Redis is reached (standalone, Sentinel, Cluster) and the node the script
        connection is on now (None: not connected), and the state of its outage handling."""
        return {
            "kind": "redis",
            "domain": self._opts.key_prefix,
            **self._transport.describe(),
            "degraded": self.degraded,
            "settling": self.settling,
            "lua": self.lua_mode,
            "script_reloads": self.script_reloads,
        }

    async def healthy(self) -> bool:
        """Ready to admit: started and Redis reachable, or degraded to the fail-open budget."""
        if not self._started or self._closed:
            return False
        return not self._failover.down or self._fallback is not None

    # ---- layout ----

    async def apply_layout(self, layout: BudgetLayout) -> None:
        self._set_layout(layout)
        try:
            await self._apply(layout)
        except Down:
            # Kept locally; the recovery writes it to Redis before anything else.
            _log.warning("budget store unreachable: layout change is applied when redis is back")

    async def _apply(self, layout: BudgetLayout, *, internal: bool = False) -> None:
        reply = await self._transport.eval("apply_layout", layout_args(layout), internal=internal)
        self._layout_ver = replies.layout_version(reply)

    def add_layout_listener(self, listener: Callable[[BudgetLayout], None]) -> None:
        """Call ``listener(layout)`` whenever a layout written by another replica is adopted."""
        self._listeners.append(listener)

    def _set_layout(self, layout: BudgetLayout, *, announce: bool = False) -> None:
        self._layout = layout
        if announce:
            for listener in self._listeners:
                try:
                    listener(layout)
                except Exception:
                    _log.exception("layout listener failed")
        if self._fallback is not None:
            self._spawn(self._fallback.apply_layout(layout))

    async def _reload_layout(self) -> None:
        """Adopt the layout another replica wrote (announced on the channel or seen by polling).

        Also notices that Redis lost its data (restart, flush, failover to an empty replica)
        without any call of this replica failing: its leases must then be registered again (a
        recovery) before it grants anything more.
        """
        client = self._transport.client
        async with client.pipeline(transaction=False) as pipe:
            pipe.hget(self._keys.layout, "ver")
            pipe.get(self._keys.epoch)
            ver, epoch = await self._transport.call(pipe.execute())
        if self._failover.is_new_epoch(epoch):
            await self._failover.recover_from("redis lost its data (restarted?)")
            return
        if ver is None or int(ver) == self._layout_ver:
            return
        ver, text = await self._transport.call(client.hmget(self._keys.layout, ["ver", "json"]))  # type: ignore[misc]
        if ver is not None and text is not None:
            self._layout_ver = int(ver)
            layout = layout_from_json(text)
            self._set_layout(layout, announce=layout != self._layout)

    # ---- acquire ----

    async def acquire(self, demand: Demand, max_wait_s: float) -> Lease:
        if self._closed:
            raise StoreUnavailable("shutting down")
        _check_shape(demand)
        loop = asyncio.get_running_loop()
        started = loop.time()
        lease_id = self._new_lease_id()
        while True:
            # Each turn is one try through Redis or the fallback; a failure of Redis sends the
            # request to the fallback, a recovery moves it back, always with what is left of its
            # wait.
            try:
                if self._failover.down:
                    local = await self._degraded_acquire(demand, max_wait_s - (loop.time() - started))
                    if isinstance(local, Lease):
                        return local
                    lease_id = local.lease_id
                    reply = await self._await_acquire(local.call, lease_id)
                    if not isinstance(reply, (Granted, Queued)):
                        reply = await self._refused(lease_id, demand, reply)
                else:
                    reply = await self._enqueue(lease_id, demand)
                if isinstance(reply, Granted):
                    return self._hold(lease_id, demand, reply, started)
                return await self._wait(reply, lease_id, demand, max_wait_s, started)
            except Down:
                # Marked down where it was raised: the next turn goes to the fallback (or to
                # Redis again, if a recovery has already run meanwhile), under a new lease id.
                lease_id = self._new_lease_id()
                continue

    def _new_lease_id(self) -> str:
        return f"{self._replica}-{next(self._ids):x}"

    async def _enqueue(self, lease_id: str, demand: Demand) -> Granted | Queued:
        """One acquire script call; returns a grant or a ticket, raises every refusal."""
        reply = await self._acquire_call(lease_id, [lease_id, *pack_demand(demand)])
        if isinstance(reply, (Granted, Queued)):
            return reply
        return await self._refused(lease_id, demand, reply)

    async def _refused(self, lease_id: str, demand: Demand, reply: replies.AcquireReply) -> Granted | Queued:
        """An acquire reply other than a grant or a ticket: a lost layout recovered from and retried,
        refusals raised."""
        if reply is Outcome.NO_LAYOUT:
            await self._failover.recover_from("redis lost the budget layout (restarted?)")
            reply = await self._acquire_call(lease_id, [lease_id, *pack_demand(demand)])
            if reply is Outcome.NO_LAYOUT:
                self._failover.mark_down(RuntimeError("redis lost the budget layout again"))
                raise Down("redis lost the budget layout again")
        if isinstance(reply, (Granted, Queued)):
            return reply
        if isinstance(reply, QueueIsFull):
            raise QueueFull(
                f"tenant {demand.tenant} already has {reply.queued} requests waiting "
                f"(max_queue_len {reply.max_queue_len})",
                retry_after_s=reply.retry_after_s,
            )
        if isinstance(reply, Invalid):
            await self._raise_invalid(demand, reply)
        raise AssertionError(f"unexpected acquire reply {reply!r}")

    async def _wait(
        self, ticket: Queued, lease_id: str, demand: Demand, max_wait_s: float, started: float
    ) -> Lease:
        loop = asyncio.get_running_loop()
        seq = ticket.seq
        wait_s = min(max_wait_s, ticket.max_wait_s)
        deadline = started + wait_s
        waiter = _Waiter(seq, lease_id, demand)
        self._register(waiter)
        try:
            while True:
                remaining = deadline - loop.time()
                if remaining <= 0:
                    break
                await asyncio.wait((waiter.future,), timeout=min(self._opts.poll_interval_s, remaining))
                outcome = (
                    waiter.future.result()
                    if waiter.future.done()
                    else replies.status(await self._transport.eval("status", [str(seq), lease_id]))
                )
                if isinstance(outcome, Granted):
                    return self._hold(lease_id, demand, outcome, self._granted_after(started))
                if isinstance(outcome, Invalid):
                    await self._raise_invalid(demand, outcome)
                if outcome is Outcome.UNKNOWN:
                    # Redis forgot the ticket (restart, or this replica was presumed dead):
                    # queue again under the same lease id, keeping the original deadline.
                    if self._closed:
                        raise StoreUnavailable("shutting down")
                    if await self._failover.redis_restarted():
                        # Nothing failed here yet: register this replica's leases before queueing.
                        await self._failover.recover_from("redis lost its data (restarted?)")
                    again = await self._enqueue(lease_id, demand)
                    if isinstance(again, Granted):
                        return self._hold(lease_id, demand, again, started)
                    self._unregister(waiter)
                    seq = waiter.seq = again.seq
                    self._register(waiter)
            left = replies.withdraw(await self._transport.eval("withdraw", [str(seq), lease_id, "0"]))
            if isinstance(left, Granted):
                return self._hold(lease_id, demand, left, self._granted_after(started))
            retry = left.retry_after_s if isinstance(left, Withdrawn) else None
            raise QueueTimeout(
                f"waited {wait_s:.3g}s for {demand.cost} tokens in tier {demand.tier} without a grant",
                retry_after_s=retry,
            )
        except asyncio.CancelledError:
            # The caller is gone: withdraw the ticket, or give back a grant that raced the cancel.
            await self._finish_cleanup(self._withdraw_quietly(seq, lease_id))
            raise
        except Down:
            self._failover.defer_withdraw(seq, lease_id)
            raise
        finally:
            self._unregister(waiter)

    async def _acquire_call(self, lease_id: str, args: list[str]) -> replies.AcquireReply:
        """The acquire script, batched with concurrent calls, safe against cancellation.

        The future is shielded: if the caller is cancelled mid-call, the script still runs (it
        may already have), and its grant or ticket is given back before the cancellation
        propagates, instead of being left to expire.
        """
        if self._failover.down:
            raise Down("redis is down")
        return await self._await_acquire(self._settle.submit(args), lease_id)

    async def _await_acquire(self, fut: asyncio.Future[Any], lease_id: str) -> replies.AcquireReply:
        try:
            reply = await asyncio.shield(fut)
        except asyncio.CancelledError:
            await self._finish_cleanup(self._abandon_enqueued(fut, lease_id))
            raise
        except Down:
            # The call may have run before Redis went away: its grant or ticket is taken back
            # by the recovery (and the caller's next try uses a new lease id).
            self._failover.defer_abandon(lease_id)
            raise
        return replies.acquire(reply)

    async def _abandon_enqueued(self, call: asyncio.Future[Any], lease_id: str) -> None:
        if self._settle.drop(call):
            return  # never sent
        try:
            reply = replies.acquire(await call)
        except (Exception, asyncio.CancelledError):
            return  # Redis down or shutting down: nothing was granted or queued that we know of
        if isinstance(reply, Granted):
            await self.release(lease_id, 0)  # never reached its caller: nothing was served
        elif isinstance(reply, Queued):
            await self._withdraw_quietly(reply.seq, lease_id)

    async def _finish_cleanup(self, coro: Coroutine[Any, Any, None]) -> None:
        """Run cleanup for a cancelled caller to completion before its cancellation propagates.

        Awaiting it (shielded) keeps the contract synchronous for the caller: once a cancelled
        acquire has finished, its ticket or lease is gone. A second cancellation stops the wait,
        not the cleanup, which then finishes in the background.
        """
        task = asyncio.ensure_future(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        with contextlib.suppress(BaseException):
            await asyncio.shield(task)

    async def _withdraw_quietly(self, seq: int, lease_id: str) -> None:
        try:
            await self._transport.eval("withdraw", [str(seq), lease_id, "1"])
        except Down:
            self._failover.defer_withdraw(seq, lease_id)

    async def _degraded_acquire(self, demand: Demand, max_wait_s: float) -> Lease | Moved:
        """Admit against the fallback; a ticket still waiting when Redis is back comes out Moved."""
        if self._fallback is None:
            raise StoreUnavailable(
                "budget store (redis) is unreachable and store.fail_mode is closed", retry_after_s=1.0
            )
        return await self._fallback.admit(demand, max_wait_s)

    def _unclaimed(self, outcome: Lease | BaseException) -> None:
        """The fallback decided for a waiter that was cancelled before it took the outcome, and
        the outcome is Redis's now: a ticket moved there, or a grant adopted there."""
        if isinstance(outcome, Moved):
            self._spawn(self._abandon_enqueued(outcome.call, outcome.lease_id))
        elif isinstance(outcome, Lease) and outcome.id in self._held:
            self._spawn(self.release(outcome.id))  # moved into Redis first: give it back there

    def _hold(self, lease_id: str, demand: Demand, grant: Granted, confirmed_at: float) -> Lease:
        lease = Lease(id=lease_id, demand=demand, granted_at=grant.granted_at, queued_s=grant.queued_s)
        self._held[lease_id] = Held(lease, safe_until=self._safe_until(confirmed_at))
        return lease

    def _granted_after(self, enqueued_at: float) -> float:
        # A queued ticket's lease expires at min(grant + TTL, our last liveness beat + TTL).
        return min(enqueued_at, self._last_beat_sent)

    def _safe_until(self, confirmed_at: float) -> float:
        """Lease expiry in Redis is >= confirmed_at + TTL; keep a margin for clock rates."""
        if self._clock is not None:
            return 0.0  # a test-driven store clock says nothing about real time: never assume
        return confirmed_at + 0.9 * self._layout.policy.lease_ttl_s - 0.05

    async def _raise_invalid(self, demand: Demand, reply: Invalid) -> NoReturn:
        """Turn a script's validation reply into the exact error the memory store would raise."""
        with contextlib.suppress(Down):
            await self._reload_layout()
        policy.check_demand(self._layout, demand)  # raises with the full message when it agrees
        kind, name = reply.kind, reply.name
        if kind == "never":
            limit = reply.limit or 0
            cost = demand.held_in(name)
            raise NeverFits(
                f"request costs {cost} tokens but pool {name} grants at most {limit}; it can never be admitted",
                pool=name,
                cost=cost,
                limit=limit,
            )
        raise UnknownTenantOrTier(f"unknown {kind} {name!r}")

    # ---- release / heartbeat / reap ----

    async def release(self, lease_id: str, actual_decode: int | None = None) -> bool:
        if self._fallback is not None and self._fallback.holds(lease_id):
            await self._fallback.release(lease_id, actual_decode)
            return True
        held = self._held.pop(lease_id, None)
        if held is None and lease_id in self._releasing:
            return False  # a write-behind release of it is on its way
        if self._failover.down:
            if held is None:
                return False
            self._failover.defer_release(lease_id, actual_decode)
            return True
        if held is not None and asyncio.get_running_loop().time() < held.safe_until:
            # Write-behind: the lease cannot have been reaped, so the answer is True whatever
            # Redis says; the release goes out with the next batch (one loop turn) instead of
            # costing the caller a round trip. Later calls of this replica queue behind it.
            fut = self._transport.submit("release", [lease_id, usage_arg(actual_decode)])
            self._releasing[lease_id] = fut
            fut.add_done_callback(functools.partial(self._released, lease_id, actual_decode))
            return True
        try:
            done = replies.release(
                await self._transport.submit("release", [lease_id, usage_arg(actual_decode)])
            )
        except Down:
            if held is None:
                return False
            self._failover.defer_release(lease_id, actual_decode)
            return True
        # Held here but unknown to Redis (lost in a restart before re-registration): released.
        # A reaped lease is gone for good, as in the memory store.
        return done is Release.LIVE or (done is Release.UNKNOWN and held is not None)

    def _released(self, lease_id: str, actual_decode: int | None, fut: asyncio.Future[Any]) -> None:
        self._releasing.pop(lease_id, None)
        err = None if fut.cancelled() else fut.exception()
        if fut.cancelled() or isinstance(err, Down):
            self._failover.defer_release(lease_id, actual_decode)  # applied by the recovery
        elif err is not None:
            _log.error("write-behind release of %s failed", lease_id, exc_info=err)

    async def extend(self, lease_id: str, tokens: int) -> int | None:
        if self._fallback is not None and self._fallback.holds(lease_id):
            return await self._fallback.extend(lease_id, tokens)
        held = self._held.get(lease_id)
        if held is None or lease_id in self._releasing or self._failover.down:
            return None  # not live here, or Redis cannot be told: the caller counts an overdraft
        try:
            over = replies.extend(await self._transport.eval("extend", [lease_id, str(int(tokens))]))
        except Down:
            return None
        if over is not None:
            # A re-registration after a restart must carry the grown cost.
            demand = held.lease.demand
            held.lease = replace(held.lease, demand=replace(demand, decode=demand.decode + int(tokens)))
        return over

    async def heartbeat(self, lease_ids: Sequence[str]) -> None:
        remote = lease_ids
        if self._fallback is not None:
            fallback = self._fallback
            remote = [i for i in lease_ids if not fallback.holds(i)]
            if len(remote) != len(lease_ids):
                await fallback.heartbeat([i for i in lease_ids if fallback.holds(i)])
        if not remote or self._failover.down:
            return
        try:
            await self._heartbeat(remote)
        except Down:
            pass

    async def _heartbeat(self, ids: Sequence[str], *, internal: bool = False) -> None:
        sent = asyncio.get_running_loop().time()
        unknown = await self._heartbeat_call(ids, internal=internal)
        lost = [i for i in unknown if i in self._held]
        if lost:
            await self._restore([self._held[i].lease for i in lost], internal=internal)
        safe = self._safe_until(sent)
        for lease_id in ids:
            held = self._held.get(lease_id)
            if held is not None and safe > held.safe_until:
                held.safe_until = safe

    async def _heartbeat_call(self, ids: Sequence[str], *, internal: bool = False) -> list[str]:
        """The heartbeat script (it needs the layout: if Redis lost it, recover first and retry once);
        returns the ids Redis does not know."""
        unknown = replies.heartbeat(await self._transport.eval("heartbeat", ids, internal=internal))
        if unknown is Outcome.NO_LAYOUT:
            if internal:  # the recovery itself: it fails, and the next one starts over
                self._failover.mark_down(RuntimeError("redis lost the budget layout (restarted?)"))
                raise Down("redis lost its data and recovery failed")
            await self._failover.recover_from("redis lost the budget layout (restarted?)")
            unknown = replies.heartbeat(await self._transport.eval("heartbeat", ids))
            if unknown is Outcome.NO_LAYOUT:
                raise Down("redis lost the budget layout again")
        return unknown

    async def _reregister(self) -> None:
        """Every Redis lease this replica holds, heartbeated; the ones Redis lost restored (recovery)."""
        remote = list(self._held)
        for start in range(0, len(remote), 500):
            await self._heartbeat(remote[start : start + 500], internal=True)

    async def _restore_internal(self, leases: Sequence[Lease]) -> None:
        await self._restore(leases, internal=True)

    async def _restore(self, leases: Sequence[Lease], *, internal: bool = False) -> int:
        args: list[str] = []
        for lease in leases:
            args += [lease.id, *pack_demand(lease.demand), repr(lease.queued_s)]
        n = replies.restore(await self._transport.eval("restore", args, internal=internal))
        if n > 0:
            self.restored_leases += n
            _log.warning("re-registered %d in-flight leases unknown to redis", n)
        return n

    async def reap_expired(self) -> int:
        n = 0
        if self._fallback is not None:
            n += await self._fallback.reap_expired()
        if self._failover.down:
            return n
        try:
            while True:
                reaped = replies.reap(await self._transport.eval("reap", [str(_REAP_BATCH)]))
                n += reaped.leases
                if not reaped.more:
                    return n
        except Down:
            return n

    # ---- snapshot ----

    async def snapshot(self) -> StoreSnapshot:
        if self._releasing:
            # Read your own writes: write-behind releases land before the snapshot is taken.
            await asyncio.wait(list(self._releasing.values()), timeout=self._opts.call_timeout_s)
        if self._failover.down:
            return await self._local_snapshot()
        try:
            return await read_snapshot(self._transport, self._keys, self._layout)
        except Down:
            return await self._local_snapshot()

    async def _local_snapshot(self) -> StoreSnapshot:
        """While Redis is down: the fallback's, or this replica's own view (its leases)."""
        if self._fallback is not None:
            return await self._fallback.snapshot()
        return held_snapshot(self._held, self._layout)

    # ---- background work ----

    def _spawn(self, coro: Coroutine[Any, Any, Any]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _maintain(self) -> None:
        """Liveness, reaping, layout polling, and recovery after an outage."""
        while not self._closed:
            if self._failover.down:
                await asyncio.sleep(self._opts.probe_s)
                await self._failover.recover()
                continue
            await asyncio.sleep(self._opts.maintenance_s(self._layout.policy.lease_ttl_s))
            try:
                sent = asyncio.get_running_loop().time()
                await self.reap_expired()  # the reap script also refreshes this replica's liveness
                if not self._failover.down:
                    self._last_beat_sent = sent
                    await self._reload_layout()
            except Down:
                pass
            except Exception:
                # A dead maintenance loop would leak every abandoned lease: log and keep going.
                _log.exception("redis store maintenance failed")

    async def _listen(self) -> None:
        """Grants and failures for this replica's tickets, and layout announcements."""
        wake = self._keys.wake_channel(self._replica)
        # redis-py's get_message(timeout=...) can swallow a task cancellation (the read returns
        # None instead), so the loops also stop on the closed flag; the short read timeout bounds
        # how long close() waits for that.
        while not self._closed:
            pubsub = self._transport.client.pubsub()
            try:
                await pubsub.subscribe(wake, self._keys.layout_channel)
                while not self._closed:
                    msg = await pubsub.get_message(ignore_subscribe_messages=True, timeout=0.2)
                    if msg is None:
                        continue
                    if msg["channel"] == wake:
                        self._on_wake(msg["data"])
                    else:
                        with contextlib.suppress(Down):
                            await self._reload_layout()
            except Exception as err:
                # Polling covers the gap; reconnect after a pause.
                _log.debug("pubsub connection lost: %s", err)
                await asyncio.sleep(self._opts.poll_interval_s)
            finally:
                with contextlib.suppress(Exception):
                    await pubsub.aclose()

    def _on_wake(self, data: str) -> None:
        seq, lease_id, outcome = replies.wake_up(data)
        waiter = self._waiters.get(seq)
        if lease_id is None:
            # From an older version's script (a rolling upgrade): it names the ticket by seq only,
            # so it is handed only to a waiter registered right now (published and read in the same
            # Redis incarnation), never kept for later; a waiter it misses finds its grant by polling.
            if waiter is not None and not waiter.future.done():
                waiter.future.set_result(outcome)
            return
        if waiter is None or waiter.lease_id != lease_id:
            # The grant can overtake its own ticket: a release's reply (or another replica's
            # message) is handled as it is read, while the acquire that queued the ticket has
            # its reply but has not resumed to register yet. Kept for it, not dropped (it would
            # otherwise wait for its next poll). Bounded: a wake-up whose waiter never comes (it
            # was cancelled meanwhile and withdraws by itself) is dropped once it is the oldest.
            # Kept under seq *and* lease id: a stale wake-up (its waiter took the grant from a
            # poll first) must not grant a ticket that reuses the seq after Redis restarted empty.
            early = self._early
            early[seq, lease_id] = outcome
            if len(early) > EARLY_WAKES:
                del early[next(iter(early))]
        elif not waiter.future.done():
            waiter.future.set_result(outcome)

    def _unregister(self, waiter: _Waiter) -> None:
        # Only its own entry: after Redis restarted empty, a newer ticket may reuse the seq.
        if self._waiters.get(waiter.seq) is waiter:
            del self._waiters[waiter.seq]

    def _register(self, waiter: _Waiter) -> None:
        self._waiters[waiter.seq] = waiter
        outcome = self._early.pop((waiter.seq, waiter.lease_id), None)
        if outcome is not None and not waiter.future.done():
            waiter.future.set_result(outcome)


def _check_shape(demand: Demand) -> None:
    # The parts of policy.check_demand that need no layout, raised as the memory store does.
    if demand.prefill < 0 or demand.decode < 0 or demand.decode_limit < 0:
        raise ValueError(f"negative token counts in {demand!r}")
    if len(set(demand.pools)) != len(demand.pools):
        raise ValueError(f"duplicate pools in {demand.pools!r}")

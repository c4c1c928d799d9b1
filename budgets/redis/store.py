"""The cluster-wide BudgetStore: pools, the one wait queue and leases live in Redis.

Every decision (validation, fast-path grant, enqueue, the grant pass, release, reap) runs inside
one Lua script call (budgets/redis/lua, a port of budgets/policy.py), so replicas never race each other
and the Redis store decides exactly what the memory store would. Time is Redis server TIME.

Around the scripts this module adds what a shared, remote store needs:

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
- **Failure modes.** Redis calls are bounded by the configured timeouts. On failure the store is
  *down* until a background probe succeeds. ``fail_mode: closed`` raises StoreUnavailable at once
  (the gateway answers 503); ``fail_mode: open`` admits against an embedded MemoryStore (the
  *fallback*) whose capacities are the layout's divided by ``replicas``. The fallback cannot see
  what Redis admitted before the outage, so while Redis is down for all R replicas a pool of
  capacity C runs at most (pre-outage requests still running, <= C) + R * floor(C/R) tokens:
  2 * C at worst, C once the pre-outage requests have ended (docs/redis.md has the partition case).
- **Recovery** (probe succeeded, NOLAYOUT, or Redis's incarnation token ``T:epoch`` changed), in
  this order: the fallback stops granting; the layout is re-applied; this replica's in-flight
  leases (Redis's and the fallback's) are registered in Redis before any pending release or
  withdrawal can make Redis grant; if Redis lost its data, new grants are held back until
  ``replicas`` replicas have re-registered theirs (``T:rejoin``) or ``settle_s`` has passed; then
  the store is up, and the fallback's waiting tickets are queued in Redis oldest first, each with
  what is left of its wait. From then on every running request is counted in Redis, which grants
  nothing on a full pool.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import logging
import secrets
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal, NoReturn

from redis.asyncio import BlockingConnectionPool, Redis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from budgets import policy
from budgets.memory import MemoryStore
from budgets.redis import replies
from budgets.redis.batch import FastSend, ScriptBatcher, SendAgain
from budgets.redis.keys import KeyLayout, layout_args, layout_from_json, pack_demand
from budgets.redis.replies import Granted, Invalid, Outcome, Queued, QueueIsFull, Release, Withdrawn
from budgets.redis.resp import NoScriptError, RespConnection, address_from_url
from budgets.redis.scripts import ScriptRunner
from budgets.types import (
    BudgetLayout,
    Demand,
    Lease,
    NeverFits,
    PoolState,
    QueueFull,
    QueueTimeout,
    StoreSnapshot,
    StoreUnavailable,
    UnknownTenantOrTier,
)

_log = logging.getLogger(__name__)

FailMode = Literal["closed", "open"]
_REAP_BATCH = 1000


@dataclass(frozen=True, slots=True)
class RedisOptions:
    url: str = "redis://127.0.0.1:6379/0"
    key_prefix: str = "tokengate"
    connect_timeout_s: float = 0.5
    op_timeout_s: float = 0.5
    fail_mode: FailMode = "closed"
    # Gateway replicas sharing the domain: fail-open gives each 1/replicas of every pool.
    replicas: int = 1
    poll_interval_s: float = 0.25
    # How often a down store probes Redis (defaults to poll_interval_s).
    probe_interval_s: float | None = None
    max_connections: int = 32
    # Reap / liveness / layout-poll period; default min(poll_interval_s, lease TTL / 4).
    maintenance_interval_s: float | None = None
    # After Redis lost its data, the longest a recovered replica holds new grants back while the
    # other replicas re-register what they run (it ends as soon as ``replicas`` replicas have).
    # Default: twice what one replica needs to notice and recover (see RedisStore.settle_s).
    settle_s: float | None = None


class _Down(Exception):
    """Redis is unreachable (internal: mapped to StoreUnavailable or the fail-open path)."""


class _Moved(Exception):
    """Raised in a fallback waiter's acquire: the recovery moved its ticket into Redis.

    ``call`` is the acquire script call already submitted for it (under a new ``lease_id``), in
    the order the fallback received the tickets.
    """

    def __init__(self, lease_id: str, call: asyncio.Future[Any]) -> None:
        super().__init__(lease_id)
        self.lease_id = lease_id
        self.call = call


@dataclass(slots=True)
class _Held:
    """A lease this replica holds; ``local`` when granted by the fail-open fallback store.

    ``safe_until`` (event-loop time): until then Redis provably still has the lease (its expiry
    was set at or after a moment we know, plus the TTL), so it cannot have been reaped and a
    release may be acknowledged before Redis applies it.
    """

    lease: Lease
    local: bool = False
    safe_until: float = 0.0


@dataclass(slots=True)
class _Waiter:
    seq: int
    lease_id: str
    demand: Demand
    future: asyncio.Future[replies.WakeUp] = field(
        default_factory=lambda: asyncio.get_running_loop().create_future()
    )


def scaled_layout(layout: BudgetLayout, replicas: int) -> BudgetLayout:
    """Each replica's conservative share of every pool, for fail-open admission."""
    n = max(1, replicas)
    pools = {name: replace(p, capacity=p.capacity // n) for name, p in layout.pools.items()}
    return replace(layout, pools=pools)


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
        # Tests drive decisions with their own clock (passed to every script); production uses
        # Redis server TIME so replicas never disagree about ages and expiries.
        self._clock = clock
        self._replica = replica_id or secrets.token_hex(6)
        self._ids = itertools.count(1)
        self._client = client or Redis(connection_pool=self._pool())
        # Script calls (the request path) go over one lean pipelined connection (budgets/redis/resp.py);
        # redis-py keeps pub/sub, the snapshot and layout reads. TLS URLs and an injected client
        # send scripts through redis-py too.
        address = address_from_url(self._opts.url) if client is None else None
        self._resp = (
            RespConnection(
                address, connect_timeout_s=self._opts.connect_timeout_s, op_timeout_s=self._opts.op_timeout_s
            )
            if address is not None
            else None
        )
        self._scripts = ScriptRunner()
        self._batcher = ScriptBatcher(
            self._eval_batch,
            max_in_flight=max(1, self._opts.max_connections // 2),
            fast=FastSend(self._batch_start, self._batch_finish) if self._resp is not None else None,
        )
        self._held: dict[str, _Held] = {}
        self._waiters: dict[int, _Waiter] = {}
        self._pending_release: dict[str, int | None] = {}
        self._pending_withdraw: dict[int, str] = {}
        self._listeners: list[Callable[[BudgetLayout], None]] = []
        self._releasing: dict[str, asyncio.Future[Any]] = {}  # write-behind releases on their way
        self._last_beat_sent = 0.0  # loop time of the last liveness refresh sent (see _granted_after)
        self._fallback: MemoryStore | None = None
        if self._opts.fail_mode == "open":
            scaled = scaled_layout(layout, self._opts.replicas)
            self._fallback = MemoryStore(scaled, clock or time.monotonic, on_unclaimed=self._unclaimed)
        self._epoch: str | None = None  # Redis's incarnation token as last seen (see _sync_epoch)
        # While not None: acquire calls held back until the replicas have re-registered their
        # leases after Redis lost its data, in arrival order (see _hold_back).
        self._gate: list[tuple[list[str], asyncio.Future[Any]]] | None = None
        self._down = False
        self._recovering = asyncio.Lock()
        self._layout_ver = 0
        self._tasks: list[asyncio.Task[None]] = []
        self._background: set[asyncio.Task[Any]] = set()
        self._started = False
        self._closed = False
        self.restored_leases = 0  # leases re-registered after Redis forgot them (observability)

    # ---- properties for the gateway and tests ----

    def _pool(self) -> BlockingConnectionPool:
        # Blocking: under a burst, callers queue for one of max_connections instead of failing
        # ("too many connections" is not an outage). The wait is bounded by the per-call timeout.
        return BlockingConnectionPool.from_url(
            self._opts.url,
            max_connections=self._opts.max_connections,
            timeout=None,
            socket_connect_timeout=self._opts.connect_timeout_s,
            # No socket_timeout: with one set, redis-py sends through asyncio.wait_for, which on
            # Python 3.11 swallows a task cancellation that races the send, so a cancelled
            # waiter would carry on and leak its grant. Every call is bounded by _call instead.
            socket_timeout=None,
            # One immediate retry on a broken connection (a restarted Redis leaves every pooled
            # connection dead); none on timeouts, which would double the configured bound.
            retry=Retry(NoBackoff(), 1, supported_errors=(RedisConnectionError,)),
            retry_on_error=[RedisConnectionError],  # without it redis-py re-raises instead of retrying
            decode_responses=True,
        )

    @property
    def replica_id(self) -> str:
        return self._replica

    @property
    def degraded(self) -> bool:
        """Redis is unreachable right now (requests fail fast or use the local fallback)."""
        return self._down

    @property
    def settling(self) -> bool:
        """Redis lost its data and new grants wait until the other replicas re-registered theirs."""
        return self._gate is not None

    @property
    def held_back(self) -> int:
        """Acquire calls waiting for the settle to end."""
        return len(self._gate) if self._gate is not None else 0

    @property
    def settle_s(self) -> float:
        """The longest grants are held back after Redis lost its data.

        Every other live replica notices within one probe or maintenance period and recovers
        within its call timeouts; twice that leaves room for a slow one.
        """
        if self._opts.settle_s is not None:
            return self._opts.settle_s
        probe = self._opts.probe_interval_s or self._opts.poll_interval_s
        return 2 * (probe + self._maintenance_period() + self._call_timeout_s)

    def _maintenance_period(self) -> float:
        ttl = self._layout.policy.lease_ttl_s
        return self._opts.maintenance_interval_s or min(self._opts.poll_interval_s, max(0.05, ttl / 4))

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
            await self._sync_epoch()
            sent = asyncio.get_running_loop().time()
            await self._eval("reap", [str(_REAP_BATCH)])  # also announces this replica as alive
            self._last_beat_sent = sent
        except _Down:
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
        self._fail_gate(StoreUnavailable("shutting down"))
        waiters, self._waiters = self._waiters, {}
        for w in waiters.values():
            if not self._down:
                with contextlib.suppress(_Down):
                    await self._eval("withdraw", [str(w.seq), w.lease_id, "1"])
            if not w.future.done():
                w.future.set_exception(StoreUnavailable("shutting down"))
        if self._background:
            await asyncio.wait(list(self._background), timeout=self._opts.op_timeout_s)
        await self._batcher.drain(self._opts.op_timeout_s)
        if self._fallback is not None:
            await self._fallback.close()
        if self._resp is not None:
            await self._resp.close()
        with contextlib.suppress(Exception):
            await self._client.aclose()

    async def healthy(self) -> bool:
        """Ready to admit: started and Redis reachable, or degraded to the fail-open budget."""
        if not self._started or self._closed:
            return False
        return not self._down or self._fallback is not None

    # ---- layout ----

    async def apply_layout(self, layout: BudgetLayout) -> None:
        self._set_layout(layout)
        try:
            await self._apply(layout)
        except _Down:
            # Kept locally; the recovery writes it to Redis before anything else.
            _log.warning("budget store unreachable: layout change is applied when redis is back")

    async def _apply(self, layout: BudgetLayout, *, internal: bool = False) -> None:
        reply = await self._eval("apply_layout", layout_args(layout), internal=internal)
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
            fallback = self._fallback

            async def apply() -> None:
                await fallback.apply_layout(scaled_layout(layout, self._opts.replicas))

            self._spawn(apply())

    async def _reload_layout(self) -> None:
        """Adopt the layout another replica wrote (announced on the channel or seen by polling).

        Also notices that Redis lost its data (restart, flush, failover to an empty replica)
        without any call of this replica failing: its leases must then be registered again (a
        recovery) before it grants anything more.
        """
        async with self._client.pipeline(transaction=False) as pipe:
            pipe.hget(self._keys.layout, "ver")
            pipe.get(self._keys.epoch)
            ver, epoch = await self._call(pipe.execute())
        if epoch != self._epoch:
            self._mark_down(RuntimeError("redis lost its data (restarted?)"))
            if not await self._recover():
                raise _Down("redis lost its data and recovery failed")
            return
        if ver is None or int(ver) == self._layout_ver:
            return
        ver, text = await self._call(self._client.hmget(self._keys.layout, ["ver", "json"]))  # type: ignore[misc]
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
                if self._down:
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
            except _Down:
                # Marked down where it was raised: the next turn goes to the fallback (or to
                # Redis again, if a recovery has already run meanwhile).
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
            self._mark_down(RuntimeError("redis lost the budget layout (restarted?)"))
            if not await self._recover():
                raise _Down("redis lost its data and recovery failed")
            reply = await self._acquire_call(lease_id, [lease_id, *pack_demand(demand)])
            if reply is Outcome.NO_LAYOUT:
                self._mark_down(RuntimeError("redis lost the budget layout again"))
                raise _Down("redis lost the budget layout again")
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
        self._waiters[seq] = waiter
        try:
            while True:
                remaining = deadline - loop.time()
                if remaining <= 0:
                    break
                await asyncio.wait((waiter.future,), timeout=min(self._opts.poll_interval_s, remaining))
                outcome = (
                    waiter.future.result()
                    if waiter.future.done()
                    else replies.status(await self._eval("status", [str(seq), lease_id]))
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
                    if await self._redis_restarted():
                        # Nothing failed here yet: register this replica's leases before queueing.
                        self._mark_down(RuntimeError("redis lost its data (restarted?)"))
                        if not await self._recover():
                            raise _Down("redis lost its data and recovery failed")
                    again = await self._enqueue(lease_id, demand)
                    if isinstance(again, Granted):
                        return self._hold(lease_id, demand, again, started)
                    self._waiters.pop(seq, None)
                    seq = waiter.seq = again.seq
                    self._waiters[seq] = waiter
            left = replies.withdraw(await self._eval("withdraw", [str(seq), lease_id, "0"]))
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
        except _Down:
            self._pending_withdraw[seq] = lease_id
            raise
        finally:
            self._waiters.pop(seq, None)

    async def _acquire_call(self, lease_id: str, args: list[str]) -> replies.AcquireReply:
        """The acquire script, batched with concurrent calls, safe against cancellation.

        The future is shielded: if the caller is cancelled mid-call, the script still runs (it
        may already have), and its grant or ticket is given back before the cancellation
        propagates, instead of being left to expire.
        """
        if self._down:
            raise _Down("redis is down")
        return await self._await_acquire(self._submit_acquire(args), lease_id)

    async def _await_acquire(self, fut: asyncio.Future[Any], lease_id: str) -> replies.AcquireReply:
        try:
            reply = await asyncio.shield(fut)
        except asyncio.CancelledError:
            await self._finish_cleanup(self._abandon_enqueued(fut, lease_id))
            raise
        return replies.acquire(reply)

    def _submit_acquire(self, args: list[str]) -> asyncio.Future[Any]:
        """Send an acquire script call with the next batch, or hold it back while settling."""
        if self._gate is None:
            return self._batcher.submit("acquire", args)
        fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._gate.append((args, fut))
        return fut

    async def _abandon_enqueued(self, call: asyncio.Future[Any], lease_id: str) -> None:
        if self._ungate(call):
            return  # never sent
        try:
            reply = replies.acquire(await call)
        except (Exception, asyncio.CancelledError):
            return  # Redis down or shutting down: nothing was granted or queued that we know of
        if isinstance(reply, Granted):
            await self.release(lease_id, 0)  # never reached its caller: nothing was served
        elif isinstance(reply, Queued):
            await self._withdraw_quietly(reply.seq, lease_id)

    async def _finish_cleanup(self, coro: Any) -> None:
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
            await self._eval("withdraw", [str(seq), lease_id, "1"])
        except _Down:
            self._pending_withdraw[seq] = lease_id

    async def _degraded_acquire(self, demand: Demand, max_wait_s: float) -> Lease | _Moved:
        """Admit against the fallback; a ticket still waiting when Redis is back comes out _Moved."""
        if self._fallback is None:
            raise StoreUnavailable(
                "budget store (redis) is unreachable and store.fail_mode is closed", retry_after_s=1.0
            )
        try:
            lease = await self._fallback.acquire(demand, max(0.0, max_wait_s))
        except _Moved as moved:
            return moved
        # A grant whose waiter resumes only after the recovery moved it into Redis is already
        # held as a Redis lease.
        if lease.id not in self._held:
            self._held[lease.id] = _Held(lease, local=True)
        return lease

    def _unclaimed(self, outcome: Lease | BaseException) -> None:
        """The fallback decided for a waiter that was cancelled before it took the outcome."""
        if isinstance(outcome, _Moved):
            self._spawn(self._abandon_enqueued(outcome.call, outcome.lease_id))
        elif isinstance(outcome, Lease):
            held = self._held.get(outcome.id)
            if held is not None and not held.local:
                self._spawn(self.release(outcome.id))  # moved into Redis first: give it back there
            elif held is not None:
                del self._held[outcome.id]

    def _hold(self, lease_id: str, demand: Demand, grant: Granted, confirmed_at: float) -> Lease:
        lease = Lease(id=lease_id, demand=demand, granted_at=grant.granted_at, queued_s=grant.queued_s)
        self._held[lease_id] = _Held(lease, safe_until=self._safe_until(confirmed_at))
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
        with contextlib.suppress(_Down):
            await self._reload_layout()
        policy.check_demand(self._layout, demand)  # raises with the full message when it agrees
        kind, name = reply.kind, reply.name
        if kind == "never":
            limit = reply.limit or 0
            raise NeverFits(
                f"request costs {demand.cost} tokens but pool {name} grants at most {limit}; "
                "it can never be admitted",
                pool=name,
                cost=demand.cost,
                limit=limit,
            )
        raise UnknownTenantOrTier(f"unknown {kind} {name!r}")

    # ---- release / heartbeat / reap ----

    async def release(self, lease_id: str, actual_decode: int | None = None) -> bool:
        held = self._held.pop(lease_id, None)
        if held is None and lease_id in self._releasing:
            return False  # a write-behind release of it is on its way
        if held is not None and held.local:
            assert self._fallback is not None
            await self._fallback.release(lease_id, actual_decode)
            return True
        if self._down:
            if held is None:
                return False
            self._pending_release[lease_id] = actual_decode
            return True
        if held is not None and asyncio.get_running_loop().time() < held.safe_until:
            # Write-behind: the lease cannot have been reaped, so the answer is True whatever
            # Redis says; the release goes out with the next batch (one loop turn) instead of
            # costing the caller a round trip. Later calls of this replica queue behind it.
            fut = self._batcher.submit("release", [lease_id, _opt(actual_decode)])
            self._releasing[lease_id] = fut
            fut.add_done_callback(functools.partial(self._released, lease_id, actual_decode))
            return True
        try:
            done = replies.release(await self._batcher.submit("release", [lease_id, _opt(actual_decode)]))
        except _Down:
            if held is None:
                return False
            self._pending_release[lease_id] = actual_decode
            return True
        # Held here but unknown to Redis (lost in a restart before re-registration): released.
        # A reaped lease is gone for good, as in the memory store.
        return done is Release.LIVE or (done is Release.UNKNOWN and held is not None)

    def _released(self, lease_id: str, actual_decode: int | None, fut: asyncio.Future[Any]) -> None:
        self._releasing.pop(lease_id, None)
        err = None if fut.cancelled() else fut.exception()
        if fut.cancelled() or isinstance(err, _Down):
            self._pending_release[lease_id] = actual_decode  # applied by the recovery
        elif err is not None:
            _log.error("write-behind release of %s failed", lease_id, exc_info=err)

    async def heartbeat(self, lease_ids: Sequence[str]) -> None:
        remote = [i for i in lease_ids if not ((h := self._held.get(i)) is not None and h.local)]
        if self._fallback is not None and len(remote) != len(lease_ids):
            await self._fallback.heartbeat([i for i in lease_ids if i not in remote])
        if not remote or self._down:
            return
        try:
            await self._heartbeat(remote)
        except _Down:
            pass

    async def _heartbeat(self, ids: Sequence[str], *, internal: bool = False) -> None:
        sent = asyncio.get_running_loop().time()
        unknown = await self._heartbeat_call(ids, internal=internal)
        lost = [i for i in unknown if (h := self._held.get(i)) is not None and not h.local]
        if lost:
            await self._restore([self._held[i].lease for i in lost], internal=internal)
        safe = self._safe_until(sent)
        for lease_id in ids:
            held = self._held.get(lease_id)
            if held is not None and not held.local and safe > held.safe_until:
                held.safe_until = safe

    async def _restore(self, leases: Sequence[Lease], *, internal: bool = False) -> int:
        args: list[str] = []
        for lease in leases:
            args += [lease.id, *pack_demand(lease.demand), repr(lease.queued_s)]
        n = replies.restore(await self._eval("restore", args, internal=internal))
        if n > 0:
            self.restored_leases += n
            _log.warning("re-registered %d in-flight leases unknown to redis", n)
        return n

    async def reap_expired(self) -> int:
        n = 0
        if self._fallback is not None:
            n += await self._fallback.reap_expired()
        if self._down:
            return n
        try:
            while True:
                reaped = replies.reap(await self._eval("reap", [str(_REAP_BATCH)]))
                n += reaped.leases
                if not reaped.more:
                    return n
        except _Down:
            return n

    # ---- snapshot ----

    async def snapshot(self) -> StoreSnapshot:
        if self._releasing:
            # Read your own writes: write-behind releases land before the snapshot is taken.
            await asyncio.wait(list(self._releasing.values()), timeout=self._call_timeout_s)
        if self._down:
            return await self._local_snapshot()
        t = self._keys.tag
        try:
            async with self._client.pipeline(transaction=True) as pipe:
                for name in ("spec", "used", "tierq", "twait", "vtc"):
                    pipe.hgetall(f"{t}:{name}")
                pipe.hlen(f"{t}:leases")
                spec, used, tierq, twait, vtc, leases = await self._call(pipe.execute())
        except _Down:
            return await self._local_snapshot()
        specs = {k[2:]: v for k, v in spec.items() if k.startswith("p:")}
        tiers = [k[2:] for k in spec if k.startswith("t:")]
        tenants = [k[2:] for k in spec if k.startswith("n:")]
        if not spec:  # Redis lost the layout: report this replica's view of it
            specs = {n: f"{p.capacity}|{int(p.shared)}" for n, p in self._layout.pools.items()}
            tiers, tenants = list(self._layout.tiers), list(self._layout.tenants)
        pools: dict[str, PoolState] = {}
        for name, spec in specs.items():
            cap, shared = spec.split("|")
            pools[name] = PoolState(name, int(cap), int(used.get(name, 0)), shared == "1")
        for name, n in used.items():
            if name not in pools:
                pools[name] = PoolState(name, 0, int(n), True)
        queue_depth = dict.fromkeys(tiers, 0)
        queue_depth.update({k: int(v) for k, v in tierq.items()})
        tenant_depth = dict.fromkeys(tenants, 0)
        tenant_depth.update({k: int(v) for k, v in twait.items()})
        return StoreSnapshot(
            pools=pools,
            queue_depth=queue_depth,
            tenant_queue_depth=tenant_depth,
            virtual_service={k: float(v) for k, v in vtc.items()},
            leases=int(leases),
        )

    async def _local_snapshot(self) -> StoreSnapshot:
        """While Redis is down: this replica's own view (its leases, full capacities), never an error."""
        if self._fallback is not None:
            return await self._fallback.snapshot()
        layout = self._layout
        used: dict[str, int] = {}
        for held in self._held.values():
            for name in held.lease.demand.pools:
                used[name] = used.get(name, 0) + held.lease.demand.cost
        pools = {n: PoolState(n, p.capacity, used.get(n, 0), p.shared) for n, p in layout.pools.items()}
        return StoreSnapshot(
            pools=pools,
            queue_depth=dict.fromkeys(layout.tiers, 0),
            tenant_queue_depth=dict.fromkeys(layout.tenants, 0),
            virtual_service={},
            leases=len(self._held),
        )

    # ---- Redis calls and failure handling ----

    def _now_arg(self) -> str:
        return "" if self._clock is None else repr(float(self._clock()))

    @property
    def _call_timeout_s(self) -> float:
        return self._opts.op_timeout_s + self._opts.connect_timeout_s

    async def _call(self, awaitable: Any) -> Any:
        try:
            async with asyncio.timeout(self._call_timeout_s):
                return await awaitable
        except (RedisConnectionError, RedisTimeoutError, OSError, TimeoutError) as err:
            self._mark_down(err)
            raise _Down(str(err)) from err

    async def _eval(self, name: str, args: Sequence[str], *, internal: bool = False) -> Any:
        # While down (or recovering) only the recovery itself talks to Redis: a grant made before
        # the in-flight leases are re-registered could overcommit a pool.
        if self._down and not internal:
            raise _Down("redis is down")
        argv = [self._now_arg(), self._replica, *args]
        if self._resp is not None:
            # Bounded by the connection itself (connect_s to connect, op_s per request; an expiry
            # tears the connection down), without a timeout context per call.
            try:
                reply, mine = await self._scripts.call_resp(self._resp, name, self._keys.layout, argv)
            except (OSError, TimeoutError) as err:
                self._mark_down(err)
                raise _Down(str(err)) from err
        else:
            keys = [self._keys.layout]
            reply, mine = await self._call(self._scripts.call(self._client, name, keys, argv))
        # Wake-ups for this replica's own tickets come back in the reply (not pub/sub): hand them
        # over now, before the caller resumes, exactly as the memory store would.
        for payload in mine:
            self._on_wake(payload)
        return reply

    async def _eval_batch(self, args: list[str]) -> Any:
        return await self._eval("batch", args)

    def _batch_start(self, args: list[str]) -> asyncio.Future[Any] | None:
        """The batch script written at once on the open lean connection (the batcher's fast path)."""
        if self._down or self._resp is None:
            return None  # _eval_batch raises _Down (or the recovery is the one talking to Redis)
        argv = [self._now_arg(), self._replica, *args]
        return self._scripts.send_resp_nowait(self._resp, "batch", self._keys.layout, argv)

    def _batch_finish(self, wire: asyncio.Future[Any]) -> Sequence[Any]:
        """_eval's reply handling for a batch sent by _batch_start."""
        err = wire.exception() if not wire.cancelled() else asyncio.CancelledError()
        if err is None:
            reply, mine = wire.result()
            for payload in mine:
                self._on_wake(payload)
            return reply  # type: ignore[no-any-return]
        if isinstance(err, NoScriptError):
            raise SendAgain("script not loaded") from err  # nothing ran: reload and retry
        if isinstance(err, (OSError, TimeoutError, asyncio.CancelledError)):
            self._mark_down(err)
            raise _Down(str(err)) from err
        raise err

    async def _heartbeat_call(self, ids: Sequence[str], *, internal: bool = False) -> list[str]:
        """The heartbeat script (it needs the layout: if Redis lost it, recover first and retry once);
        returns the ids Redis does not know."""
        unknown = replies.heartbeat(await self._eval("heartbeat", ids, internal=internal))
        if unknown is Outcome.NO_LAYOUT:
            self._mark_down(RuntimeError("redis lost the budget layout (restarted?)"))
            if internal or not await self._recover():
                raise _Down("redis lost its data and recovery failed")
            unknown = replies.heartbeat(await self._eval("heartbeat", ids))
            if unknown is Outcome.NO_LAYOUT:
                raise _Down("redis lost the budget layout again")
        return unknown

    def _mark_down(self, err: BaseException) -> None:
        if not self._down:
            self._down = True
            _log.warning("budget store unreachable (%s); fail_mode=%s", err, self._opts.fail_mode)
        # Held-back calls try again (through the fallback in open mode) instead of waiting for a
        # settle that can no longer be observed.
        self._fail_gate(_Down(str(err)))

    async def _recover(self) -> bool:
        """Bring a down store back: layout, in-flight leases, pending work, waiting tickets.

        True when up again. From the moment Redis answers, the fallback grants nothing more; its
        leases are registered in Redis (with this replica's other in-flight leases) before any
        release or withdrawal can make Redis grant something, and its waiting tickets are queued
        in Redis only after that, oldest first.
        """
        async with self._recovering:
            if not self._down:
                return True
            try:
                async with asyncio.timeout(self._opts.connect_timeout_s + self._opts.op_timeout_s):
                    if self._resp is not None:
                        await self._resp.execute("PING")  # the connection the scripts use
                    await self._client.ping()  # type: ignore[misc]
            except Exception:
                return False
            fallback = self._fallback
            if fallback is not None:
                fallback.pause()
            adopted: list[Lease] = []
            try:
                await self._apply(self._layout, internal=True)
                lost_data = await self._sync_epoch()
                remote = [i for i, h in self._held.items() if not h.local]
                for start in range(0, len(remote), 500):
                    await self._heartbeat(remote[start : start + 500], internal=True)
                adopted = await self._adopt_local()
                settled = not lost_data or await self._join_settle()
                # Until these loops find nothing left, callers may still add to them (releases
                # and withdrawals wait for the recovery while the store is down).
                while self._pending_withdraw or self._pending_release:
                    if self._pending_withdraw:
                        seq, lease_id = next(iter(self._pending_withdraw.items()))
                        await self._eval("withdraw", [str(seq), lease_id, "1"], internal=True)
                        self._pending_withdraw.pop(seq, None)
                    else:
                        lease_id, actual = next(iter(self._pending_release.items()))
                        await self._eval("release", [lease_id, _opt(actual)], internal=True)
                        self._pending_release.pop(lease_id, None)
            except _Down:
                self._unadopt(adopted)
                if fallback is not None:
                    fallback.resume()
                return False
            # From here to the end nothing awaits: no acquire can slip in between.
            self._down = False
            if not settled:
                self._hold_back()
            if fallback is not None:
                for lease in adopted:
                    fallback.forget(lease.id)  # counted in Redis now, and only there
                moved = fallback.hand_over_waiting(self._move)
                fallback.resume()
                if moved:
                    _log.warning("moved %d waiting requests from the local budget into redis", moved)
            _log.warning("budget store reachable again")
            return True

    async def _adopt_local(self) -> list[Lease]:
        """Register the fallback's leases in Redis and hold them as Redis leases from now on.

        The fallback's own table is the truth (a grant whose waiter has not resumed yet is in it,
        not yet in ``_held``); it is paused, so nothing is added while this runs. The fallback
        keeps counting them until the recovery succeeds (``forget``) or fails (``_unadopt``), so
        a failed recovery leaves its local share exactly as full as it was.
        """
        fallback = self._fallback
        if fallback is None:
            return []
        local = fallback.leases()
        live = {lease.id for lease in local}
        for lease_id, entry in list(self._held.items()):
            if entry.local and lease_id not in live:
                del self._held[lease_id]  # reaped by the fallback: nothing runs under it any more
        if not local:
            return []
        await self._restore(local, internal=True)
        still = {lease.id for lease in fallback.leases()}
        for lease in local:
            held = self._held.get(lease.id)
            if held is not None:
                held.local = False
            elif lease.id in still:
                self._held[lease.id] = _Held(lease)  # its waiter resumes later and finds it
            else:
                # Released locally while we were registering it: take it back out of Redis.
                self._pending_release[lease.id] = None
        return local

    def _unadopt(self, adopted: list[Lease]) -> None:
        """A recovery failed after _adopt_local: the fallback's leases are local again."""
        for lease in adopted:
            held = self._held.get(lease.id)
            if held is not None:
                held.local = True
            elif self._fallback is not None:
                self._fallback.forget(lease.id)  # released meanwhile; its Redis release is pending

    def _move(self, demand: Demand) -> _Moved:
        """A fallback ticket into the shared queue (called oldest first, by hand_over_waiting)."""
        lease_id = self._new_lease_id()
        return _Moved(lease_id, self._submit_acquire([lease_id, *pack_demand(demand)]))

    # ---- after Redis lost its data: wait until every replica re-registered its leases ----

    async def _sync_epoch(self) -> bool:
        """Read Redis's incarnation token, creating it if Redis has none; True if it changed.

        A Redis that restarted empty (or was flushed, or failed over to an empty replica) has no
        token, so the first replica back writes a new one and the others see a different one.
        """
        async with self._client.pipeline(transaction=False) as pipe:
            pipe.set(self._keys.epoch, secrets.token_hex(8), nx=True)
            pipe.get(self._keys.epoch)
            _created, epoch = await self._call(pipe.execute())
        changed = epoch != self._epoch
        self._epoch = epoch
        return bool(changed)

    async def _redis_restarted(self) -> bool:
        return await self._call(self._client.get(self._keys.epoch)) != self._epoch  # type: ignore[no-any-return]

    async def _join_settle(self) -> bool:
        """Tell the other replicas this one's leases are registered again; True once all are.

        The first replica back opens the settle (a set that expires after ``settle_s``); each one
        adds itself after registering its leases. Until ``replicas`` replicas are in it, or it
        expires, replicas that saw the data loss hold their new grants back: a grant made while
        another replica's running requests are still unknown to Redis would over-admit.
        """
        key = self._keys.rejoin
        async with self._client.pipeline(transaction=True) as pipe:
            pipe.sadd(key, self._replica)
            pipe.pexpire(key, max(1, int(self.settle_s * 1000)), nx=True)
            pipe.scard(key)
            pipe.pttl(key)
            _added, _expiry, joined, ttl_ms = await self._call(pipe.execute())
        return _settled(int(joined), int(ttl_ms), self._opts.replicas)

    def _hold_back(self) -> None:
        gate: list[tuple[list[str], asyncio.Future[Any]]] = []
        self._gate = gate
        self._spawn(self._watch_settle(gate))
        _log.warning("redis lost its data: new grants wait until every replica re-registered its leases")

    async def _watch_settle(self, gate: list[tuple[list[str], asyncio.Future[Any]]]) -> None:
        key = self._keys.rejoin
        while self._gate is gate and not self._closed:
            await asyncio.sleep(self._opts.poll_interval_s)
            if self._gate is not gate:
                return  # failed (Redis down again) or closed meanwhile
            try:
                async with self._client.pipeline(transaction=False) as pipe:
                    pipe.scard(key)
                    pipe.pttl(key)
                    joined, ttl_ms = await self._call(pipe.execute())
            except _Down:
                return  # _mark_down failed the held-back calls
            if _settled(int(joined), int(ttl_ms), self._opts.replicas):
                self._open_gate()

    def _open_gate(self) -> None:
        """Send the held-back acquire calls, in the order they came."""
        gate, self._gate = self._gate, None
        for args, fut in gate or ():
            if not fut.done():
                self._batcher.submit("acquire", args).add_done_callback(functools.partial(_relay, fut))

    def _fail_gate(self, err: BaseException) -> None:
        gate, self._gate = self._gate, None
        for _args, fut in gate or ():
            if not fut.done():
                fut.set_exception(err)

    def _ungate(self, fut: asyncio.Future[Any]) -> bool:
        """Drop a held-back call whose caller is gone; False if it was sent (or failed) already."""
        gate = self._gate or []
        for i, (_args, held) in enumerate(gate):
            if held is fut:
                del gate[i]
                fut.cancel()
                return True
        return False

    # ---- background work ----

    def _spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _maintain(self) -> None:
        """Liveness, reaping, layout polling, and recovery after an outage."""
        probe = self._opts.probe_interval_s or self._opts.poll_interval_s
        while not self._closed:
            if self._down:
                await asyncio.sleep(probe)
                await self._recover()
                continue
            await asyncio.sleep(self._maintenance_period())
            try:
                sent = asyncio.get_running_loop().time()
                await self.reap_expired()  # the reap script also refreshes this replica's liveness
                if not self._down:
                    self._last_beat_sent = sent
                    await self._reload_layout()
            except _Down:
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
            pubsub = self._client.pubsub()
            try:
                await pubsub.subscribe(wake, self._keys.layout_channel)
                while not self._closed:
                    msg = await pubsub.get_message(ignore_subscribe_messages=True, timeout=0.2)
                    if msg is None:
                        continue
                    if msg["channel"] == wake:
                        self._on_wake(msg["data"])
                    else:
                        with contextlib.suppress(_Down):
                            await self._reload_layout()
            except Exception as err:
                # Polling covers the gap; reconnect after a pause.
                _log.debug("pubsub connection lost: %s", err)
                await asyncio.sleep(self._opts.poll_interval_s)
            finally:
                with contextlib.suppress(Exception):
                    await pubsub.aclose()

    def _on_wake(self, data: str) -> None:
        seq, outcome = replies.wake_up(data)
        waiter = self._waiters.get(seq)
        if waiter is not None and not waiter.future.done():
            waiter.future.set_result(outcome)


def _opt(actual_decode: int | None) -> str:
    # A usage report crosses a trust boundary: only a whole number reaches the script ('' =
    # unknown); release.lua clamps it to the reservation exactly as policy.release does.
    reported = policy.usage_report(actual_decode)
    return "" if reported is None else str(reported)


def _settled(joined: int, ttl_ms: int, replicas: int) -> bool:
    # PTTL is -2 once the settle set expired (or never existed): the window is over.
    return joined >= replicas or ttl_ms < 0


def _relay(outer: asyncio.Future[Any], inner: asyncio.Future[Any]) -> None:
    """Hand a held-back call's reply (or failure) to the future its caller awaits."""
    if outer.done():
        return
    if inner.cancelled():
        outer.set_exception(StoreUnavailable("shutting down"))
    elif (err := inner.exception()) is not None:
        outer.set_exception(err)
    else:
        outer.set_result(inner.result())


def _check_shape(demand: Demand) -> None:
    # The parts of policy.check_demand that need no layout, raised as the memory store does.
    if demand.prefill < 0 or demand.decode < 0:
        raise ValueError(f"negative token counts in {demand!r}")
    if len(set(demand.pools)) != len(demand.pools):
        raise ValueError(f"duplicate pools in {demand.pools!r}")

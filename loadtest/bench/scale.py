"""Admission at SaaS scale: one saturated shared pool, many waiting tenants and tickets, both stores.

Run: ``python -m loadtest.bench.scale`` (starts a private redis-server; ``--url`` uses an existing
one; ``--quick`` for small sizes; ``--help`` for knobs). Results and commands: docs/benchmarks.md.

The shape: one shared backend pool holding ``IN_FLIGHT`` leases of 10 tokens, full; ``tickets``
waiting tickets spread over ``tenants`` tenants (each tenant also has its own budget pool, as
gateway demands do, large enough never to block). A *cycle* releases the oldest lease, which
frees room for exactly one waiting ticket, so every release runs a grant pass that grants one;
the granted tenant then queues a new ticket, so the backlog stays the same size. Measured:

* **memory store**: release->grant cycles per second of the whole store, CPU per cycle, and the
  p50/p99/max time of one grant pass (``policy.grant_pass`` timed in place, in a second window as
  long as the first, so that the timing is not in the cycles' figure). Every waiting ticket
  is a real ``acquire`` task; the pool holds one lease; a granted task releases at once (which
  grants the next ticket) and queues again, so a cycle is one release, one grant, one wake-up and
  one enqueue. Beyond ``--memory-max-tickets`` (a waiting acquire costs a few kB) the same cycle
  runs on the policy alone, without asyncio (``policy`` rows; ``--memory-max-tickets 0`` for all).
  Both also report the collector's share: its collections per generation in the cycles' window,
  their time per cycle and the longest of each generation (``gc.callbacks``);
* **Redis store**: the same cycle as script calls (a release, then the granted tenant's new
  acquire), pipelined ``--window`` cycles at a time from one connection: cycles per second of that
  driver, Redis CPU per cycle (``INFO cpu``, so the capacity of one Redis is 1e6 / that), and the
  p50/p99/max duration of one script call as Redis itself records it (``SLOWLOG`` with a 0 us
  threshold), and each command's calls and microseconds per cycle (``INFO commandstats``; printed
  with ``--commandstats``). Grants reach the driver in the release script's reply (it owns the
  tickets);
* **fast path** (nothing queued): acquire+release per second on the memory store, Redis CPU per
  acquire+release on Redis, with ``tenants`` tenants taking turns;
* **memory**: bytes per idle tenant, per waiting ticket and per live lease, in process
  (``tracemalloc``) and in Redis (``MEMORY USAGE`` of every key of the domain), and what an idle
  tenant costs once ``idle_forget_s`` has forgotten it.

Every point is measured in the steady state: before its window it runs ``--warm-rounds`` rounds of
its backlog unmeasured (default one: every waiting ticket granted once, at most ``--warm-cap``
seconds; each row says how many cycles it warmed, and whether the cap cut that short). Why, and
what a first round costs instead: ``warm_target``. ``--warm-rounds 0`` measures after about a
second of warming (the policy rows: none), as this benchmark did before 2026-12-04.

The process runs as ``tokengate serve`` does: on uvloop (``--loop asyncio`` for asyncio's own
loop) and with the collector thresholds it sets (config ``gc``; ``--gc python`` for Python's own):
a memory-store waiter is a handful of container objects, and how often the collector walks them
all is part of what a cycle costs in the gateway.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import time
import tracemalloc
import uuid
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

from redis.asyncio import Redis

from budgets import policy
from budgets.memory import MemoryStore
from budgets.redis import RedisOptions, RedisStore
from budgets.redis.keys import SEP, pack_demand
from budgets.redis.scripts import Library, ScriptRunner
from budgets.types import BudgetLayout, Demand, PolicySpec, PoolSpec, TenantSpec, TierSpec
from gateway.config.schema import GcConfig
from gateway.process.serve import tune_collector
from loadtest.bench import percentile_ms
from loadtest.redis_server import RedisServer, add_redis_option, config_args, used_cpu_seconds

POOL = "backend:p"
PREFILL, DECODE = 6, 4
COST = PREFILL + DECODE
IN_FLIGHT = 64
TIER = "standard"
OWNER = "bench"  # the replica the Redis driver plays: it owns every ticket and lease
# A virtual clock's first instant (``Driver(clock_step=...)``): later than any real clock, so the
# layout's own calls at Redis' TIME lie before it, and with a Unix time's number of digits.
VIRTUAL_START = 4_000_000_000.123456

DEFAULT_SIZES = "10:100,100:1000,1000:10000,10000:100000,100000:100000,100000:1000000"
QUICK_SIZES = "10:100,1000:10000,10000:100000"


def scale_layout(tenants: int, pool_tokens: int = IN_FLIGHT * COST, **pol: Any) -> BudgetLayout:
    pools = {POOL: PoolSpec(POOL, pool_tokens)}
    pools.update({f"tenant:t{i}": PoolSpec(f"tenant:t{i}", 10**9, shared=False) for i in range(tenants)})
    return BudgetLayout(
        pools=pools,
        tiers={TIER: TierSpec(TIER, 0, 1.0, 3600.0)},
        tenants={f"t{i}": TenantSpec(f"t{i}", 1.0, 10**7) for i in range(tenants)},
        policy=PolicySpec(lease_ttl_s=3600.0, **pol),
    )


def demand(tenant: int) -> Demand:
    return Demand(f"t{tenant}", TIER, (POOL, f"tenant:t{tenant}"), PREFILL, DECODE)


def summary(durations: Sequence[float]) -> dict[str, float]:
    return {
        "p50_ms": percentile_ms(durations, 50),
        "p99_ms": percentile_ms(durations, 99),
        "max_ms": max(durations) * 1e3 if durations else float("nan"),
    }


def warm_target(tickets: int, rounds: float) -> int:
    """Cycles to run before the measured window: ``rounds`` times the backlog. After one round every
    waiting ticket has been granted once, and each tenant's one-time state exists (its lease count,
    its pool's release meter, its slot in each tree and table, grown to size): the steady state of
    an endpoint that stays saturated, which the window then measures. In a first round a cycle also
    pays for that growth (at 100,000 tenants ~35 % more CPU per cycle), and its new objects raise
    the collector's count (a young collection every ~5,000 cycles instead of every ~100,000;
    docs/benchmarks.md, "Tickets or tenants")."""
    return int(tickets * rounds)


def warm_done(warmed: int, target: int, started: float, least_s: float, cap_s: float) -> bool:
    """Whether warming may stop: ``target`` cycles and ``least_s`` seconds run, or ``cap_s`` spent."""
    spent = time.perf_counter() - started
    return spent >= cap_s or (warmed >= target and spent >= least_s)


class PassTimer:
    """``policy.grant_pass`` timed in place (the memory store calls it through the module)."""

    def __init__(self) -> None:
        self.durations: list[float] = []
        self.on = False
        self._real: Callable[..., list[Any]] = policy.grant_pass

    def __enter__(self) -> PassTimer:
        real, durations = self._real, self.durations

        def timed(state: policy.PolicyState, now: float) -> list[Any]:
            if not self.on:
                return real(state, now)
            t0 = time.perf_counter()
            try:
                return real(state, now)
            finally:
                durations.append(time.perf_counter() - t0)

        policy.grant_pass = timed  # type: ignore[assignment]
        return self

    def __exit__(self, *exc: object) -> None:
        policy.grant_pass = self._real  # type: ignore[assignment]


class CollectorTime:
    """Collections per generation and the time they took, while ``on`` (``gc.callbacks``): how much
    of a cycle is the collector walking what waits (a waiting acquire outlives the young
    generations, so each is walked by every generation's collection before it is freed), and the
    longest collection of each generation: a stall every request in flight waits out."""

    def __init__(self) -> None:
        self.collections = [0, 0, 0]
        self.seconds = [0.0, 0.0, 0.0]
        self.longest = [0.0, 0.0, 0.0]
        self.on = False
        self._t0 = 0.0

    def _callback(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
        elif self.on:
            generation = info["generation"]
            took = time.perf_counter() - self._t0
            self.collections[generation] += 1
            self.seconds[generation] += took
            self.longest[generation] = max(self.longest[generation], took)

    def __enter__(self) -> CollectorTime:
        gc.callbacks.append(self._callback)
        return self

    def __exit__(self, *exc: object) -> None:
        gc.callbacks.remove(self._callback)

    def per_cycle(self, cycles: int) -> dict[str, Any]:
        return {
            "us_per_cycle": sum(self.seconds) / max(1, cycles) * 1e6,
            "collections": list(self.collections),
            "ms": [s * 1e3 for s in self.seconds],
            "longest_ms": [s * 1e3 for s in self.longest],
        }


# ---- memory store ----


async def memory_cycles(
    tenants: int, tickets: int, seconds: float, warm_rounds: float = 0.0, warm_cap_s: float = 120.0
) -> dict[str, Any]:
    """``tickets + 1`` acquire tasks on a pool that holds one lease: each, once granted, releases at
    once (the release grants the next ticket) and queues again at the back of its tenant's FIFO.
    Warmed for ``warm_rounds`` rounds of the backlog (``warm_target``), at most ``warm_cap_s``."""
    store = MemoryStore(scale_layout(tenants, pool_tokens=COST), reap_interval_s=3600.0)
    await store.start()
    granted = 0
    running = True

    async def waiter(tenant: int) -> None:
        nonlocal granted
        d = demand(tenant)
        while running:
            lease = await store.acquire(d, 3600.0)
            granted += 1
            await store.release(lease.id, DECODE)  # grants the next ticket; this one queues again

    first = await store.acquire(demand(0), 1.0)  # the pool is full before anyone waits
    tasks = [asyncio.ensure_future(waiter(i % tenants)) for i in range(tickets + 1)]
    try:
        await asyncio.sleep(0)  # all queued
        await store.release(first.id, DECODE)
        target, started = warm_target(tickets, warm_rounds), time.perf_counter()
        while True:  # (polled: the waiters count their grants, nothing signals a count)
            await asyncio.sleep(0.05)
            if warm_done(granted, target, started, min(1.0, seconds / 3), warm_cap_s):
                break
        warmed = granted
        gc.collect()
        # Cycles first, untimed (two clock reads per pass are not the store's work), then as long
        # again with every grant pass timed.
        with CollectorTime() as collector:
            collector.on = True
            n0, cpu0, t0 = granted, time.process_time(), time.perf_counter()
            await asyncio.sleep(seconds)
            n, wall, cpu = granted - n0, time.perf_counter() - t0, time.process_time() - cpu0
            collector.on = False
        with PassTimer() as timer:
            timer.on = True
            await asyncio.sleep(seconds)
            timer.on = False
        waiting = sum((await store.snapshot()).queue_depth.values())
        return {
            "store": "memory",
            "tenants": tenants,
            "tickets": waiting,
            "cycles_per_s": n / wall,
            "cpu_us_per_cycle": cpu / max(1, n) * 1e6,
            "collector": collector.per_cycle(n),
            "grant_pass": summary(timer.durations),
            "warm_cycles": warmed,
            "warm_complete": warmed >= target,
        }
    finally:
        running = False
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await store.close()


def policy_cycles(
    tenants: int, tickets: int, seconds: float, warm_rounds: float = 0.0, warm_cap_s: float = 120.0
) -> dict[str, Any]:
    """The same cycle on budgets.policy alone (no store, no asyncio): what a pass costs the loop.
    Warmed as ``memory_cycles``."""
    state = policy.PolicyState(scale_layout(tenants))
    held: deque[Demand] = deque()
    for i in range(IN_FLIGHT):
        d = demand(i % tenants)
        assert policy.grant_immediately(state, d)
        held.append(d)
    now = time.monotonic()
    for i in range(tickets):
        policy.enqueue(state, demand(i % tenants), now)
    durations: list[float] = []

    def cycle(timed: bool) -> None:
        now = time.monotonic()
        policy.release(state, held.popleft(), DECODE, now)
        p0 = time.perf_counter()
        got = policy.grant_pass(state, now)
        if timed:
            durations.append(time.perf_counter() - p0)
        for ticket in got:
            held.append(ticket.demand)
            policy.enqueue(state, ticket.demand, now)
            policy.grant_pass(state, now)  # the new ticket's pass, as acquire runs it

    target, started, warmed = warm_target(tickets, warm_rounds), time.perf_counter(), 0
    while not warm_done(warmed, target, started, 0.0, warm_cap_s):
        for _ in range(100):
            cycle(False)
        warmed += 100
    cycles = 0
    gc.collect()
    with CollectorTime() as collector:
        collector.on = True
        cpu0, t0 = time.process_time(), time.perf_counter()
        stop = t0 + seconds
        while time.perf_counter() < stop:
            cycle(True)
            cycles += 1
        wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    return {
        "store": "policy",
        "tenants": tenants,
        "tickets": tickets,
        "cycles_per_s": cycles / wall,
        "cpu_us_per_cycle": cpu / cycles * 1e6,
        "collector": collector.per_cycle(cycles),
        "grant_pass": summary(durations),
        "warm_cycles": warmed,
        "warm_complete": warmed >= target,
    }


async def memory_fast_path(tenants: int, seconds: float) -> dict[str, Any]:
    store = MemoryStore(scale_layout(tenants, pool_tokens=10**12), reap_interval_s=3600.0)
    await store.start()
    try:
        n = 0
        cpu0, t0 = time.process_time(), time.perf_counter()
        stop = t0 + seconds
        while time.perf_counter() < stop:
            for _ in range(100):
                lease = await store.acquire(demand(n % tenants), 1.0)
                await store.release(lease.id, DECODE)
                n += 1
        wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
        return {"store": "memory", "tenants": tenants, "per_s": n / wall, "cpu_us": cpu / n * 1e6}
    finally:
        await store.close()


def memory_bytes(n: int) -> dict[str, float]:
    """In-process bytes per idle tenant (before and after it is forgotten), per waiting ticket of
    the policy state, per waiting acquire (its task included) and per live lease."""

    async def measure() -> dict[str, float]:
        clock = [0.0]
        store = MemoryStore(
            scale_layout(n, pool_tokens=10**12, idle_forget_s=60.0),
            clock=lambda: clock[0],
            reap_interval_s=3600.0,
        )
        await store.start()
        out: dict[str, float] = {}
        gc.collect()
        base = tracemalloc.get_traced_memory()[0]
        for i in range(n):  # every tenant served once, one at a time: n idle tenants
            lease = await store.acquire(demand(i), 1.0)
            await store.release(lease.id, DECODE)
        gc.collect()
        out["per_idle_tenant"] = (tracemalloc.get_traced_memory()[0] - base) / n
        clock[0] += 61.0
        await store.reap_expired()
        gc.collect()
        out["per_idle_tenant_forgotten"] = (tracemalloc.get_traced_memory()[0] - base) / n
        base = tracemalloc.get_traced_memory()[0]
        leases = [await store.acquire(demand(i), 1.0) for i in range(n)]
        gc.collect()
        out["per_live_lease"] = (tracemalloc.get_traced_memory()[0] - base) / n
        for lease in leases:
            await store.release(lease.id, DECODE)
        await store.close()
        full = MemoryStore(scale_layout(n), clock=lambda: clock[0], reap_interval_s=3600.0)
        await full.start()
        for i in range(IN_FLIGHT):
            await full.acquire(demand(i % n), 1.0)
        gc.collect()
        base = tracemalloc.get_traced_memory()[0]
        tasks = [asyncio.ensure_future(full.acquire(demand(i % 1000), 3600.0)) for i in range(n)]
        await asyncio.sleep(0)
        gc.collect()
        out["per_waiting_acquire"] = (tracemalloc.get_traced_memory()[0] - base) / n
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await full.close()
        return out

    lay = scale_layout(1000)
    state = policy.PolicyState(lay)
    tracemalloc.start()
    try:
        gc.collect()
        base = tracemalloc.get_traced_memory()[0]
        for i in range(n):
            policy.enqueue(state, demand(i % 1000), 0.0)
        gc.collect()
        ticket = (tracemalloc.get_traced_memory()[0] - base) / n
        del state
        out = asyncio.run(measure())
    finally:
        tracemalloc.stop()
    out["per_waiting_ticket_policy"] = ticket
    return out


# ---- Redis ----


class Driver:
    """Script calls as a replica makes them, pipelined, on a fresh key prefix.

    ``clock_step``: None runs every call at Redis' own ``TIME``; a number runs them on a virtual
    clock (the scripts' clock override) that moves ``clock_step`` seconds per cycle, so that what
    the domain holds after N cycles (young and old heads, idle tenants) does not depend on how
    fast Redis runs: under valgrind, 50 times slower, real time would age every head."""

    def __init__(
        self,
        url: str,
        lay: BudgetLayout,
        lua: str = "functions",
        clock_step: float | None = None,
        library: Library | None = None,
    ) -> None:
        self.url = url
        self.layout = lay
        self.prefix = f"scale-{uuid.uuid4().hex[:8]}"
        self.store = RedisStore(lay, RedisOptions(url=url, key_prefix=self.prefix), replica_id=OWNER)
        self.client = Redis.from_url(url, decode_responses=True)
        self.runner = ScriptRunner(functions=lua == "functions")
        if library is not None and self.runner.library is not None:  # (an instrumented build of it)
            self.runner.library = library
        self.key = self.store.keys.layout
        self.ids = 0
        self.clock_step = clock_step
        self.now = VIRTUAL_START

    def instant(self, cycles: float) -> str:
        """The clock argument of the next call, which runs ``cycles`` cycles' worth of operations."""
        if self.clock_step is None:
            return ""
        self.now += cycles * self.clock_step
        return repr(self.now)

    async def start(self) -> None:
        await self.store.start()  # writes the layout (and loads the function library)
        # Nothing else is asked of the store: closed now, its health probes do not time out (and
        # log the store unreachable) while Redis runs this driver's long fill calls.
        await self.store.close()
        if self.runner.library is not None:
            await self.client.function_load(self.runner.library.code, replace=True)
        for script in self.runner.scripts.values():
            await self.client.script_load(script.source)

    def command(self, name: str) -> tuple[str, str]:
        """``FCALL <function>`` or ``EVALSHA <sha>``: how this driver runs entry ``name``."""
        if self.runner.library is not None:
            return "FCALL", self.runner.library.functions[name]
        return "EVALSHA", self.runner.scripts[name].sha

    async def close(self) -> None:
        await self.client.aclose()

    async def run(self, calls: Sequence[tuple[str, list[str]]]) -> list[Any]:
        pipe = self.client.pipeline(transaction=False)
        for name, args in calls:
            pipe.execute_command(*self.command(name), 1, self.key, self.instant(0.5), OWNER, *args)
        return list(await pipe.execute())

    async def batch(self, calls: Sequence[tuple[str, list[str]]]) -> tuple[list[Any], list[str]]:
        """One ``batch`` script call (as a replica sends concurrent operations): the operations'
        replies, and the wake-ups for this replica."""
        args: list[str] = []
        for name, op in calls:
            args += [name, str(len(op)), *op]
        now = self.instant(len(calls) / 2)
        reply = await self.client.execute_command(*self.command("batch"), 1, self.key, now, OWNER, *args)
        return list(reply[0]), list(reply[1])

    def acquire(self, tenant: int) -> tuple[str, list[str]]:
        self.ids += 1
        return "acquire", [f"L{self.ids}", *pack_demand(demand(tenant))]

    async def domain_bytes(self) -> int:
        total = 0
        async for key in self.client.scan_iter(f"{self.store.keys.tag}:*", count=1000):
            total += int(await self.client.memory_usage(key, samples=0) or 0)
        return total


async def slowlog_reset(client: Redis) -> None:
    await client.config_set("slowlog-log-slower-than", 0)
    await client.config_set("slowlog-max-len", 1_000_000)
    await client.slowlog_reset()


async def script_durations(client: Redis) -> list[float]:
    entries = await client.slowlog_get(1_000_000)
    await client.config_set("slowlog-log-slower-than", 10_000)
    out = []
    for e in entries:
        command = e["command"]
        if isinstance(command, bytes):
            command = command.decode("latin-1")
        if command.upper().startswith(("EVALSHA", "FCALL")):  # not the commands the scripts ran
            out.append(e["duration"] / 1e6)
    return out


async def command_costs(client: Redis, cycles: int) -> dict[str, dict[str, float]]:
    """What the scripts' Redis commands cost per cycle since the last ``CONFIG RESETSTAT``, by
    command (``INFO commandstats``; the script calls themselves under ``FCALL``/``EVALSHA``, whose
    time includes their commands'): calls and microseconds per cycle, costliest first."""
    stats = await client.info("commandstats")
    rows = {
        name.removeprefix("cmdstat_"): {
            "calls": v["calls"] / max(1, cycles),
            "us": v["usec"] / max(1, cycles),
        }
        for name, v in stats.items()
        if name.removeprefix("cmdstat_") not in ("config|resetstat", "info", "slowlog|get", "config|set")
    }
    return dict(sorted(rows.items(), key=lambda kv: -kv[1]["us"]))


async def redis_cpu(client: Redis) -> float:
    info = await client.info("cpu")
    return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])


def granted_seqs(wakes: Sequence[str]) -> list[int]:
    """The seqs granted in a script call's wake-ups for this replica."""
    return [int(w.split(SEP)[1]) for w in wakes if w.startswith("G" + SEP)]


async def redis_cycles(
    url: str,
    tenants: int,
    tickets: int,
    seconds: float,
    window: int,
    batched: bool,
    lua: str,
    clock_step: float | None = None,
    warm_rounds: float = 0.0,
    warm_cap_s: float = 120.0,
    library: Library | None = None,
    window_marks: Callable[[Redis, bool], Awaitable[None]] | None = None,
) -> dict[str, Any]:
    """``batched``: each round is one ``batch`` script call (the releases and the new acquires);
    else one script call per operation, pipelined. ``lua``: ``functions`` or ``scripts``.
    ``clock_step``: see ``Driver``. Warmed as ``memory_cycles``. ``library``: the function library
    to load instead of the store's own; ``window_marks(client, started)`` runs just before the
    measured window (True) and just after it (False), for profilers."""
    d = Driver(url, scale_layout(tenants), lua, clock_step, library)
    await d.start()
    try:
        held: deque[str] = deque()
        fill = [d.acquire(i % tenants) for i in range(IN_FLIGHT)]
        for (_, args), reply in zip(fill, await d.run(fill), strict=True):
            assert reply[0][0] == "G", reply
            held.append(args[0])
        owner: dict[int, tuple[str, int]] = {}  # seq -> (lease id, tenant)
        bytes0 = await d.domain_bytes()
        for start in range(0, tickets, 500):
            calls = [d.acquire(i % tenants) for i in range(start, min(tickets, start + 500))]
            replies, _ = await d.batch(calls)
            for (_, args), reply in zip(calls, replies, strict=True):
                assert reply[0] == "Q", reply
                owner[int(reply[1])] = (args[0], int(args[1][1:]))
        per_ticket = (await d.domain_bytes() - bytes0) / tickets

        pending: list[tuple[str, list[str]]] = []

        async def turn() -> int:
            calls = pending[:]
            pending.clear()
            n_acq = len(calls)
            for _ in range(min(window, len(held))):
                calls.append(("release", [held.popleft(), str(DECODE)]))
            if batched:
                replies, wakes = await d.batch(calls)
                acquired = replies[:n_acq]
            else:
                replies = await d.run(calls)
                acquired = [r[0] for r in replies[:n_acq]]
                wakes = [w for r in replies[n_acq:] for w in r[1]]
            for (_, args), reply in zip(calls[:n_acq], acquired, strict=True):
                owner[int(reply[1])] = (args[0], int(args[1][1:]))
            n = 0
            for seq in granted_seqs(wakes):
                lease_id, tenant = owner.pop(seq)
                held.append(lease_id)
                pending.append(d.acquire(tenant))
                n += 1
            return n

        target, started, warmed = warm_target(tickets, warm_rounds), time.perf_counter(), 0
        while not warm_done(warmed, target, started, min(1.0, seconds / 3), warm_cap_s):
            warmed += await turn()
        if window_marks is not None:
            await window_marks(d.client, True)
        await d.client.config_resetstat()
        cpu0 = await redis_cpu(d.client)
        cycles = 0
        t0 = time.perf_counter()
        stop = t0 + seconds
        while time.perf_counter() < stop:
            cycles += await turn()
        wall = time.perf_counter() - t0
        cpu = await redis_cpu(d.client) - cpu0
        if window_marks is not None:
            await window_marks(d.client, False)
        commands = await command_costs(d.client, cycles)
        # Script durations in a shorter run of their own: logging every command costs Redis CPU.
        await slowlog_reset(d.client)
        stop = time.perf_counter() + seconds / 2
        while time.perf_counter() < stop:
            await turn()
        durations = await script_durations(d.client)
        return {
            "store": "redis-batch" if batched else "redis",
            "tenants": tenants,
            "tickets": tickets,
            "cycles": cycles,
            "cycles_per_s": cycles / wall,
            "redis_cpu_us_per_cycle": cpu / max(1, cycles) * 1e6,
            "script": summary(durations),
            "bytes_per_waiting_ticket": per_ticket,
            "commands_per_cycle": commands,
            "warm_cycles": warmed,
            "warm_complete": warmed >= target,
        }
    finally:
        await d.close()


async def redis_fast_path(url: str, tenants: int, seconds: float, window: int, lua: str) -> dict[str, Any]:
    """Acquire+release with nothing queued; then the domain's bytes per live lease and per idle
    tenant, before and after ``idle_forget_s`` forgets them."""
    d = Driver(url, scale_layout(tenants, pool_tokens=10**12, idle_forget_s=1.0), lua)
    await d.start()
    try:

        async def cycle(first: int, count: int) -> None:
            acquires = [d.acquire((first + i) % tenants) for i in range(count)]
            await d.run(acquires)
            await d.run([("release", [args[0], str(DECODE)]) for _, args in acquires])

        n = 0
        cpu0 = await redis_cpu(d.client)
        t0 = time.perf_counter()
        stop = t0 + seconds
        while time.perf_counter() < stop:
            await cycle(n, window)
            n += window
        wall = time.perf_counter() - t0
        cpu = await redis_cpu(d.client) - cpu0
        await slowlog_reset(d.client)
        for _ in range(20):
            await cycle(n, window)
            n += window
        out: dict[str, Any] = {
            "store": "redis",
            "tenants": tenants,
            "per_s": n / wall,
            "cpu_us": cpu / n * 1e6,
            "script": summary(await script_durations(d.client)),
        }
        # Every tenant seen once, all idle: what that costs, and what is left once forgotten.
        for first in range(n, tenants, 2000):
            await cycle(first, min(2000, tenants - first))
        base = await d.domain_bytes()
        leases = min(tenants, 100_000)
        calls = [d.acquire(i) for i in range(leases)]
        for start in range(0, leases, 2000):
            await d.run(calls[start : start + 2000])
        out["bytes_per_live_lease"] = (await d.domain_bytes() - base) / leases
        for start in range(0, leases, 2000):
            await d.run([("release", [args[0], "0"]) for _, args in calls[start : start + 2000]])
        idle = await d.domain_bytes()
        out["domain_bytes_idle"] = idle
        await asyncio.sleep(1.1)
        while (await d.run([("reap", ["1000"])]))[0][0][2]:  # until nothing more to reap or forget
            pass
        forgotten = await d.domain_bytes()
        out["bytes_per_idle_tenant"] = (idle - forgotten) / tenants
        out["domain_bytes_after_forgetting"] = forgotten
        return out
    finally:
        await d.close()


# ---- main ----


def sizes(text: str) -> list[tuple[int, int]]:
    return [(int(a), int(b)) for a, b in (part.split(":") for part in text.split(","))]


async def run_all(args: argparse.Namespace, url: str) -> dict[str, Any]:
    results: dict[str, Any] = {"cycles": [], "fast_path": [], "memory": {}}
    for tenants, tickets in sizes(args.sizes):
        if "memory" in args.stores:
            if tickets <= args.memory_max_tickets:
                row = await memory_cycles(tenants, tickets, args.seconds, args.warm_rounds, args.warm_cap)
            else:
                row = policy_cycles(tenants, tickets, args.seconds, args.warm_rounds, args.warm_cap)
            results["cycles"].append(row)
            print_row(row)
        if "redis" in args.stores:
            for batched in (False, True):
                row = await redis_cycles(
                    url,
                    tenants,
                    tickets,
                    args.seconds,
                    args.window,
                    batched,
                    args.lua,
                    warm_rounds=args.warm_rounds,
                    warm_cap_s=args.warm_cap,
                )
                results["cycles"].append(row)
                print_row(row)
                if args.commandstats:
                    print_commands(row["commands_per_cycle"])
    for tenants in sorted({t for t, _ in sizes(args.sizes)}):
        if "memory" in args.stores:
            results["fast_path"].append(await memory_fast_path(tenants, min(args.seconds, 2.0)))
            print(results["fast_path"][-1])
        if "redis" in args.stores:
            results["fast_path"].append(
                await redis_fast_path(url, tenants, min(args.seconds, 2.0), args.window, args.lua)
            )
            print(results["fast_path"][-1])
    return results


def print_row(r: dict[str, Any]) -> None:
    pas = r.get("grant_pass") or r.get("script") or {}
    what = "grant pass" if "grant_pass" in r else "script call"
    extra = (
        f"Redis CPU {r['redis_cpu_us_per_cycle']:.0f} us/cycle, {r['bytes_per_waiting_ticket']:.0f} B/ticket"
        if r["store"].startswith("redis")
        else f"CPU {r['cpu_us_per_cycle']:.1f} us/cycle"
    )
    if "collector" in r:
        c = r["collector"]
        longest = "/".join(f"{ms:.1f}" for ms in c["longest_ms"])
        extra += (
            f" (collector {c['us_per_cycle']:.1f}; collections {'/'.join(map(str, c['collections']))}, "
            f"longest {longest} ms)"
        )
    print(
        f"{r['store']:<7} {r['tenants']:>7} tenants {r['tickets']:>8} tickets: {r['cycles_per_s']:>9,.0f} cycles/s, "
        f"{extra}; {what} p50 {pas['p50_ms']:.3f} p99 {pas['p99_ms']:.3f} max {pas['max_ms']:.3f} ms; "
        f"after {r['warm_cycles']:,} warm cycles"
        + ("" if r["warm_complete"] else " (--warm-cap reached: a first round, not the steady state)"),
        flush=True,
    )


def print_commands(commands: dict[str, dict[str, float]], top: int = 12) -> None:
    listed = list(commands.items())
    inner = sum(v["us"] for name, v in listed if name not in ("fcall", "evalsha"))
    print(
        f"    per cycle: {sum(v['calls'] for name, v in listed if name not in ('fcall', 'evalsha')):.1f} commands "
        f"from the scripts, {inner:.1f} us of their own execution"
    )
    for name, v in listed[:top]:
        print(f"    {name:<18} {v['calls']:6.2f} calls  {v['us']:8.1f} us")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m loadtest.bench.scale",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--url", help="an existing Redis (default: start a private redis-server)")
    parser.add_argument("--sizes", default=DEFAULT_SIZES, help="tenants:tickets,... (default %(default)s)")
    parser.add_argument("--quick", action="store_true", help=f"--sizes {QUICK_SIZES} --seconds 2")
    parser.add_argument("--seconds", type=float, default=4.0, help="measured seconds per point")
    parser.add_argument("--window", type=int, default=32, help="redis: cycles per pipelined round trip")
    parser.add_argument(
        "--warm-rounds",
        type=float,
        default=1.0,
        help="unmeasured cycles first, in rounds of the backlog (default %(default)s: every waiting ticket "
        "granted once; 0: about a second, a first round)",
    )
    parser.add_argument("--warm-cap", type=float, default=120.0, help="most seconds of warming per point")
    parser.add_argument("--memory-max-tickets", type=int, default=100_000, help="beyond: the policy alone")
    parser.add_argument("--stores", default="memory,redis", help="memory,redis (default both)")
    parser.add_argument(
        "--lua", default="functions", choices=("functions", "scripts"), help="redis: FCALL or EVALSHA"
    )
    parser.add_argument(
        "--gc",
        default="gateway",
        choices=("gateway", "python"),
        help="collector thresholds: the gateway's (config gc defaults, what tokengate serve runs) or Python's",
    )
    parser.add_argument(
        "--loop",
        default="uvloop",
        choices=("uvloop", "asyncio"),
        help="event loop: uvloop (what tokengate serve runs, the default) or asyncio's own",
    )
    parser.add_argument("--bytes-sample", type=int, default=20_000, help="in-process bytes: sample size")
    parser.add_argument(
        "--commandstats",
        action="store_true",
        help="redis: also print each command's calls and microseconds per cycle (always in --json)",
    )
    add_redis_option(
        parser, "a setting of the private redis-server, e.g. zset-max-listpack-entries=0 (repeatable)"
    )
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args(argv)
    try:
        server_args = config_args(args.redis_option)
    except ValueError as e:
        parser.error(str(e))
    if server_args and args.url:
        parser.error("--redis-option sets up the private redis-server: not with --url")
    if args.quick:
        args.sizes, args.seconds = QUICK_SIZES, 2.0
    if args.gc == "gateway":
        tune_collector(GcConfig())
    print(f"gc thresholds: {gc.get_threshold()} ({args.gc}); event loop: {args.loop}")
    private = None if args.url or "redis" not in args.stores else RedisServer(extra_args=server_args).start()
    url = args.url or (private.url if private else "")
    try:
        if args.loop == "uvloop":
            import uvloop

            results = uvloop.run(run_all(args, url))
        else:
            results = asyncio.run(run_all(args, url))
        if "memory" in args.stores:
            results["memory"] = memory_bytes(args.bytes_sample)
            print("in-process bytes:", {k: round(v) for k, v in results["memory"].items()})
        if private is not None:
            import redis

            results["redis_used_memory"] = redis.Redis.from_url(url).info("memory")["used_memory"]
            results["redis_cpu_s"] = used_cpu_seconds(redis.Redis.from_url(url))
    finally:
        if private is not None:
            private.stop()
    results["load_average"] = os.getloadavg()[0]
    print(f"load average: {results['load_average']:.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Several tokengate processes on one Redis: one cluster-wide budget, fair share across replicas,
and no leak when a replica is SIGKILLed or Redis itself is killed and restarted mid-load.

Every gateway is a real ``python -m gateway.cli serve`` process with ``store: {kind: redis}``; the
backend is the shared stub (tests/conftest.py) answering after a short delay, so requests stay in
flight long enough to contend. A sampler reads the pools' in-flight tokens straight from Redis.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
import time
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import pytest
from redis.asyncio import Redis

from tests.budgets.redis_fixtures import RedisServer, unique_prefix
from tests.conftest import StubBackend, free_port, serve_asgi
from tests.e2e.support import ROOT
from tests.support import eventually

TENANTS = {"t1": 1, "t2": 1, "t3": 2}  # name -> fair-share weight
BACKEND_CAPACITY = 1000  # tokens; the standard tier may fill 90 % of it
TENANT_BUDGET = 600
TTL_S = 1.5
MAX_TOKENS = 100
DELAY_S = 0.05

pytestmark = pytest.mark.slow


@dataclass
class Gateway:
    port: int
    proc: asyncio.subprocess.Process
    log: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


@dataclass
class Tally:
    statuses: Counter[int] = field(default_factory=Counter)
    served: Counter[str] = field(default_factory=Counter)  # tenant -> 200s
    transport_errors: int = 0


@pytest.fixture
async def backend() -> AsyncIterator[str]:
    served = await serve_asgi(StubBackend(models=("stub-model",)))
    try:
        yield served.url
    finally:
        await served.stop()


def config_yaml(
    port: int, redis_url: str, prefix: str, backend_url: str, fail_mode: str, replicas: int
) -> str:
    tenants = "\n".join(
        f"  {name}: {{keys: [key-{name}], budget_tokens: {TENANT_BUDGET}, weight: {w}, tier: standard}}"
        for name, w in TENANTS.items()
    )
    return f"""
listen: {{host: 127.0.0.1, port: {port}}}
ops: {{port: 0}}
store:
  kind: redis
  url: {redis_url}
  key_prefix: {prefix}
  fail_mode: {fail_mode}
  replicas: {replicas}
  poll_interval_s: 0.1
  timeouts: {{connect_s: 0.2, op_s: 0.3}}
leases: {{ttl_s: {TTL_S}}}
health: {{interval_s: 0.5}}
pools:
  default:
    backends:
      - {{url: {backend_url}, capacity_tokens: {BACKEND_CAPACITY}, models: [stub-model]}}
tenants:
{tenants}
drain_timeout_s: 2
"""


async def start_gateways(
    tmp_path: Path, n: int, redis: RedisServer, backend_url: str, fail_mode: str
) -> tuple[list[Gateway], str]:
    prefix = unique_prefix()
    gateways = []
    for i in range(n):
        port = free_port()
        cfg = tmp_path / f"gw{i}.yaml"
        cfg.write_text(config_yaml(port, redis.url, prefix, backend_url, fail_mode, n))
        log_path = tmp_path / f"gw{i}.log"
        # Logs go to a file (an unread pipe would fill up and stall the process); the child
        # inherits the descriptor, ours is closed right after the spawn.
        log_fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        try:
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "gateway.cli", "serve", "--config", str(cfg),
                cwd=ROOT, stdout=asyncio.subprocess.DEVNULL, stderr=log_fd,
            )  # fmt: skip
        finally:
            os.close(log_fd)
        gateways.append(Gateway(port, proc, log_path))
    try:
        await _wait_ready(gateways)
    except BaseException:
        # The caller never gets them, so it cannot stop them: do it here.
        await stop_gateways(gateways)
        raise
    return gateways, prefix


async def _wait_ready(gateways: list[Gateway]) -> None:
    async with aiohttp.ClientSession() as session:
        for gw in gateways:

            async def ready(gw: Gateway = gw) -> bool:
                with contextlib.suppress(aiohttp.ClientError):
                    async with session.get(gw.url + "/readyz") as r:
                        if r.status == 200:
                            return True
                if gw.proc.returncode is not None:
                    raise AssertionError(f"gateway exited: {gw.log.read_text()[-2000:]}")
                return False

            await eventually(ready, timeout_s=60, interval_s=0.1, message="gateway did not become ready")


async def stop_gateways(gateways: list[Gateway]) -> None:
    for gw in gateways:
        if gw.proc.returncode is None:
            gw.proc.send_signal(signal.SIGTERM)
    for gw in gateways:
        try:
            await asyncio.wait_for(gw.proc.wait(), 15)
        except TimeoutError:
            gw.proc.kill()
            await gw.proc.wait()


async def client(
    session: aiohttp.ClientSession,
    gateways: list[Gateway],
    tenant: str,
    worker: int,
    tally: Tally,
    stop: asyncio.Event,
) -> None:
    i = worker
    body = {
        "model": "stub-model",
        "messages": [{"role": "user", "content": "hello"}],
        "max_tokens": MAX_TOKENS,
    }
    headers = {"authorization": f"Bearer key-{tenant}", "x-stub-delay": str(DELAY_S), "x-stub-chunks": "4"}
    while not stop.is_set():
        live = [gw for gw in gateways if gw.proc.returncode is None]
        gw = live[i % len(live)]
        i += 1
        try:
            async with session.post(gw.url + "/v1/chat/completions", json=body, headers=headers) as r:
                await r.read()
                tally.statuses[r.status] += 1
                if r.status == 200:
                    tally.served[tenant] += 1
                elif r.status in (429, 503):
                    await asyncio.sleep(0.05)
        except (TimeoutError, aiohttp.ClientError):
            tally.transport_errors += 1  # the replica we talked to was killed
            await asyncio.sleep(0.05)


@contextlib.asynccontextmanager
async def load(gateways: list[Gateway], workers_per_tenant: int) -> AsyncIterator[Tally]:
    tally = Tally()
    stop = asyncio.Event()
    timeout = aiohttp.ClientTimeout(total=30)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        tasks = [
            asyncio.create_task(client(session, gateways, t, w, tally, stop))
            for t in TENANTS
            for w in range(workers_per_tenant)
        ]
        try:
            yield tally
        finally:
            stop.set()
            await asyncio.wait_for(asyncio.gather(*tasks), 40)


async def in_flight(redis: Redis, prefix: str) -> dict[str, int]:
    raw = await redis.hgetall("{tg:" + prefix + "}:used")  # type: ignore[misc]
    return {k: int(v) for k, v in raw.items()}


async def wait_drained(redis: Redis, prefix: str, timeout_s: float) -> float:
    """Seconds until no pool has tokens in flight and no lease is left."""
    started = time.monotonic()
    while True:
        used = await in_flight(redis, prefix)
        leases = await redis.hlen("{tg:" + prefix + "}:leases")  # type: ignore[misc]
        if not used and not leases:
            return time.monotonic() - started
        assert time.monotonic() - started < timeout_s, f"not drained: {used}, {leases} leases"
        await asyncio.sleep(0.05)


async def test_replicas_share_one_budget_fairly_and_a_killed_replica_gives_its_tokens_back(
    tmp_path: Path, fresh_redis: RedisServer, backend: str
) -> None:
    gateways, prefix = await start_gateways(tmp_path, 3, fresh_redis, backend, "closed")
    redis = Redis.from_url(fresh_redis.url, decode_responses=True)
    peaks: Counter[str] = Counter()
    sampling = True

    async def sample() -> None:
        while sampling:
            for pool, used in (await in_flight(redis, prefix)).items():
                peaks[pool] = max(peaks[pool], used)
            await asyncio.sleep(0.005)

    sampler = asyncio.create_task(sample())
    try:
        async with load(gateways, workers_per_tenant=6) as tally:
            await asyncio.sleep(4.0)
            # Every pool stayed within its limit on every sample, across all three replicas.
            assert 0 < peaks["backend:default"] <= int(0.9 * BACKEND_CAPACITY), peaks
            for t in TENANTS:
                assert peaks[f"tenant:{t}"] <= TENANT_BUDGET, peaks
            # Fair share across replicas: t3 (weight 2) gets about twice what t1 and t2 get.
            served = dict(tally.served)
            print(f"peaks {dict(peaks)} served {served}")  # shown on failure
            assert min(served.values()) > 20, served
            assert 0.7 < served["t1"] / served["t2"] < 1.4, served
            assert 1.4 < served["t3"] / ((served["t1"] + served["t2"]) / 2) < 2.8, served

            # SIGKILL one replica mid-load: its leases are never released, only reaped.
            owners_before = set(await redis.zrange("{tg:" + prefix + "}:replicas", 0, -1))  # type: ignore[misc]
            victim = gateways[2]
            victim.proc.send_signal(signal.SIGKILL)
            await victim.proc.wait()
            killed_at = time.monotonic()
            dead = await find_dead_replica(redis, prefix, owners_before)
            while True:
                leases = await redis.hvals("{tg:" + prefix + "}:leases")  # type: ignore[misc]
                if not any(f"\x1f{dead}\x1f" in v for v in leases):
                    break
                assert time.monotonic() - killed_at < TTL_S + 1.0, (
                    "the killed replica's leases outlived their TTL"
                )
                await asyncio.sleep(0.05)
            print(f"killed replica's leases gone {time.monotonic() - killed_at:.2f}s after SIGKILL")
            await asyncio.sleep(1.0)  # the two survivors keep serving
        sampling = False
        await sampler
        assert peaks["backend:default"] <= int(0.9 * BACKEND_CAPACITY), peaks
        assert tally.statuses[200] > 100 and set(tally.statuses) <= {200, 429}, tally.statuses
        await wait_drained(redis, prefix, timeout_s=TTL_S + 3.0)
        assert all(gw.proc.returncode is None for gw in gateways[:2])
    finally:
        sampling = False
        await asyncio.gather(sampler, return_exceptions=True)
        await stop_gateways(gateways)
        await redis.aclose()


async def find_dead_replica(redis: Redis, prefix: str, owners: set[str]) -> str:
    """The replica whose liveness stops being refreshed (survivors refresh it every reap)."""
    key = "{tg:" + prefix + "}:replicas"
    first = {m: s for m, s in await redis.zrange(key, 0, -1, withscores=True)}  # type: ignore[misc]
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        await asyncio.sleep(0.3)
        now = {m: s for m, s in await redis.zrange(key, 0, -1, withscores=True)}  # type: ignore[misc]
        stale = [m for m in owners if m in now and now[m] == first.get(m)]
        if len(stale) == 1:
            return stale[0]
    raise AssertionError("could not tell which replica died")


@pytest.mark.parametrize("fail_mode", ["closed", "open"])
async def test_redis_killed_and_restarted_mid_load(
    tmp_path: Path, fresh_redis: RedisServer, backend: str, fail_mode: str
) -> None:
    gateways, prefix = await start_gateways(tmp_path, 2, fresh_redis, backend, fail_mode)
    try:
        async with load(gateways, workers_per_tenant=3) as tally:
            await asyncio.sleep(1.5)
            before = Counter(tally.statuses)
            fresh_redis.kill()
            await asyncio.sleep(1.5)
            during = tally.statuses - before
            print(f"{fail_mode}: before {dict(before)} during the outage {dict(during)}")
            fresh_redis.restart()  # empty: layout, leases and scripts are gone
            await asyncio.sleep(2.5)
            after_mark = Counter(tally.statuses)
            await asyncio.sleep(1.5)
            after = tally.statuses - after_mark
        print(f"{fail_mode}: after recovery {dict(after)}, transport errors {tally.transport_errors}")
        assert before[200] > 20, before
        if fail_mode == "closed":
            # Fast 503s while Redis is gone (requests already admitted still complete).
            assert during[503] > 0, during
            assert set(during) <= {200, 503}, during
        else:
            # Admitted against each replica's local share (capacity / 2): still serving.
            assert during[200] > 10, during
            assert set(during) <= {200, 429}, during
        assert after[200] > 20 and set(after) <= {200, 429}, after
        assert all(gw.proc.returncode is None for gw in gateways), "a gateway crashed"
        redis = Redis.from_url(fresh_redis.url, decode_responses=True)
        try:
            await wait_drained(redis, prefix, timeout_s=TTL_S + 3.0)
        finally:
            await redis.aclose()
    finally:
        await stop_gateways(gateways)

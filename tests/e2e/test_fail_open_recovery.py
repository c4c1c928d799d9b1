"""Fail-open through a Redis outage, measured where it matters: at the backend.

Two gateway replicas (two apps in this process, ``fail_mode: open``, ``replicas: 2``) share one
real redis-server and one backend. The backend counts the requests it is serving at every moment;
all requests are alike, so tokens in flight are that count times the price the gateway puts on
one request. Redis is SIGKILLed with requests in flight and restarted empty mid-load:

- during the outage the backend may run what Redis had admitted before it died plus each
  replica's local share (docs/redis.md, "Failure modes"), never more;
- from the restart on it never runs more than the pool's capacity.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import orjson
import pytest
from redis.asyncio import Redis

from tests.budgets.redis_fixtures import RedisServer, unique_prefix
from tests.budgets.support import eventually
from tests.conftest import GatewayFactory, RunningGateway, serve_asgi

pytestmark = pytest.mark.slow

CAPACITY = 1000  # tokens of the one backend pool; one request costs ~110, so ~9 run at once
REPLICAS = 2
WORKERS = 24  # clients, each one request at a time, alternating between the replicas
HOLD_S = 0.25  # how long the backend works on an ordinary request
PRE = 5  # long requests admitted through Redis just before it dies
PRE_HOLD_S = 1.0  # they end during the outage (OUTAGE_S)
OUTAGE_S = 1.5
AFTER_S = 2.5


@dataclass
class CountingBackend:
    """An OpenAI-style stub that logs how many requests it is working on after every change.

    A request counts from its arrival until its answer is ready; it stops counting just before
    the answer is sent, while the gateway still holds its lease, so the count can only be below
    what the gateway admitted, never above it.
    """

    running: int = 0
    running_pre: int = 0
    log: list[tuple[float, int]] = field(default_factory=list)  # (monotonic time, running)

    def _change(self, delta: int, pre: bool) -> None:
        self.running += delta
        if pre:
            self.running_pre += delta
        self.log.append((time.monotonic(), self.running))

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                done = "shutdown" in message["type"]
                await send({"type": message["type"] + ".complete"})
                if done:
                    return
        while (await receive()).get("more_body"):
            pass
        if scope["path"] != "/v1/chat/completions":
            await _answer(send, {"object": "list", "data": []})  # health checks, metrics scrapes
            return
        headers = {k.decode(): v.decode() for k, v in scope["headers"]}
        pre = headers.get("x-phase") == "pre"
        self._change(+1, pre)
        try:
            await asyncio.sleep(float(headers.get("x-hold-s", "0")))
        finally:
            self._change(-1, pre)
        await _answer(
            send,
            {
                "id": "c1",
                "object": "chat.completion",
                "model": "stub-model",
                "choices": [
                    {"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}
                ],
                "usage": {"prompt_tokens": 8, "completion_tokens": 1, "total_tokens": 9},
            },
        )

    def peak(self, since: float, until: float = float("inf")) -> int:
        """Most requests running at once in [since, until) (the count at ``since`` included)."""
        before = [n for t, n in self.log if t < since]
        during = [n for t, n in self.log if since <= t < until]
        return max([before[-1] if before else 0, *during])


async def _answer(send: Any, doc: Any) -> None:
    body = orjson.dumps(doc)
    await send(
        {
            "type": "http.response.start",
            "status": 200,
            "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())],
        }
    )
    await send({"type": "http.response.body", "body": body})


def gateway_config(redis_url: str, prefix: str, backend_url: str) -> dict[str, Any]:
    return {
        "store": {
            "kind": "redis",
            "url": redis_url,
            "key_prefix": prefix,
            "fail_mode": "open",
            "replicas": REPLICAS,
            "poll_interval_s": 0.05,
            "timeouts": {"connect_s": 0.2, "op_s": 0.2},
        },
        "leases": {"ttl_s": 3.0},
        "pools": {
            "default": {
                "backends": [{"url": backend_url, "capacity_tokens": CAPACITY, "models": ["stub-model"]}]
            }
        },
        # The critical tier may fill the whole pool: the limit under test is the capacity itself.
        "tenants": {
            name: {"keys": [f"key-{name}"], "budget_tokens": 100_000, "tier": "critical"}
            for name in ("t1", "t2")
        },
        "drain_timeout_s": 1,
    }


@dataclass
class Load:
    gateways: list[RunningGateway]
    session: aiohttp.ClientSession
    statuses: Counter[int] = field(default_factory=Counter)
    costs: set[int] = field(default_factory=set)  # the gateway's price of one request
    busy: int = 0
    go: asyncio.Event = field(default_factory=asyncio.Event)
    stop: bool = False

    async def one(self, worker: int, hold_s: float, phase: str) -> int:
        gw = self.gateways[worker % len(self.gateways)]
        body = {"model": "stub-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 100}
        headers = {
            "authorization": f"Bearer key-t{worker % 2 + 1}",
            "x-hold-s": str(hold_s),
            "x-phase": phase,
        }
        async with self.session.post(gw.url + "/v1/chat/completions", json=body, headers=headers) as r:
            await r.read()
            self.statuses[r.status] += 1
            if r.status == 200:
                self.costs.add(int(r.headers["x-tokengate-cost"]))
            return r.status

    async def worker(self, n: int) -> None:
        turn = n
        while not self.stop:
            await self.go.wait()
            if self.stop:
                return
            self.busy += 1
            try:
                if await self.one(turn, HOLD_S, "load") != 200:
                    await asyncio.sleep(0.05)
            finally:
                self.busy -= 1
            turn += 1

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[Load]:
        self.go.set()
        tasks = [asyncio.create_task(self.worker(n)) for n in range(WORKERS)]
        try:
            yield self
        finally:
            self.stop = True
            self.go.set()
            await asyncio.wait_for(asyncio.gather(*tasks), 30)

    async def pause(self) -> None:
        """Let every worker finish its request and wait: nothing is queued or on its way."""
        self.go.clear()
        await eventually(lambda: self.busy == 0, timeout_s=30)


async def redis_used(redis: Redis, prefix: str) -> int:
    used = await redis.hget("{tg:" + prefix + "}:used", "backend:default")  # type: ignore[misc]
    return int(used or 0)


async def test_backend_never_runs_more_than_capacity_after_redis_comes_back(
    fresh_redis: RedisServer, gateway_factory: GatewayFactory
) -> None:
    backend = CountingBackend()
    served = await serve_asgi(backend)
    prefix = unique_prefix()
    redis = Redis.from_url(fresh_redis.url, decode_responses=True)
    try:
        gateways = [
            await gateway_factory(gateway_config(fresh_redis.url, prefix, served.url))
            for _ in range(REPLICAS)
        ]
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
            load = Load(gateways, session)
            async with load.running():
                await asyncio.sleep(1.0)  # the replicas share the pool through Redis
                await load.pause()
                (cost,) = load.costs
                pre = [asyncio.create_task(load.one(n, PRE_HOLD_S, "pre")) for n in range(PRE)]
                await eventually(lambda: backend.running_pre == PRE, timeout_s=10)

                async def counted() -> bool:
                    return await redis_used(redis, prefix) == backend.running * cost

                await eventually(counted, timeout_s=5)
                before_outage = await redis_used(redis, prefix)  # admitted by Redis, still running
                killed_at, at_kill = time.monotonic(), Counter(load.statuses)
                fresh_redis.kill()
                load.go.set()  # clients carry on against the fallbacks
                await asyncio.sleep(OUTAGE_S)
                assert backend.running_pre == 0, "the pre-outage requests should be over by now"
                restarted_at, at_restart = time.monotonic(), Counter(load.statuses)
                fresh_redis.restart()  # empty: layout, leases, queue and scripts are gone
                await asyncio.sleep(AFTER_S)
            assert all(status == 200 for status in await asyncio.gather(*pre))

            await redis.aclose()  # its connection died with the server
            redis = Redis.from_url(fresh_redis.url, decode_responses=True)

            async def drained() -> bool:
                leases = await redis.hlen("{tg:" + prefix + "}:leases")  # type: ignore[misc]
                return await redis_used(redis, prefix) == 0 and leases == 0 and backend.running == 0

            await eventually(drained, timeout_s=10)
        assert load.costs == {cost}
        local_shares = REPLICAS * (CAPACITY // REPLICAS)
        outage_peak = backend.peak(killed_at, restarted_at) * cost
        after_peak = backend.peak(restarted_at) * cost
        print(
            f"cost {cost}; in flight at the kill {before_outage}; peak during the outage {outage_peak} "
            f"(bound {before_outage + local_shares}); peak after the restart {after_peak} (capacity "
            f"{CAPACITY}); statuses {dict(load.statuses)}"
        )
        assert outage_peak > before_outage, "the fallbacks admitted nothing during the outage"
        assert outage_peak <= before_outage + local_shares
        assert after_peak <= CAPACITY
        assert set(load.statuses) <= {200, 429}, load.statuses
        assert (at_restart - at_kill)[200] > 10, "served during the outage"
        assert (load.statuses - at_restart)[200] > 20, "served after the restart"
    finally:
        await redis.aclose()
        await served.stop()

"""A tenant that trains its learned reservation low, then sends requests that each run to their limit.

Under ``reservation.mode: learned`` a request holds the learned estimate of its output, not its
``max_tokens``. A hostile tenant first sends short answers (its estimate falls to a few tokens),
then many requests that each produce their whole limit. Its budget holds what each request may
produce, so the requests it has running at once can never produce more than its budget; the shared
backend pool holds only the estimates (that is what learned reservations are for).
"""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import pytest

from tests.budgets.redis_fixtures import session_redis, unique_prefix
from tests.conftest import GatewayFactory, StubBackend, stub_pools

BUDGET = 5000
LIMIT = 2000  # max_tokens of each hostile request: at most 2 fit the budget at once


def body(max_tokens: int) -> dict[str, Any]:
    return {"model": "stub-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": max_tokens}


@pytest.mark.parametrize("store", ["memory", "redis"])
async def test_a_tenant_that_trained_its_estimate_low_never_runs_more_than_its_budget(
    stub_backend: tuple[StubBackend, str], gateway_factory: GatewayFactory, store: str
) -> None:
    stub, url = stub_backend
    kind: dict[str, object] = {"kind": "memory"}
    if store == "redis":  # the Lua port: the request's limit travels in its lease record
        kind = {"kind": "redis", "url": session_redis().url, "key_prefix": unique_prefix()}
    gw = await gateway_factory(
        {
            "pools": stub_pools(url, capacity=100_000),
            "store": kind,
            "reservation": {"mode": "learned", "min_samples": 3},
            "tenants": {"mallory": {"keys": ["k"], "budget_tokens": BUDGET}},
        }
    )
    async with httpx.AsyncClient(base_url=gw.url, headers={"authorization": "Bearer k"}, timeout=30) as c:
        for _ in range(5):  # short answers: the estimate for this tenant falls to 3 tokens
            r = await c.post("/v1/chat/completions", json=body(LIMIT), headers={"x-stub-chunks": "3"})
            assert r.status_code == 200
        cost = int(r.headers["x-tokengate-cost"])
        assert cost < 100  # what the next request reserves: the learned estimate, not 2,000

        # Now every request runs to its limit: 2,000 tokens each, slowly.
        hostile = {"x-stub-chunks": str(LIMIT), "x-stub-interval": "0", "x-stub-delay": "0.8"}
        sent = len(stub.requests)
        tasks = [
            asyncio.create_task(c.post("/v1/chat/completions", json=body(LIMIT), headers=hostile))
            for _ in range(5)
        ]
        most_running = 0
        books: list[tuple[int, int]] = []  # (tenant pool, backend pool) in flight, per sample
        while not all(t.done() for t in tasks):
            running = [r for r in stub.requests[sent:] if not r.completed and r.cancelled_at is None]
            most_running = max(most_running, len(running))
            flight = await gw.in_flight()
            books.append((flight["tenant:mallory"], flight["backend:default"]))
            await asyncio.sleep(0.02)
        answers = await asyncio.gather(*tasks)
    assert [a.status_code for a in answers] == [200] * 5
    assert all(a.json()["usage"]["completion_tokens"] == LIMIT for a in answers)
    # What ran at once could produce at most the budget: 2 requests of 2,000 (+ prompt) of 5,000.
    prefill = cost - 3
    assert 1 <= most_running <= BUDGET // (prefill + LIMIT) == 2
    assert max(tenant for tenant, _ in books) <= BUDGET
    # The shared pool held the estimates, far less than what the tenant's budget held for the limits.
    assert any(tenant >= prefill + LIMIT and backend <= tenant // 10 for tenant, backend in books)
    assert await gw.wait_idle() == {name: 0 for name in await gw.in_flight()}

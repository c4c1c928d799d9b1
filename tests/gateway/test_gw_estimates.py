"""Estimate mode over real sockets: a long never-seen prompt goes on a learned estimate, its exact
count (made meanwhile) corrects the lease, and every decision that depends on the count waits for it."""

from __future__ import annotations

import asyncio
import logging
import random
from typing import Any

import httpx
import pytest

from classifiers import Pricer, PricingSettings, TokenizerRegistry
from tests.conftest import GatewayFactory, RunningGateway, StubBackend, stub_pools
from tests.gateway.gw_support import AUTH, access_lines, chat
from tests.support import eventually

WORDS = "the quick brown fox jumps over a lazy dog while seven engineers debug the scheduler".split()
MAX_TOKENS = 10


def prose(words: int, rng: random.Random) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


def config(url: str, budget: int = 1_000_000, **extra: Any) -> dict[str, Any]:
    return {
        "pools": stub_pools(url, capacity=2_000_000),
        "tenants": {"t": {"keys": ["k"], "budget_tokens": budget}},
        "models": {"stub-model": {"context_length": 200_000}},
        # The exact counts at the loop's own priority: on a busy test machine an idle-class thread
        # could take seconds, past the request's life (in production that only delays a correction).
        "pricing": {"estimate_above_chars": 20_000, "encode_idle": False, "encode_nice": 0},
        "drain_timeout_s": 1,
        **extra,
    }


async def exact_prefill(text: str) -> int:
    """The prompt's exact price, as the gateway counts it without estimates."""
    reference = Pricer(TokenizerRegistry(), PricingSettings(encode_threads=0))
    cost = await reference.aprice_chat(
        chat(text, max_tokens=MAX_TOKENS),
        default_max_tokens=1024,
        max_tokens_limit=None,
        context_length=10**6,
    )
    return cost.prefill


async def ask(c: httpx.AsyncClient, text: str, **headers: str) -> httpx.Response:
    return await c.post(
        "/v1/chat/completions", json=chat(text, max_tokens=MAX_TOKENS), headers={**AUTH, **headers}
    )


async def train(c: httpx.AsyncClient, rng: random.Random) -> None:
    """Eight long never-seen prompts, counted exactly off the loop: the ratio is learned from them."""
    for _ in range(8):
        assert (await ask(c, prose(2_500, rng))).status_code == 200


async def stats(gw: RunningGateway) -> dict[str, Any]:
    async with httpx.AsyncClient() as c:
        return (await c.get(gw.ops_url + "/stats")).json()  # type: ignore[no-any-return]


async def test_a_long_prompt_goes_on_its_estimate_and_its_lease_grows_to_the_exact_count(
    stub_backend: tuple[StubBackend, str], gateway_factory: GatewayFactory, caplog: pytest.LogCaptureFixture
) -> None:
    """The hostile case: a text that tokenizes far above the learned ratio (CJK after English) is
    estimated low, and holds its exact count in the pools while it runs once the count is in."""
    caplog.set_level(logging.INFO, logger="tokengate.access")
    _, url = stub_backend
    gw = await gateway_factory(config(url))
    rng = random.Random(11)
    hostile = "".join(chr(rng.randrange(0x4E00, 0x9FFF)) for _ in range(25_000))
    exact = await exact_prefill(hostile)
    async with httpx.AsyncClient(base_url=gw.url, timeout=30) as c:
        await train(c, rng)
        running = asyncio.create_task(ask(c, hostile, **{"x-stub-delay": "3.0"}))

        async def held_exact() -> bool:
            return (await gw.in_flight())["tenant:t"] >= exact

        await eventually(held_exact, timeout_s=2.5, message="the lease never grew to the exact count")
        r = await running
    assert r.status_code == 200
    assert int(r.headers["x-tokengate-cost"]) >= exact
    line = access_lines(caplog)[-1]
    assert line["prefill"] == exact  # the access line and fair share see the exact count
    assert await gw.wait_idle() == {"tenant:t": 0, "backend:default": 0}
    st = await stats(gw)
    estimates = st["estimates"]
    assert (estimates["estimated"], estimates["counted"], estimates["under"]) == (1, 1, 1)
    assert st["store"] == {"kind": "memory"}  # where the pools live (a Redis store names its node)


async def test_a_prompt_too_big_on_its_estimate_but_not_on_its_count_is_served(
    stub_backend: tuple[StubBackend, str], gateway_factory: GatewayFactory
) -> None:
    _, url = stub_backend
    rng = random.Random(12)
    fits, too_big = prose(20_000, rng), prose(20_000, rng)
    exact = await exact_prefill(fits)
    # The budget holds the exact prompt and its output; the estimate's margin does not fit in it.
    gw = await gateway_factory(config(url, budget=exact + MAX_TOKENS + 20))
    async with httpx.AsyncClient(base_url=gw.url, timeout=30) as c:
        await train(c, rng)
        served = await ask(c, fits)
        assert served.status_code == 200, served.text
        assert int(served.headers["x-tokengate-cost"]) == exact + MAX_TOKENS
        refused = await ask(c, too_big + " " + prose(200, rng))
    assert refused.status_code == 413
    assert refused.json()["error"]["code"] == "cost_exceeds_capacity"
    assert await gw.wait_idle() == {"tenant:t": 0, "backend:default": 0}
    assert (await stats(gw))["estimates"]["estimated"] == 2


async def test_a_class_boundary_within_the_margin_is_decided_on_the_exact_count(
    stub_backend: tuple[StubBackend, str], gateway_factory: GatewayFactory
) -> None:
    _, url = stub_backend
    rng = random.Random(13)
    text = prose(20_000, rng)
    exact = await exact_prefill(text)
    long_rule = {
        "name": "long",
        "pool": "default",
        "when": {"min_prompt_tokens": exact + 200},
    }  # above the count, below the estimate
    gw = await gateway_factory(config(url, classes=[long_rule]))
    async with httpx.AsyncClient(base_url=gw.url, timeout=30) as c:
        await train(c, rng)
        r = await ask(c, text)
        assert r.status_code == 200
        assert r.headers["x-tokengate-class"] == "default"
        clearly_long = await ask(c, prose(30_000, rng))  # far past the boundary: goes on its estimate
        assert clearly_long.headers["x-tokengate-class"] == "long"
    assert await gw.wait_idle() == {"tenant:t": 0, "backend:default": 0}
    assert (await stats(gw))["estimates"]["estimated"] == 2  # both went on estimates; the class waited


async def test_a_client_gone_before_its_exact_count_leaves_nothing_held(
    stub_backend: tuple[StubBackend, str], gateway_factory: GatewayFactory
) -> None:
    """Requests priced on an estimate whose clients hang up (while the count is made, and after the
    lease grew) release exactly once: the pools are back at zero, the stub saw them cancelled."""
    stub, url = stub_backend
    gw = await gateway_factory(config(url))
    rng = random.Random(14)
    async with httpx.AsyncClient(base_url=gw.url, timeout=30) as c:
        await train(c, rng)
    for hang_up_after in (0.01, 0.5):
        hostile = "".join(chr(rng.randrange(0x4E00, 0x9FFF)) for _ in range(25_000))
        async with httpx.AsyncClient(base_url=gw.url, timeout=hang_up_after) as c:
            with pytest.raises(httpx.TimeoutException):
                await ask(c, hostile, **{"x-stub-delay": "5.0"})
        assert await gw.wait_idle() == {"tenant:t": 0, "backend:default": 0}
    await eventually(lambda: all(r.cancelled_at is not None for r in stub.requests[-2:]), timeout_s=5)
    assert (await stats(gw))["estimates"]["estimated"] == 2

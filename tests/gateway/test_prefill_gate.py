"""The prefill gate: its rules on a virtual clock, then through a real gateway over real sockets —
released exactly once on every path (first streamed token, end of answer, upstream error, connect
failure retry, client gone while waiting), visible in /stats and /metrics."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import pytest

from gateway.config_loader import ConfigError, parse_config
from gateway.upstream.gate import PrefillGate
from tests.conftest import GatewayFactory, RunningGateway, StubBackend, stub_pools
from tests.gateway.gw_support import RawRequest, chat, dead_then_live
from tests.support import eventually

ZERO = {"tenant:default": 0, "backend:default": 0}


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def gate(limit: int, hold_s: float = 1.0) -> tuple[PrefillGate, Clock]:
    clock = Clock()
    return PrefillGate(limit, hold_s, clock=clock), clock


async def entered(task: asyncio.Task[Any]) -> bool:
    await asyncio.sleep(0)  # let a woken waiter run
    return task.done()


# ---- the rules -------------------------------------------------------------------------------


async def test_a_prompt_that_fits_enters_at_once_and_leaves_exactly_once() -> None:
    g, _ = gate(1000)
    p = await g.enter(400)
    assert (g.tokens, g.requests, p.waited_s) == (400, 1, 0.0)
    p.release()
    p.release()  # idempotent: the relay and the finally clause may both release
    assert (g.tokens, g.requests, g.waiting) == (0, 0, 0)


async def test_a_second_long_prompt_waits_for_the_first_ones_first_token() -> None:
    g, clock = gate(32_000)
    first = await g.enter(28_000)
    second = asyncio.create_task(g.enter(28_000))
    assert not await entered(second)
    assert g.waiting == 1
    clock.t = 0.7
    first.release()
    assert await entered(second)
    p = second.result()
    assert p.waited_s == pytest.approx(0.7) and g.tokens == 28_000 and g.held_total == 1
    p.release()
    assert g.tokens == 0


async def test_short_prompts_pass_a_waiting_long_one_until_it_has_waited_hold_s() -> None:
    g, clock = gate(30_000, hold_s=1.0)
    shorts = [await g.enter(1_000) for _ in range(3)]  # short prompts prefilling
    long = asyncio.create_task(g.enter(28_000))
    assert not await entered(long)  # it would not fit beside them: held back briefly
    passing = await g.enter(1_000)  # a short newcomer fits and passes it
    assert g.tokens == 4_000
    clock.t = 1.0  # the long prompt has waited hold_s: nobody passes it any more
    late = asyncio.create_task(g.enter(500))
    assert not await entered(late)
    for p in [*shorts, passing]:
        p.release()
    assert await entered(long) and await entered(late)  # in order: the long one, then the short one
    assert g.tokens == 28_500
    long.result().release()
    late.result().release()
    assert (g.tokens, g.requests, g.waiting) == (0, 0, 0)


async def test_a_prompt_waiting_for_another_long_one_never_holds_short_ones_back() -> None:
    g, clock = gate(48_000, hold_s=1.0)
    first = await g.enter(28_000)  # prefilling
    second = asyncio.create_task(g.enter(28_000))  # waits for the first one's first token
    assert not await entered(second)
    clock.t = 5.0  # long past hold_s: still, stopping short prompts would not let it in sooner
    shorts = [await g.enter(2_000) for _ in range(5)]
    assert g.tokens == 38_000 and g.waiting == 1
    first.release()
    assert await entered(second)  # beside the short ones, as soon as the first long one is out
    for p in [second.result(), *shorts]:
        p.release()
    assert (g.tokens, g.requests, g.waiting) == (0, 0, 0)


async def test_a_prompt_larger_than_the_limit_enters_only_an_empty_gate() -> None:
    g, _ = gate(10_000)
    short = await g.enter(500)
    huge = asyncio.create_task(g.enter(28_000))
    assert not await entered(huge)
    short.release()
    assert await entered(huge)
    assert g.tokens == 28_000
    huge.result().release()
    assert g.tokens == 0
    alone = await g.enter(28_000)  # an empty gate takes it at once
    alone.release()


async def test_a_waiter_cancelled_in_line_leaves_the_queue_and_unblocks_those_behind() -> None:
    g, clock = gate(30_000, hold_s=0.5)
    short = await g.enter(5_000)
    long = asyncio.create_task(g.enter(28_000))
    assert not await entered(long)
    clock.t = 1.0  # the long one holds the line
    behind = asyncio.create_task(g.enter(1_000))
    assert not await entered(behind)
    long.cancel()
    await asyncio.gather(long, return_exceptions=True)
    assert await entered(behind)  # it no longer waits behind a cancelled request
    behind.result().release()
    short.release()
    assert (g.tokens, g.requests, g.waiting) == (0, 0, 0)


async def test_a_waiter_cancelled_just_after_it_was_let_in_gives_its_tokens_back() -> None:
    g, _ = gate(10_000)
    first = await g.enter(8_000)
    second = asyncio.create_task(g.enter(8_000))
    assert not await entered(second)
    first.release()  # lets the second in (its future is resolved) ...
    second.cancel()  # ... but its task is cancelled before it runs again
    await asyncio.gather(second, return_exceptions=True)
    assert second.cancelled()
    assert (g.tokens, g.requests, g.waiting) == (0, 0, 0)


async def test_raising_the_limit_lets_waiters_in() -> None:
    g, _ = gate(10_000)
    first = await g.enter(8_000)
    second = asyncio.create_task(g.enter(8_000))
    assert not await entered(second)
    g.reconfigure(20_000, 1.0)
    assert await entered(second)
    first.release()
    second.result().release()
    assert g.tokens == 0


def test_the_gate_is_configured_per_pool_and_off_by_default() -> None:
    cfg = parse_config(
        {
            "pools": {
                "one": {
                    "backends": [{"url": "http://a", "capacity_tokens": 100_000}],
                    "prefill_gate_tokens": 32_000,
                    "prefill_gate_hold_s": 0.5,
                },
                "other": {"backends": [{"url": "http://b", "capacity_tokens": 100_000}]},
            }
        }
    )
    one, other = cfg.pools
    assert (one.prefill_gate_tokens, one.prefill_gate_hold_s) == (32_000, 0.5)
    assert other.prefill_gate_tokens is None
    with pytest.raises(ConfigError, match="prefill_gate_tokens"):
        parse_config(
            {
                "pools": {
                    "p": {"backends": [{"url": "http://a", "capacity_tokens": 1}], "prefill_gate_tokens": 0}
                }
            }
        )


# ---- through the gateway ---------------------------------------------------------------------


def gated_pools(url: str, limit: int, **pool: Any) -> dict[str, Any]:
    pools = stub_pools(url)
    pools["default"].update(prefill_gate_tokens=limit, **pool)
    return pools


async def gate_of(gw: RunningGateway) -> PrefillGate:
    (backend,) = gw.app.router.pools["default"].backends
    assert backend.gate is not None
    return backend.gate


async def test_no_gate_unless_configured(gateway: RunningGateway) -> None:
    (backend,) = gateway.app.router.pools["default"].backends
    assert backend.gate is None
    async with httpx.AsyncClient(base_url=gateway.url) as c:
        assert (await c.post("/v1/chat/completions", json=chat(stream=True))).status_code == 200
    async with httpx.AsyncClient(base_url=gateway.ops_url) as ops:
        assert "tokengate_prefill_gate" not in (await ops.get("/metrics")).text
        assert (await ops.get("/stats")).json()["prefill_gates"] == []


async def test_a_stream_leaves_the_gate_at_its_first_token(
    stub_backend: tuple[StubBackend, str], gateway_factory: GatewayFactory
) -> None:
    _, url = stub_backend
    gw = await gateway_factory({"pools": gated_pools(url, 16_000)})
    g = await gate_of(gw)
    req = await RawRequest.post(
        gw.url, "/v1/chat/completions", chat(stream=True), {"x-stub-chunks": "200", "x-stub-interval": "0.01"}
    )
    assert (await req.read_head())[0] == 200
    assert await req.read_some(64)
    await eventually(lambda: g.requests == 0)
    assert g.tokens == 0
    assert any((await gw.in_flight()).values())  # still streaming: the budgets still hold it
    await req.close()
    assert await gw.wait_idle() == ZERO
    assert (g.tokens, g.requests, g.waiting) == (0, 0, 0)


async def test_a_non_streaming_request_leaves_the_gate_at_the_end(
    stub_backend: tuple[StubBackend, str], gateway_factory: GatewayFactory
) -> None:
    stub, url = stub_backend
    gw = await gateway_factory({"pools": gated_pools(url, 16_000)})
    g = await gate_of(gw)
    async with httpx.AsyncClient(base_url=gw.url) as c:
        call = asyncio.create_task(
            c.post("/v1/chat/completions", json=chat(), headers={"x-stub-delay": "0.3"})
        )
        await eventually(lambda: len(stub.requests) == 1)
        assert g.requests == 1 and g.tokens > 0
        assert (await call).status_code == 200
    assert (g.tokens, g.requests) == (0, 0)
    assert await gw.wait_idle() == ZERO


async def test_a_request_waits_at_the_gate_and_its_wait_is_queue_time(
    stub_backend: tuple[StubBackend, str], gateway_factory: GatewayFactory
) -> None:
    stub, url = stub_backend
    # A 1-token gate: every prompt is larger than it, so each one goes alone.
    gw = await gateway_factory({"pools": gated_pools(url, 1)})
    g = await gate_of(gw)
    async with httpx.AsyncClient(base_url=gw.url) as c:
        first = asyncio.create_task(
            c.post("/v1/chat/completions", json=chat(), headers={"x-stub-delay": "0.4", "x-t": "first"})
        )
        await eventually(lambda: len(stub.requests) == 1)
        second = asyncio.create_task(c.post("/v1/chat/completions", json=chat(), headers={"x-t": "second"}))
        await eventually(lambda: g.waiting == 1)
        assert len(stub.requests) == 1  # held at the gateway, not sent
        r1, r2 = await first, await second
        assert r1.status_code == r2.status_code == 200
        assert float(r2.headers["x-tokengate-queue-ms"]) >= 200  # it waited out most of the first one
    async with httpx.AsyncClient(base_url=gw.ops_url) as ops:
        stats = (await ops.get("/stats")).json()
        metrics = (await ops.get("/metrics")).text
    (row,) = stats["prefill_gates"]
    assert (row["pool"], row["limit"], row["tokens"], row["waiting"], row["held_total"]) == (
        "default",
        1,
        0,
        0,
        1,
    )
    assert 'tokengate_prefill_gate_limit_tokens{backend="' in metrics
    assert "tokengate_prefill_gate_held_total" in metrics
    assert await gw.wait_idle() == ZERO


async def test_a_client_gone_while_waiting_at_the_gate_never_reaches_the_backend(
    stub_backend: tuple[StubBackend, str], gateway_factory: GatewayFactory
) -> None:
    stub, url = stub_backend
    gw = await gateway_factory({"pools": gated_pools(url, 1)})
    g = await gate_of(gw)
    holder = await RawRequest.post(gw.url, "/v1/chat/completions", chat(), {"x-stub-delay": "5"})
    await eventually(lambda: len(stub.requests) == 1)
    waiter = await RawRequest.post(gw.url, "/v1/chat/completions", chat(stream=True), {"x-t": "waiter"})
    await eventually(lambda: g.waiting == 1)
    await waiter.close()
    await eventually(lambda: g.waiting == 0)
    assert g.requests == 1
    await holder.close()
    assert await gw.wait_idle() == ZERO
    assert (g.tokens, g.requests, g.waiting) == (0, 0, 0)
    assert not any(r.headers.get("x-t") == "waiter" for r in stub.requests)


async def test_upstream_errors_release_the_gate(
    stub_backend: tuple[StubBackend, str], gateway_factory: GatewayFactory
) -> None:
    _, url = stub_backend
    gw = await gateway_factory({"pools": gated_pools(url, 16_000)})
    g = await gate_of(gw)
    async with httpx.AsyncClient(base_url=gw.url) as c:
        for stream in (False, True):
            r = await c.post(
                "/v1/chat/completions", json=chat(stream=stream), headers={"x-stub-status": "503"}
            )
            assert r.status_code == 502
        r = await c.post("/v1/chat/completions", json=chat(), headers={"x-stub-status": "400"})
        assert r.status_code == 400
    assert (g.tokens, g.requests, g.waiting) == (0, 0, 0)
    assert await gw.wait_idle() == ZERO


async def test_a_connect_failure_leaves_one_backends_gate_before_trying_the_next(
    stub_backend: tuple[StubBackend, str], gateway_factory: GatewayFactory
) -> None:
    stub, url = stub_backend
    gw = await gateway_factory(
        {
            "pools": dead_then_live(url, prefill_gate_tokens=1),
            "health": {"failure_threshold": 5, "cooldown_s": 60},
        }
    )
    async with httpx.AsyncClient(base_url=gw.url) as c:
        for stream in (False, True):
            r = await c.post("/v1/chat/completions", json=chat(stream=stream))
            assert r.status_code == 200, r.text
    assert len(stub.requests) == 2
    for b in gw.app.router.backends:
        assert b.gate is not None and (b.gate.tokens, b.gate.requests, b.gate.waiting) == (0, 0, 0), b.name
    assert await gw.wait_idle() == ZERO

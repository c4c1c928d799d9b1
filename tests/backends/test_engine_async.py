"""AsyncEngine: the step loop on an event loop, streaming, cancellation, failures."""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import AsyncIterator

import pytest

from backends.engine.async_engine import AsyncEngine, EngineDeadError
from backends.engine.clock import RealClock
from backends.engine.engine import Engine, RequestOutput
from backends.engine.kv_cache import BlockManager
from backends.engine.request import EngineRequest
from backends.engine.scheduler import Scheduler, SchedulerConfig
from backends.engine.sim_executor import CostModel, SimExecutor
from backends.engine.types import StepPlan, StepResult
from backends.reference.tokenizer import default_tokenizer
from tests.backends.conftest import prompt


def build(executor: SimExecutor | None = None, **kw: object) -> AsyncEngine:
    ex = executor or SimExecutor(num_blocks=512)
    sched = Scheduler(
        SchedulerConfig(max_model_len=2048), BlockManager(ex.num_blocks, ex.block_size), ex.eos_token_id
    )
    engine = Engine(sched, ex, RealClock(), decoder=default_tokenizer())
    return AsyncEngine(engine, **{"simulate_time": True, "time_scale": 0.0, **kw})  # type: ignore[arg-type]


@pytest.fixture
async def engine() -> AsyncIterator[AsyncEngine]:
    eng = build()
    await eng.start()
    yield eng
    await eng.stop()


async def collect(it: AsyncIterator[RequestOutput]) -> list[RequestOutput]:
    return [out async for out in it]


async def test_generate_streams_tokens_to_completion(engine: AsyncEngine) -> None:
    outs = await collect(engine.generate(EngineRequest("a", prompt(10), 12)))
    assert sum(len(o.new_token_ids) for o in outs) == 12
    assert outs[-1].finished and outs[-1].finish_reason == "length"
    assert "".join(o.text for o in outs).strip()
    assert engine.engine.scheduler.blocks.num_free_blocks == 512


async def test_many_concurrent_requests_all_finish_and_free(engine: AsyncEngine) -> None:
    results = await asyncio.gather(
        *(collect(engine.generate(EngineRequest(f"r{i}", prompt(5 + i, salt=i), 5 + i))) for i in range(40))
    )
    assert [r[-1].num_output_tokens for r in results] == [5 + i for i in range(40)]
    assert engine.engine.scheduler.blocks.num_used_blocks == 0


async def test_realtime_mode_sleeps_the_modelled_step_time() -> None:
    cm = CostModel(floor_s=0.01, per_token_s=0.0, decode_kv_s=0.0, prefill_pair_s=0.0)
    eng = build(SimExecutor(cm, num_blocks=512), time_scale=2.0)
    await eng.start()
    try:
        outs = await collect(eng.generate(EngineRequest("a", prompt(10), 5)))
    finally:
        await eng.stop()
    times = [t for o in outs for t in o.token_times]
    gaps = [b - a for a, b in itertools.pairwise(times)]
    assert len(gaps) == 4
    assert min(gaps) >= 0.02 * 0.95  # 10 ms x time_scale 2, never faster


async def test_cancelling_the_consumer_aborts_and_frees_blocks() -> None:
    eng = build(time_scale=1.0)  # ~6 ms steps: the request is still running when cancelled
    await eng.start()
    try:
        got_first = asyncio.Event()

        async def consume() -> None:
            async for _ in eng.generate(EngineRequest("a", prompt(100), 1000)):
                got_first.set()

        task = asyncio.create_task(consume())
        await asyncio.wait_for(got_first.wait(), 5)
        assert eng.engine.scheduler.blocks.num_used_blocks > 0
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert eng.engine.scheduler.get("a") is None
        assert eng.engine.scheduler.blocks.num_used_blocks == 0
    finally:
        await eng.stop()


async def test_closing_the_iterator_early_aborts(engine: AsyncEngine) -> None:
    it = engine.generate(EngineRequest("a", prompt(10), 1000))
    first = await it.__anext__()
    assert not first.finished
    await it.aclose()  # type: ignore[attr-defined]
    assert engine.engine.scheduler.get("a") is None
    assert engine.engine.scheduler.blocks.num_used_blocks == 0


async def test_invalid_request_raises_before_streaming(engine: AsyncEngine) -> None:
    with pytest.raises(ValueError, match="max_model_len"):
        engine.generate(EngineRequest("a", prompt(2000), 100))
    assert not engine.engine.has_unfinished()


class _Exploding(SimExecutor):
    def __init__(self) -> None:
        super().__init__(num_blocks=512)
        self.explode = True

    def execute(self, plan: StepPlan) -> StepResult:
        if self.explode:
            self.explode = False
            raise RuntimeError("boom")
        return super().execute(plan)


async def test_executor_failure_fails_its_requests_and_keeps_serving() -> None:
    eng = build(_Exploding())
    await eng.start()
    try:
        with pytest.raises(EngineDeadError, match="boom"):
            await collect(eng.generate(EngineRequest("a", prompt(10), 5)))
        outs = await collect(eng.generate(EngineRequest("b", prompt(10), 5)))
        assert outs[-1].finished
        assert eng.engine.scheduler.blocks.num_used_blocks == 0
    finally:
        await eng.stop()


class _Blocking(SimExecutor):
    """Stands in for a torch executor: blocking compute inside execute()."""

    def execute(self, plan: StepPlan) -> StepResult:
        started = time.monotonic()
        time.sleep(0.05)
        result = super().execute(plan)
        return StepResult(result.tokens, time.monotonic() - started)


async def test_offloaded_executor_does_not_block_the_event_loop() -> None:
    eng = build(_Blocking(num_blocks=512), simulate_time=False, offload=True)
    await eng.start()
    ticks = 0

    async def ticker() -> None:
        nonlocal ticks
        while True:
            await asyncio.sleep(0.005)
            ticks += 1

    tick_task = asyncio.create_task(ticker())
    try:
        outs = await collect(eng.generate(EngineRequest("a", prompt(10), 4)))
    finally:
        tick_task.cancel()
        await eng.stop()
    assert outs[-1].num_output_tokens == 4
    assert ticks >= 4  # the loop kept running during ~0.2 s of blocking steps


async def test_stop_fails_pending_streams() -> None:
    eng = build(time_scale=1.0)
    await eng.start()
    it = eng.generate(EngineRequest("a", prompt(10), 1000))
    await it.__anext__()
    await eng.stop()
    with pytest.raises(EngineDeadError):
        await it.__anext__()
    with pytest.raises(EngineDeadError):
        eng.generate(EngineRequest("b", prompt(10), 10))

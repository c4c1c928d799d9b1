"""Fixtures for the engine and the reference backend: sim engines on a virtual clock, and the
reference server on a real socket (uvicorn in the test's event loop)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import pytest

from backends.engine.clock import VirtualClock
from backends.engine.engine import Engine, RequestOutput
from backends.engine.kv_cache import BlockManager
from backends.engine.request import EngineRequest
from backends.engine.scheduler import Scheduler, SchedulerConfig
from backends.engine.sim_executor import CostModel, SimExecutor
from backends.reference.server import BackendSettings, ReferenceBackend, build_app
from backends.reference.tokenizer import default_tokenizer
from tests.conftest import Served, serve_asgi


@dataclass
class SimRig:
    engine: Engine
    scheduler: Scheduler
    executor: SimExecutor
    clock: VirtualClock
    outputs: dict[str, list[RequestOutput]] = field(default_factory=dict)

    @property
    def blocks(self) -> BlockManager:
        return self.scheduler.blocks

    def step(self) -> list[RequestOutput]:
        outs = self.engine.step()
        for out in outs:
            self.outputs.setdefault(out.request_id, []).append(out)
        return outs

    def run(self, max_steps: int = 100_000) -> None:
        for _ in range(max_steps):
            if not self.engine.has_unfinished():
                return
            self.step()
        raise AssertionError("engine did not finish")

    def drive(self, arrivals: Iterable[tuple[float, EngineRequest]], max_steps: int = 100_000) -> None:
        """Run to completion, adding each request at its virtual arrival time."""
        pending = sorted(arrivals, key=lambda a: a[0])
        for _ in range(max_steps):
            while pending and pending[0][0] <= self.clock.now():
                t, req = pending.pop(0)
                self.engine.add_request(req, arrival_time=t)
            if self.engine.has_unfinished():
                self.step()
            elif pending:
                self.clock.advance_to(pending[0][0])
            else:
                return
        raise AssertionError("engine did not finish")

    def tokens(self, request_id: str) -> list[int]:
        return [t for out in self.outputs.get(request_id, []) for t in out.new_token_ids]

    def text(self, request_id: str) -> str:
        return "".join(out.text for out in self.outputs.get(request_id, []))


def make_sim_rig(
    *,
    max_num_batched_tokens: int = 2048,
    max_num_seqs: int = 64,
    max_model_len: int = 1024,
    enable_chunked_prefill: bool = True,
    long_prefill_token_threshold: int = 0,
    max_num_partial_prefills: int = 1,
    max_long_partial_prefills: int = 1,
    policy: str = "fcfs",
    priority_scope: str = "step",
    priority_aging_s: float = 10.0,
    block_size: int = 16,
    num_blocks: int = 256,
    cost_model: CostModel | None = None,
    eos_after: int | None = None,
    with_text: bool = True,
) -> SimRig:
    config = SchedulerConfig(
        max_num_batched_tokens=max_num_batched_tokens,
        max_num_seqs=max_num_seqs,
        max_model_len=max_model_len,
        enable_chunked_prefill=enable_chunked_prefill,
        long_prefill_token_threshold=long_prefill_token_threshold,
        max_num_partial_prefills=max_num_partial_prefills,
        max_long_partial_prefills=max_long_partial_prefills,
        policy=policy,  # type: ignore[arg-type]
        priority_scope=priority_scope,  # type: ignore[arg-type]
        priority_aging_s=priority_aging_s,
    )
    executor = SimExecutor(cost_model, block_size=block_size, num_blocks=num_blocks, eos_after=eos_after)
    scheduler = Scheduler(config, BlockManager(num_blocks, block_size), executor.eos_token_id)
    clock = VirtualClock()
    decoder = default_tokenizer() if with_text else None
    engine = Engine(scheduler, executor, clock, decoder=decoder)
    return SimRig(engine, scheduler, executor, clock)


def prompt(n: int, salt: int = 0) -> list[int]:
    """A prompt of ``n`` valid cl100k ids; ``salt`` makes prompts (and so sim outputs) differ."""
    return [(1000 + salt * 7919 + i * 31) % 90000 + 100 for i in range(n)]


@pytest.fixture
def sim_rig() -> Callable[..., SimRig]:
    return make_sim_rig


@dataclass
class RunningBackend:
    url: str
    port: int
    backend: ReferenceBackend


@pytest.fixture
async def reference_server() -> AsyncIterator[Callable[..., Awaitable[RunningBackend]]]:
    """``await reference_server(**BackendSettings overrides)`` -> a live backend on a free port."""
    running: list[Served] = []

    async def start(**overrides: Any) -> RunningBackend:
        settings = BackendSettings(**{"time_scale": 0.02, "max_model_len": 4096, **overrides})
        app = build_app(settings)
        served = await serve_asgi(app)
        running.append(served)
        return RunningBackend(served.url, int(served.url.rsplit(":", 1)[1]), app.state.backend)

    yield start
    for served in reversed(running):
        await served.stop()

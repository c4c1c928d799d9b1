"""Shared helpers for the backends tests: the simulated rig's factory type, requests, a cost model."""

from __future__ import annotations

from collections.abc import Callable

from backends.engine.request import EngineRequest
from backends.engine.sim_executor import CostModel
from tests.backends.conftest import SimRig, prompt

RigFactory = Callable[..., SimRig]
# A cost model to recover by calibration.
TRUE = CostModel(floor_s=9.7e-3, knee_tokens=64, per_token_s=65e-6, decode_kv_s=80e-9, prefill_pair_s=2.5e-9)


def salt(rid: str) -> int:
    return sum(rid.encode())


def req(rid: str, n_prompt: int, max_tokens: int, **kw: object) -> EngineRequest:
    return EngineRequest(rid, prompt(n_prompt, salt=salt(rid)), max_tokens, **kw)  # type: ignore[arg-type]

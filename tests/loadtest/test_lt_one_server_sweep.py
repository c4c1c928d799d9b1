"""scripts/one_server_sweep.py: the gateway's admission modelled in front of the engine on a virtual
clock — a small plan goes through the budget and the real prefill gate, and every request completes."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "one_server_sweep.py"


def sweep() -> ModuleType:
    spec = importlib.util.spec_from_file_location("one_server_sweep", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("one_server_sweep", module)  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


PLAN = [(0.05 * i, 300 + 10 * i, 20, True) for i in range(30)] + [
    (0.1, 6_000, 10, False),
    (0.12, 6_000, 10, False),
    (0.14, 6_000, 10, False),
]


def test_the_gate_serialises_the_long_prompts_and_the_budget_queues_them() -> None:
    m = sweep()
    free = m.replay(m.Arm("queue"), PLAN)
    gated = m.replay(m.Arm("queue", gate=12_000, reserve=5_000), PLAN)  # lane 7,000: one at a time
    tight = m.replay(m.Arm("queue", gate=12_000, reserve=5_000, budget=6_010), PLAN)  # one in flight
    assert free["noisy_wait_p99"] == 0.0
    assert 0.0 < gated["noisy_wait_p99"] <= tight["noisy_wait_p99"]
    assert gated["victim_gate_p99"] == 0.0  # chat prompts fit in the reserve: they never wait
    for r in (free, gated, tight):
        assert r["victim_p99"] > 0 and r["tokens_per_s"] > 0

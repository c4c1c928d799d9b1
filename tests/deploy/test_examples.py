"""examples/: every file loads with tokengate's loader, and each engine example carries the backend
flags it assumes in a comment, consistent with the config (priority, context length)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from gateway.config.loader import load_config
from gateway.config.schema import DEFAULT_CONTEXT_LENGTH

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
ALL = sorted(EXAMPLES.glob("*.yaml"))
# The examples the deployment issue asks for -> the engine command their comment must show.
ENGINE_EXAMPLES = {
    "vllm.yaml": "vllm serve",
    "vllm-split-pools.yaml": "vllm serve",
    "sglang.yaml": "python -m sglang.launch_server",
    "tgi.yaml": "text-generation-launcher",
    "multi-tenant.yaml": "vllm serve",
}
CONTEXT_FLAGS = re.compile(r"--(?:max-model-len|context-length|max-total-tokens)\s+(\d+)")


def comments(path: Path) -> str:
    return "\n".join(line for line in path.read_text().splitlines() if line.lstrip().startswith("#"))


@pytest.mark.parametrize("path", ALL, ids=lambda p: p.name)
def test_every_example_loads_with_tokengates_loader(path: Path) -> None:
    load_config(path)


def test_the_engine_examples_exist() -> None:
    assert set(ENGINE_EXAMPLES) <= {p.name for p in ALL}


@pytest.mark.parametrize("name", sorted(ENGINE_EXAMPLES))
def test_each_engine_example_shows_the_backend_flags_it_assumes(name: str) -> None:
    path = EXAMPLES / name
    text = comments(path)
    config = load_config(path)
    assert ENGINE_EXAMPLES[name] in text
    assert config.pools and all(b.capacity_tokens > 0 for p in config.pools for b in p.backends)
    assert "capacity_tokens" in text, "say where capacity_tokens comes from"
    # Forwarding the tier as `priority` needs vLLM's priority scheduler, or vLLM rejects it.
    if any(b.accepts_priority for p in config.pools for b in p.backends):
        assert "--scheduling-policy priority" in text
    # The context length the config prices with is the longest the engines were started with.
    flags = [int(n) for n in CONTEXT_FLAGS.findall(text)]
    assert flags, "name the engine's context length flag"
    priced = max((m.context_length for m in config.models), default=DEFAULT_CONTEXT_LENGTH)
    assert max(flags) == priced


def test_the_multi_tenant_example_uses_every_tier_with_hashed_keys() -> None:
    config = load_config(EXAMPLES / "multi-tenant.yaml")
    assert {t.tier for t in config.tenants} == {t.name for t in config.tiers}
    assert all(k.startswith("sha256:") for t in config.tenants for k in t.keys)
    ceilings = [t.ceiling for t in config.tiers]
    assert ceilings == sorted(ceilings, reverse=True) and ceilings[-1] < 1.0

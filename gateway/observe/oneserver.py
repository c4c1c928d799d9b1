"""The one-server recipe: what to set when a pool shows head-of-line blocking and cannot be split.

Class pools remove head-of-line blocking completely, but a pool with a single backend has nothing
to split. There the controls have to work together on the one server:

- the engine caps each request's prefill chunk per step (vLLM ``--long-prefill-token-threshold``),
  so a long prompt can never take a whole step from the others — the control that matters most;
- the engine orders by priority and the gateway forwards each request's tier as ``priority``
  (``accepts_priority: true``), so the short class's tier goes first;
- the gateway's prefill gate (``prefill_gate_tokens`` on the pool) keeps several long prompts from
  prefilling at once and holds a long one back briefly while short ones prefill;
- the tenants' token budgets (already there) bound what the long class holds.

:func:`one_server_plans` finds the pools that need it (a hot head-of-line pair whose two classes
both run on a one-backend pool) and says, per setting, whether it is in effect: the gateway's own
settings from its config, the engine's from its ``/metrics`` where the engine exports them (the
reference backend's ``tokengate:scheduler_config_info``; vLLM, SGLang and TGI do not, so those are
"cannot tell").
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import yaml

from gateway.observe.hol import HolPair
from gateway.observe.scrape import BackendLoads
from gateway.observe.shape import ShapeTracker, plain

CHUNK_CAP = 512  # tokens of one request's prefill per step: measured ~1.8x solo p99 on one server
_SHORT_ROOM = 16  # the gate leaves room for a burst of this many median requests beside the largest one


@dataclass(frozen=True, slots=True)
class Setting:
    where: str  # engine name (vllm | sglang | tgi | reference) or "gateway"
    name: str  # the flag or the config key
    value: str
    why: str
    in_effect: bool | None = None  # None: the engine does not say
    seen: str | None = None  # what is set now, when known

    def as_dict(self) -> dict[str, Any]:
        return {
            "where": self.where,
            "name": self.name,
            "value": self.value,
            "why": self.why,
            "in_effect": self.in_effect,
            "seen": self.seen,
        }

    @property
    def state(self) -> str:
        if self.in_effect is True:
            return "in effect"
        if self.in_effect is False:
            return "not set" + (f"; now {self.seen}" if self.seen else "")
        return "cannot tell from its /metrics"

    def words(self) -> str:
        return f"{self.name} {self.value}".strip() + f" ({self.state})"


@dataclass(frozen=True, slots=True)
class OneServerPlan:
    pool: str
    backend: str
    url: str
    victim: str
    aggressor: str
    correlation: float
    engine: str  # reference | vllm | sglang | tgi | unknown
    engine_settings: tuple[Setting, ...]
    gateway_settings: tuple[Setting, ...]
    gate_tokens: int  # the suggested prefill_gate_tokens
    notes: tuple[str, ...] = ()

    @property
    def settings(self) -> tuple[Setting, ...]:
        return self.engine_settings + self.gateway_settings

    @property
    def all_in_effect(self) -> bool:
        return all(s.in_effect is True for s in self.settings)

    def as_dict(self) -> dict[str, Any]:
        return {
            "pool": self.pool,
            "backend": self.backend,
            "victim": self.victim,
            "aggressor": self.aggressor,
            "correlation": round(self.correlation, 4),
            "engine": self.engine,
            "engine_settings": [s.as_dict() for s in self.engine_settings],
            "gateway_settings": [s.as_dict() for s in self.gateway_settings],
            "prefill_gate_tokens": self.gate_tokens,
            "notes": list(self.notes),
            "all_in_effect": self.all_in_effect,
            "text": self.finding(),
        }

    def to_yaml(self, pools: Mapping[str, Mapping[str, Any]]) -> str:
        """The gateway edit as a config fragment, the engine flags and the reasons as comments."""
        flags = " ".join(f"{s.name} {s.value}".strip() for s in self.engine_settings)
        head = [
            f"# tokengate one-server advice for pool {self.pool!r}: one backend, so it cannot be split",
            f"# head-of-line: class {self.victim}'s p99 TTFT follows class {self.aggressor} "
            f"(r={self.correlation:.2f})",
            f"# 1. engine ({self.engine}): start it with {flags}",
        ]
        head += [f"#    {s.name}: {s.why} [{s.state}]" for s in self.engine_settings]
        head += [
            "# 2. gateway: forward tier priority and gate long prefills (below); keep the tenants that send",
            f"#    class {self.aggressor} in a lower tier (e.g. batch) than those of class {self.victim}",
        ]
        head += [f"# NOTE: {n}" for n in self.notes]
        pool = {k: plain(v) for k, v in (pools.get(self.pool) or {}).items()}
        backends = [dict(plain(b)) for b in pool.get("backends", [])]
        for b in backends:
            if (b.get("name") or b.get("url")) == self.backend or b.get("url") == self.url:
                b["accepts_priority"] = True
        pool["backends"] = backends
        pool["prefill_gate_tokens"] = self.gate_tokens
        body = yaml.safe_dump({"pools": {self.pool: pool}}, sort_keys=False, default_flow_style=None)
        return "\n".join(head) + "\n" + body

    def finding(self) -> str:
        engine = "; ".join(s.words() for s in self.engine_settings)
        gateway = "; ".join(s.words() for s in self.gateway_settings)
        return (
            f"pool {self.pool} has one backend, so class {self.aggressor} cannot be moved off class "
            f"{self.victim}'s server: make the one server safe instead. Engine ({self.engine}): {engine}. "
            f"Gateway: {gateway}; and keep class {self.aggressor}'s tenants in a lower tier than class "
            f"{self.victim}'s. GET /insights?format=yaml has the edit."
        )


def suggested_gate_tokens(max_cost: int | None, median_cost: float | None) -> int:
    """Room for the largest request seen plus a burst of median ones (the short prompts that arrive
    while it prefills must not wait at the gate), but less than two of the largest: a second long
    prompt never prefills beside the first. Rounded up to a thousand."""
    if not max_cost:
        return 32_000
    room = _SHORT_ROOM * (median_cost or 0.0)
    gate = int(math.ceil((max_cost + room) / 1000.0) * 1000)
    below_two = (2 * max_cost - 1) // 1000 * 1000
    return max(min(gate, below_two), max_cost)


def _engine_settings(engine: str, sched: Mapping[str, str] | None) -> tuple[list[Setting], list[str]]:
    """The head-of-line flags for ``engine`` and whether its exported settings show them."""
    notes: list[str] = []
    cap_why = "caps each request's prefill chunk per step, so a long prompt never takes a whole step"
    if engine == "sglang":
        return [
            Setting("sglang", "--chunked-prefill-size", str(CHUNK_CAP), "the largest prefill chunk of one pass; "
                    "smaller bounds the stall a long prompt causes, at some prefill throughput"),
            Setting("sglang", "--enable-priority-scheduling", "", "orders requests by their priority"),
            Setting("sglang", "--schedule-low-priority-values-first", "",
                    "SGLang runs higher values first by default; the gateway sends lower = more important"),
        ], notes  # fmt: skip
    if engine == "tgi":
        notes.append("TGI has no request priority: leave accepts_priority off on this backend")
        return [
            Setting("tgi", "--max-batch-prefill-tokens", "2048",
                    "bounds the prompt tokens of one prefill batch (TGI 3 chunks longer prompts to it)"),
        ], notes  # fmt: skip
    where = "reference" if engine == "reference" else "vllm"
    cap = Setting(where, "--long-prefill-token-threshold", str(CHUNK_CAP), cap_why)
    prio = Setting(
        where,
        "--scheduling-policy",
        "priority",
        "serves the forwarded priority first"
        + (
            " inside every step; a long low-priority prefill sits out the steps a higher one prefills in"
            if where == "reference"
            else " when it admits waiting requests (vLLM v1 still runs a started long prefill first: "
            "the chunk cap is what bounds that)"
        ),
    )
    if sched is not None:
        threshold = _int(sched.get("long_prefill_token_threshold"))
        cap = _seen(cap, threshold is not None and 0 < threshold <= 2 * CHUNK_CAP, f"{threshold}")
        policy = f"{sched.get('scheduling_policy')} (scope {sched.get('priority_scope')})"
        prio = _seen(
            prio,
            sched.get("scheduling_policy") == "priority" and sched.get("priority_scope") == "step",
            policy,
        )
    if where == "vllm":
        notes.append(
            "vLLM's --max-num-partial-prefills / --max-long-partial-prefills work only on its v0 engine "
            "(v1 refuses them at start-up); the prefill gate does that job from the gateway"
        )
    return [cap, prio], notes


def _seen(s: Setting, ok: bool, now: str) -> Setting:
    return Setting(s.where, s.name, s.value, s.why, ok, now)


def _int(v: str | None) -> int | None:
    try:
        return int(v) if v is not None else None
    except ValueError:
        return None


def one_server_plans(
    pairs: Sequence[HolPair],
    *,
    threshold: float,
    min_windows: int,
    shape: ShapeTracker,
    pools: Mapping[str, Mapping[str, Any]],
    loads: BackendLoads,
) -> list[OneServerPlan]:
    """One plan per one-backend pool on which a hot head-of-line pair's two classes both run.

    ``pools`` is the configured pools in config-file shape (``ConfigView.pools``).
    """
    out: list[OneServerPlan] = []
    done: set[str] = set()
    hot = sorted(
        (p for p in pairs if p.windows >= min_windows and p.score >= threshold), key=lambda p: -p.score
    )
    for pair in hot:
        for pool in shape.pools():
            if pool in done:
                continue
            seen = {k for _, k in shape.samples(pool)}
            spec = pools.get(pool) or {}
            backends = list(spec.get("backends") or [])
            if pair.victim not in seen or pair.aggressor not in seen or len(backends) != 1:
                continue
            done.add(pool)
            b = backends[0]
            url = str(b.get("url", ""))
            name = str(b.get("name") or url)
            load = loads.get(name)
            sample = load.sample if load is not None else None
            sched = sample.scheduler if sample is not None else None
            engine = (
                "reference" if sched is not None else (sample.flavor if sample is not None else "unknown")
            )
            engine_settings, notes = _engine_settings(engine, sched)
            reading = shape.reading(pool)
            gate_tokens = suggested_gate_tokens(reading.max_cost, reading.median_cost)
            configured = spec.get("prefill_gate_tokens")
            gateway_settings = [
                Setting(
                    "gateway",
                    f"pools.{pool}.prefill_gate_tokens:",
                    str(gate_tokens),
                    "one long prompt prefills at a time; short ones pass it",
                    configured is not None,
                    None if configured is None else str(configured),
                )
            ]
            if engine != "tgi":
                gateway_settings.append(
                    Setting(
                        "gateway",
                        f"accepts_priority: true on backend {name}",
                        "",
                        "the gateway sends each request's tier rank as `priority` (lower runs first)",
                        bool(b.get("accepts_priority")),
                    )
                )
            out.append(
                OneServerPlan(
                    pool=pool,
                    backend=name,
                    url=url,
                    victim=pair.victim,
                    aggressor=pair.aggressor,
                    correlation=pair.score,
                    engine=engine,
                    engine_settings=tuple(engine_settings),
                    gateway_settings=tuple(gateway_settings),
                    gate_tokens=gate_tokens,
                    notes=tuple(notes),
                )
            )
    return out

"""The one-server recipe: what to set when a pool shows head-of-line blocking and cannot be split.

Class pools remove head-of-line blocking completely, but a pool with a single backend has nothing
to split. There the controls have to work together on the one server:

- the engine caps each request's prefill chunk per step (vLLM ``--long-prefill-token-threshold``),
  so a long prompt can never take a whole step from the others — the control that matters most;
- the engine orders by priority and the gateway forwards each request's tier as ``priority``
  (``accepts_priority: true``), so the short class's tier goes first;
- the gateway's prefill gate (``prefill_gate_tokens`` on the pool) keeps several long prompts from
  prefilling at once, and its reserve (``prefill_gate_reserve_tokens``) keeps room that only short
  prompts use, so a short prompt never waits for a long one. :func:`suggested_gate` sizes both from
  recent traffic: the lane (gate less reserve) at the largest request, so long prompts prefill one at
  a time; the reserve at the short class's largest request plus the short tokens that arrive while
  one of them is inside the gate (their arrival rate times their p99 time to first token, at most
  ``MAX_STAY_S``), and at least the most short tokens the gate let in within one second when it is
  on (its own measurements then replace the estimates);
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
_SHORT_ROOM = 16  # without a short-class arrival rate: room for a burst of this many median requests
# The longest a short prompt is counted as staying inside the gate (its first token): its p99 TTFT
# when head-of-line blocked is what the recipe removes, so it must not inflate the reserve.
MAX_STAY_S = 1.0


@dataclass(frozen=True, slots=True)
class ShortLoad:
    """What sizes the gate's reserve: the short class's largest request (tokens), the tokens per second
    it sends, and how long one stays inside the gate (its p99 time to first token). None: unknown."""

    max_tokens: int | None = None
    tokens_per_s: float | None = None
    stay_s: float | None = None
    source: str = "recent requests"
    burst_tokens: int | None = None  # the most tokens it sent within one second, when known


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
    gate_reserve: int | None = None  # the suggested prefill_gate_reserve_tokens (None: the default)

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
            "prefill_gate_reserve_tokens": self.gate_reserve,
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
        if self.gate_reserve is not None:
            pool["prefill_gate_reserve_tokens"] = self.gate_reserve
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


def _thousands(v: float) -> int:
    return int(math.ceil(v / 1000.0) * 1000)


def suggested_gate(
    max_cost: int | None, short: ShortLoad, median_cost: float | None = None
) -> tuple[int, int | None]:
    """``(prefill_gate_tokens, prefill_gate_reserve_tokens)``: a lane for the largest request (one
    long prompt prefills at a time: the lane stays below two of them) and a reserve for the short
    class's largest request plus the short tokens that arrive while one stays inside the gate
    (``tokens_per_s`` x ``stay_s``, ``stay_s`` at most ``MAX_STAY_S``; without a rate, a burst of
    ``_SHORT_ROOM`` median requests), and at least ``burst_tokens`` (the most it sent within one
    second, which the gate measures). Rounded up to thousands, and at most half the lane: a prompt
    that fits in the reserve counts as short, so a reserve as large as the long prompts would let
    them in as short ones, and short prompts would wait behind them. Without the short class's largest
    request: the old single size, and the default reserve (None)."""
    if not max_cost or not short.max_tokens:
        return suggested_gate_tokens(max_cost, median_cost), None
    lane = max(min(_thousands(max_cost), (2 * max_cost - 1) // 1000 * 1000), max_cost)
    if short.tokens_per_s is not None and short.stay_s is not None:
        burst = short.tokens_per_s * min(short.stay_s, MAX_STAY_S)
    else:
        burst = _SHORT_ROOM * (median_cost or 0.0)
    reserve = _thousands(max(short.max_tokens + burst, short.burst_tokens or 0))
    # A prompt that fits in the reserve is short: the long prompts must stay well above it.
    reserve = max(1000, min(reserve, lane // 2 // 1000 * 1000))
    return lane + reserve, reserve


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
    short_loads: Mapping[str, ShortLoad] | None = None,
    gates: Mapping[str, Mapping[str, Any]] | None = None,
) -> list[OneServerPlan]:
    """One plan per one-backend pool on which a hot head-of-line pair's two classes both run.

    ``pools`` is the configured pools in config-file shape (``ConfigView.pools``); ``short_loads``
    the victim classes' arrival rates and times to first token (by class); ``gates`` the prefill
    gates' ``/stats`` rows by backend name: where the backend has one, its short prompts' own
    measurements size the reserve.
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
            short = _short_load(pair.victim, shape.samples(pool), (short_loads or {}).get(pair.victim))
            gate_row = (gates or {}).get(name)
            measured = (gate_row or {}).get("short") or {}
            if measured.get("max_tokens") and measured.get("tokens_per_s") is not None:
                short = ShortLoad(
                    int(measured["max_tokens"]),
                    float(measured["tokens_per_s"]),
                    measured.get("inside_p99_s"),
                    "the gate's short prompts",
                    measured.get("burst_tokens_1s"),
                )
            gate_tokens, reserve = suggested_gate(reading.max_cost, short, reading.median_cost)
            if reading.max_cost:
                notes.append(
                    f"keep the budgets of class {pair.aggressor}'s tenants large enough for the requests "
                    f"they send at once (each up to {reading.max_cost:,} tokens): the gate already "
                    "prefills them one at a time, so a tighter budget barely helps the short class and "
                    "makes them wait at the gateway (loadtest/README.md, one_server_sustained)"
                )
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
            if reserve is not None:
                now = _effective_reserve(spec)
                gateway_settings.append(
                    Setting(
                        "gateway",
                        f"pools.{pool}.prefill_gate_reserve_tokens:",
                        str(reserve),
                        f"room only short prompts use, so none waits for a long one: class {pair.victim}'s "
                        f"largest request ({short.max_tokens:,} tokens) plus what it sends while one is "
                        f"inside the gate (from {short.source})",
                        now is not None and now >= reserve,
                        None if now is None else str(now),
                    )
                )
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
                    gate_reserve=reserve,
                )
            )
    return out


def _short_load(victim: str, samples: Sequence[tuple[int, str]], load: ShortLoad | None) -> ShortLoad:
    """The victim class's largest recent request from the pool's samples, with its rate and stay."""
    costs = [c for c, k in samples if k == victim]
    biggest = max(costs) if costs else None
    if load is None:
        return ShortLoad(biggest)
    return ShortLoad(biggest, load.tokens_per_s, load.stay_s, load.source)


def _effective_reserve(spec: Mapping[str, Any]) -> int | None:
    """The pool's gate reserve now: configured, or a quarter of its gate (None: no gate)."""
    gate = spec.get("prefill_gate_tokens")
    if gate is None:
        return None
    reserve = spec.get("prefill_gate_reserve_tokens")
    return int(reserve) if reserve is not None else int(gate) // 4

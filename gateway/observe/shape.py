"""Shape ratio per pool (largest / median request cost) and the config change that would split it.

One pool serving 200-token chats and 30,000-token reasoning prompts is two services sharing one
batch: every long prefill stalls the short decodes. The ratio of the largest to the median cost
over a sliding window of recent requests says how mixed a pool is:

- ratio < ``split_at`` (10x): fine;
- ``split_at`` <= ratio < ``two_services_at`` (50x): plan a split;
- ratio >= ``two_services_at``: this is two services in one pool.

:func:`split_plan` turns the window into a concrete edit of ``classes`` and ``pools``: the cost
cut that best separates the two groups (two-cluster split of log cost), the rules to add, and
how to share the pool's backends. It only proposes; the operator applies it.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import yaml

from gateway.observe.settings import ShapeSettings

ADVICE_WORDS = {0: "fine", 1: "plan a split", 2: "two services in one pool"}


@dataclass(frozen=True, slots=True)
class ShapeReading:
    pool: str
    requests: int
    median_cost: float | None
    max_cost: int | None
    ratio: float | None
    advice: int  # 0 fine, 1 plan a split, 2 two services in one pool

    @property
    def advice_words(self) -> str:
        return ADVICE_WORDS[self.advice]

    def as_dict(self) -> dict[str, Any]:
        return {
            "pool": self.pool,
            "requests": self.requests,
            "median_cost": self.median_cost,
            "max_cost": self.max_cost,
            "ratio": None if self.ratio is None else round(self.ratio, 2),
            "advice": self.advice,
            "advice_words": self.advice_words,
        }


class ShapeTracker:
    """The last ``window_requests`` admitted costs per pool, with their class names."""

    def __init__(self, settings: ShapeSettings) -> None:
        self.settings = settings
        self._pools: dict[str, deque[tuple[int, str]]] = {}

    def record(self, pool: str, klass: str, cost: int) -> None:
        q = self._pools.get(pool)
        if q is None:
            q = self._pools[pool] = deque(maxlen=self.settings.window_requests)
        q.append((cost, klass))

    def pools(self) -> list[str]:
        return sorted(self._pools)

    def samples(self, pool: str) -> list[tuple[int, str]]:
        return list(self._pools.get(pool, ()))

    def reading(self, pool: str) -> ShapeReading:
        costs = sorted(c for c, _ in self._pools.get(pool, ()))
        return reading_of(pool, costs, self.settings)

    def readings(self) -> list[ShapeReading]:
        return [self.reading(p) for p in self.pools()]


def reading_of(pool: str, sorted_costs: Sequence[int], s: ShapeSettings) -> ShapeReading:
    n = len(sorted_costs)
    if n == 0:
        return ShapeReading(pool, 0, None, None, None, 0)
    mid = n // 2
    median = float(sorted_costs[mid]) if n % 2 else (sorted_costs[mid - 1] + sorted_costs[mid]) / 2
    top = sorted_costs[-1]
    ratio = top / median if median > 0 else None
    advice = 0
    if ratio is not None and n >= s.min_requests:
        advice = 2 if ratio >= s.two_services_at else 1 if ratio >= s.split_at else 0
    return ShapeReading(pool, n, median, top, ratio, advice)


def best_cut(costs: Sequence[int]) -> int | None:
    """The cost that best separates the window into a small and a large group.

    Two-cluster split (Otsu / 1-D k-means with k=2) of log cost: maximise the between-group
    variance. Returns the smallest cost of the large group, or None when all costs are equal.
    """
    xs = sorted(math.log(max(c, 1)) for c in costs)
    n = len(xs)
    if n < 2 or xs[0] == xs[-1]:
        return None
    total = sum(xs)
    left = 0.0
    best_i, best_v = 0, -1.0
    for i in range(1, n):
        left += xs[i - 1]
        if xs[i] == xs[i - 1]:
            continue
        m0 = left / i
        m1 = (total - left) / (n - i)
        v = i * (n - i) * (m1 - m0) ** 2
        if v > best_v:
            best_i, best_v = i, v
    cut = sorted(costs)[best_i]
    return _round_down_nice(cut)


def _round_down_nice(v: int) -> int:
    """Two significant digits, rounded down: 12_345 -> 12_000, so the rule reads like a choice."""
    if v < 100:
        return v
    mag = 10 ** (len(str(v)) - 2)
    return (v // mag) * mag


@dataclass(frozen=True, slots=True)
class SplitPlan:
    pool: str
    new_pool: str
    cut_cost: int
    moved_classes: list[str]  # whole classes moved (when a class boundary explains the cut)
    share_requests: float  # of the window, going to the new pool
    share_tokens: float
    classes: list[dict[str, Any]]
    pools: dict[str, Any]
    notes: list[str] = field(default_factory=list)

    def to_yaml(self, reading: ShapeReading | None = None) -> str:
        head = [f"# tokengate split advice for pool {self.pool!r}"]
        if reading is not None and reading.ratio is not None:
            head.append(
                f"# largest/median request cost = {reading.ratio:.0f}x over the last {reading.requests}"
                f" requests ({reading.advice_words})"
            )
        if self.moved_classes:
            head.append(f"# move class(es) {', '.join(self.moved_classes)} to a new pool {self.new_pool!r}")
        else:
            head.append(f"# requests costing >= {self.cut_cost} tokens go to a new pool {self.new_pool!r}")
        head.append(
            f"# that is {self.share_requests:.0%} of requests and {self.share_tokens:.0%} of tokens;"
            " edit `classes` and `pools` only"
        )
        head += [f"# NOTE: {n}" for n in self.notes]
        body = yaml.safe_dump(
            {"classes": self.classes, "pools": self.pools}, sort_keys=False, default_flow_style=None
        )
        return "\n".join(head) + "\n" + body

    def as_dict(self) -> dict[str, Any]:
        return {
            "pool": self.pool,
            "new_pool": self.new_pool,
            "cut_cost": self.cut_cost,
            "moved_classes": self.moved_classes,
            "share_requests": round(self.share_requests, 4),
            "share_tokens": round(self.share_tokens, 4),
            "notes": self.notes,
        }


def split_plan(
    pool: str,
    samples: Sequence[tuple[int, str]],
    rules: Sequence[Mapping[str, Any]],
    pools: Mapping[str, Mapping[str, Any]],
) -> SplitPlan | None:
    """Propose the ``classes`` + ``pools`` edit that splits ``pool`` at the best cost cut.

    ``rules`` are the configured class rules (``{name, when, pool, ...}``, first match wins) and
    ``pools`` the configured pools (``{name: {backends: [{url, capacity_tokens, ...}]}}``), both as
    plain mappings in config-file shape. Returns None when there is nothing to split.
    """
    cut = best_cut([c for c, _ in samples])
    if cut is None:
        return None
    big = [(c, k) for c, k in samples if c >= cut]
    if not big or len(big) == len(samples):
        return None
    total_tokens = sum(c for c, _ in samples) or 1
    share_req = len(big) / len(samples)
    share_tok = sum(c for c, _ in big) / total_tokens
    new_pool = _fresh_name(f"{pool}-long", pools)

    # If whole classes sit (almost) entirely above the cut and nothing else does, moving those
    # classes is the smallest, clearest edit.
    by_class: dict[str, list[int]] = {}
    for c, k in samples:
        by_class.setdefault(k, []).append(c)
    above = {k for k, cs in by_class.items() if sum(1 for c in cs if c >= cut) / len(cs) >= 0.9}
    stray = sum(1 for c, k in big if k not in above)
    moved = sorted(above) if above and stray <= 0.1 * len(big) and len(above) < len(by_class) else []
    # Only a class with a rule routing to this pool can be moved by name (``default`` has none).
    if not set(moved) <= {r.get("name") for r in rules if r.get("pool") == pool}:
        moved = []

    new_rules: list[dict[str, Any]] = []
    for r in rules:
        rd = {k: plain(v) for k, v in r.items()}
        if rd.get("pool") != pool:
            new_rules.append(rd)
            continue
        if moved:
            if rd.get("name") in moved:
                rd["pool"] = new_pool
            new_rules.append(rd)
            continue
        when = dict(rd.get("when") or {})
        if int(when.get("min_cost", 0) or 0) >= cut:
            rd["pool"] = new_pool
            new_rules.append(rd)
            continue
        long_rule = dict(rd)
        long_rule["name"] = f"{rd.get('name', 'class')}-long"
        long_rule["when"] = {**when, "min_cost": cut}
        long_rule["pool"] = new_pool
        new_rules.append(long_rule)
        new_rules.append(rd)

    backends = [dict(plain(b)) for b in (pools.get(pool) or {}).get("backends", [])]
    if not any(r.get("pool") == new_pool for r in new_rules):
        # No rule names this pool (no classes at all, or its requests fall through to the model's
        # pool): without a rule of its own the new pool would get nothing.
        _add_long_rule(new_rules, pool, new_pool, cut, backends, len(pools))

    notes: list[str] = []
    if len(backends) >= 2:
        n_new = min(len(backends) - 1, max(1, round(len(backends) * share_tok)))
        keep, give = backends[: len(backends) - n_new], backends[len(backends) - n_new :]
    else:
        keep = backends
        give = [{"url": "http://CHANGE-ME:8000", "capacity_tokens": _capacity(backends)}]
        notes.append(
            f"pool {pool!r} has {len(backends)} backend(s): add a backend for {new_pool!r} "
            "(or move one from another pool) and replace the CHANGE-ME url"
        )
    new_pools: dict[str, Any] = {}
    for name, spec in pools.items():
        new_pools[name] = {**plain(spec), "backends": keep} if name == pool else plain(spec)
    new_pools[new_pool] = {**plain(pools.get(pool) or {}), "backends": give}
    return SplitPlan(
        pool=pool,
        new_pool=new_pool,
        cut_cost=cut,
        moved_classes=moved,
        share_requests=share_req,
        share_tokens=share_tok,
        classes=new_rules,
        pools=new_pools,
        notes=notes,
    )


def _add_long_rule(
    rules: list[dict[str, Any]],
    pool: str,
    new_pool: str,
    cut: int,
    backends: Sequence[Mapping[str, Any]],
    n_pools: int,
) -> None:
    """A rule sending requests costing >= ``cut`` to ``new_pool``: before the first rule that matches
    everything or sends requests to their model's pool (either may be how requests reach ``pool``),
    else last. With other pools configured it names the pool's models when its backends list them,
    so other pools' long requests stay where they are."""
    taken = {r.get("name") for r in rules}
    name = _fresh_name("long", {n: None for n in taken if isinstance(n, str)})
    when: dict[str, Any] = {"min_cost": cut}
    models = sorted({m for b in backends for m in b.get("models") or ()})
    if n_pools > 1 and models:
        when["models"] = models
    rule = {"name": name, "when": when, "pool": new_pool}
    at = next((i for i, r in enumerate(rules) if not r.get("when") or r.get("pool") is None), len(rules))
    rules.insert(at, rule)


def _capacity(backends: Sequence[Mapping[str, Any]]) -> int:
    caps = [int(b.get("capacity_tokens", 0) or 0) for b in backends]
    return max(caps) if caps and max(caps) > 0 else 100_000


def _fresh_name(base: str, taken: Mapping[str, Any]) -> str:
    name, i = base, 2
    while name in taken:
        name, i = f"{base}{i}", i + 1
    return name


def plain(v: Any) -> Any:
    """Deep-copy into plain dict/list/scalars so yaml.safe_dump can write it."""
    if isinstance(v, Mapping):
        return {str(k): plain(x) for k, x in v.items()}
    if isinstance(v, list | tuple):
        return [plain(x) for x in v]
    return v

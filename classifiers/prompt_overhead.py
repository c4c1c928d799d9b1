"""Per-model prompt overhead: what an engine counts in a prompt beyond what pricing counted.

Pricing counts a chat prompt's text with an offline tokenizer (``classifiers.pricing``). The engine
renders the model's chat template first, which adds a system prompt and special tokens (a "hello"
chat priced 16 tokens is 39 to vLLM and llama.cpp), or renders tool definitions more compactly
than pricing counts them (priced 69–76, counted 41). Such an error is the same for every request
of a model and route, so the gateway measures it from the usage engines report and corrects
prices by it. Pure bookkeeping: no I/O, no clock, one event loop.

Learning (:meth:`PromptOverheads.observe`), per (model, route): each completed request whose
usage came from the engine gives a sample ``reported - priced``. A sample counts only when it is
plausible: ``priced >= 1``, ``reported >= 1``, ``reported >= priced / 4`` and
``reported <= 2 * priced + 1024`` (an engine that reports no prompt, a tenth of it, or a multiple
of a large one is reporting something else: a usage field it does not fill, a server-side
conversation, a media item priced at its most); other samples are counted as ``rejected``. The
estimate is an exponentially decayed mean with a half-life of ``half_life`` samples (a sample
``half_life`` requests old weighs half as much as the newest), unbiased from the first sample (a
weighted mean). At most ``max_keys`` (model, route) pairs are kept; samples of others are not
learned (counted in ``untracked``).

Applying (:meth:`PromptOverheads.overhead`, :func:`corrected`): a configured overhead
(``models.<glob>.prompt_overhead_tokens``) on the routes a chat template renders (chat,
responses); else the learned one, rounded and bounded to ``±MAX_LEARNED`` (the samples come from
every tenant: one tenant's unusual prompts must not move everyone's prices far), once it has
``min_samples`` samples and learning is on for the model; else 0. A positive overhead is added to the priced prompt. A negative one (the
engine counts fewer tokens than pricing) lowers it, but never below half of the priced prompt: the
floor keeps one unusual request from being admitted at a fraction of what it holds.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

# Routes whose prompt the engine renders through the model's chat template (a configured overhead
# applies to them only): the values of gateway.request.exchange.RouteKind.
TEMPLATE_ROUTES = frozenset({"chat", "responses"})

HALF_LIFE = 64  # samples
MIN_SAMPLES = 8  # before a learned overhead is applied
MAX_KEYS = 256  # (model, route) pairs learned
# The most a learned overhead moves a price, either way. A chat template adds tens of tokens; the
# samples come from every tenant's traffic, so without a bound one tenant's prompts that the
# engine's tokenizer counts far above the offline one (within the plausibility window) would raise
# every other tenant's prices for the model. A larger real overhead is set in the config.
MAX_LEARNED = 128
# Plausible samples: reported within [priced / 4, 2 * priced + _SLACK].
_SLACK = 1024


class OverheadSetting(NamedTuple):
    """A model's configured prompt-overhead settings (the first ``models`` glob matching it)."""

    configured: int | None = None  # models.<glob>.prompt_overhead_tokens; None: not set
    learn: bool = True  # models.<glob>.learn_prompt_overhead
    pattern: str | None = None  # the glob that matched; None: no entry matches the model


NO_SETTING = OverheadSetting()


def plausible(priced: int, reported: int) -> bool:
    """Whether an engine's prompt count can be the priced prompt plus a template's overhead."""
    return priced >= 1 and reported >= 1 and 4 * reported >= priced and reported <= 2 * priced + _SLACK


def corrected(priced: int, overhead: int) -> int:
    """The priced prompt with ``overhead`` applied: added when positive; when negative, never below
    half of the priced prompt (rounded up)."""
    if overhead >= 0:
        return priced + overhead
    return max(priced + overhead, (priced + 1) // 2)


@dataclass(slots=True)
class ModelOverhead:
    """One (model, route)'s decayed sums; each mean is its sum over ``weight``."""

    samples: int = 0  # plausible samples seen
    rejected: int = 0  # implausible samples ignored
    weight: float = 0.0  # decayed count of samples
    priced: float = 0.0  # decayed sum of priced prompts
    reported: float = 0.0  # ... of engine-reported prompts
    error_before: float = 0.0  # ... of |reported - priced|
    error_after: float = 0.0  # ... of |reported - charged| (the prompt price admitted, corrected)

    def add(self, priced: int, reported: int, charged: int, decay: float) -> None:
        self.samples += 1
        self.weight = self.weight * decay + 1.0
        self.priced = self.priced * decay + priced
        self.reported = self.reported * decay + reported
        self.error_before = self.error_before * decay + abs(reported - priced)
        self.error_after = self.error_after * decay + abs(reported - charged)

    def mean(self, total: float) -> float:
        return total / self.weight if self.weight else 0.0

    @property
    def difference(self) -> float:
        """The decayed mean of ``reported - priced``."""
        return self.mean(self.reported - self.priced)

    @property
    def learned(self) -> int:
        """The difference rounded to whole tokens (halves away from zero)."""
        d = self.difference
        return math.floor(d + 0.5) if d >= 0 else -math.floor(-d + 0.5)


class PromptOverheads:
    """The learned prompt overhead of each (model, route) and the rule that applies it."""

    def __init__(
        self, *, half_life: int = HALF_LIFE, min_samples: int = MIN_SAMPLES, max_keys: int = MAX_KEYS
    ) -> None:
        if half_life < 1 or min_samples < 1 or max_keys < 0:
            raise ValueError("half_life and min_samples must be >= 1, max_keys >= 0")
        self.half_life = half_life
        self.min_samples = min_samples
        self.max_keys = max_keys
        self._decay = 0.5 ** (1.0 / half_life)
        self._by_key: dict[tuple[str, str], ModelOverhead] = {}
        self.untracked = 0  # plausible samples of (model, route) pairs beyond max_keys

    def __len__(self) -> int:
        return len(self._by_key)

    def get(self, model: str, route: str) -> ModelOverhead | None:
        return self._by_key.get((model, route))

    def observe(self, model: str, route: str, priced: int, reported: int, charged: int | None = None) -> bool:
        """One completed request: the prompt as priced (before any correction), as the engine
        reported it, and as admitted (``charged``, the corrected price; default ``priced``).
        Returns whether the sample was learned."""
        key = (model, route)
        entry = self._by_key.get(key)
        if entry is None:
            if len(self._by_key) >= self.max_keys:
                if plausible(priced, reported):
                    self.untracked += 1
                return False
            entry = self._by_key[key] = ModelOverhead()
        if not plausible(priced, reported):
            entry.rejected += 1
            return False
        entry.add(priced, reported, priced if charged is None else charged, self._decay)
        return True

    def learned(self, model: str, route: str) -> int:
        """The learned overhead once it has ``min_samples`` samples, else 0."""
        entry = self._by_key.get((model, route))
        if entry is None or entry.samples < self.min_samples:
            return 0
        return entry.learned

    def overhead(self, model: str, route: str, setting: OverheadSetting = NO_SETTING) -> int:
        """What to add to a request's priced prompt: the configured overhead on a template route,
        else the learned one (when ``setting.learn``), else 0."""
        if setting.configured is not None and route in TEMPLATE_ROUTES:
            return setting.configured
        if not setting.learn:
            return 0
        return max(-MAX_LEARNED, min(self.learned(model, route), MAX_LEARNED))

    def snapshot(
        self, setting_of: Callable[[str], OverheadSetting] = lambda _: NO_SETTING
    ) -> dict[str, object]:
        """The learner's state for /stats: its rules, and per (model, route) the means (decayed),
        the learned and the applied overhead, and the mean absolute error of prices before and
        after correction."""
        rows = []
        for (model, route), e in sorted(self._by_key.items()):
            setting = setting_of(model)
            rows.append(
                {
                    "model": model,
                    "route": route,
                    "pattern": setting.pattern,
                    "samples": e.samples,
                    "rejected": e.rejected,
                    "mean_priced": round(e.mean(e.priced), 1),
                    "mean_reported": round(e.mean(e.reported), 1),
                    "learned_overhead": e.learned if e.samples else None,
                    "configured_overhead": setting.configured if route in TEMPLATE_ROUTES else None,
                    "learning": setting.learn,
                    "applied_overhead": self.overhead(model, route, setting),
                    "error_before": round(e.mean(e.error_before), 1),
                    "error_after": round(e.mean(e.error_after), 1),
                }
            )
        return {
            "half_life_requests": self.half_life,
            "min_samples": self.min_samples,
            "max_models": self.max_keys,
            "untracked": self.untracked,
            "models": rows,
        }


__all__ = [
    "HALF_LIFE",
    "MAX_KEYS",
    "MAX_LEARNED",
    "MIN_SAMPLES",
    "NO_SETTING",
    "TEMPLATE_ROUTES",
    "ModelOverhead",
    "OverheadSetting",
    "PromptOverheads",
    "corrected",
    "plausible",
]

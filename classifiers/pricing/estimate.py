"""Estimate mode for long prompts: tokens from characters, by a ratio learned from exact counts.

Counting a never-seen 28k-token prompt exactly takes ~7 ms of tiktoken, longer when it waits for an
encode thread behind other long prompts (encoding.py); a request priced on an estimate goes on at
once. With ``pricing.estimate_above_chars`` set, a request whose texts left to encode total at least
that many characters is priced with each such text counted as

    ceil(characters x ratio x (1 + estimate_margin_percent / 100))

where ``ratio`` is a high quantile (``_QUANTILE``) of the tokens per character of the last
``_WINDOW`` long texts of the same tenant this tokenizer counted exactly. Until ``_MIN_SAMPLES``
such texts were counted there is no ratio and the request is counted exactly, as without estimate
mode.

The exact count is still made, off the event loop, while the request goes on; the gateway corrects
the request's lease by the difference when it arrives (an under-estimate grows the lease, counted
as an overdraft; never a queue), and the engine's usage settles what the request used at release.
So an estimate can only shorten a long prompt's wait: a text chosen to tokenize far above the ratio
(a hostile tenant's) holds its exact count once the encode is done, as it would have without
estimates. `EstimateErrors` keeps the distribution of exact / estimate for ``/stats``.
"""

from __future__ import annotations

import math
from collections import OrderedDict, deque

# Texts shorter than this say little about a tokenizer's ratio (a few words swing it): not learned from.
_MIN_CHARS = 1024
# The ratio is a high quantile of the last _WINDOW long texts' tokens per character.
_WINDOW = 256
_QUANTILE = 0.9
_MIN_SAMPLES = 8


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, math.ceil(q * len(ordered)) - 1)]


class CharRatios:
    """Tokens per character, learned per tenant and tokenizer from the long texts counted exactly.

    Per tenant: a tenant's estimates follow its own texts only, so one that floods text of many
    tokens per character (CJK, random bytes) cannot raise everyone else's reservations, nor one
    of few lower them. ``_MAX_KEYS`` (tenant, tokenizer) pairs are kept, the least recently used
    forgotten (its tenant's next long prompts are counted exactly until it has learned again).
    """

    _MAX_KEYS = 4096

    def __init__(self) -> None:
        self._seen: OrderedDict[tuple[str, str], deque[float]] = OrderedDict()
        self._high: dict[tuple[str, str], float] = {}

    def observe(self, scope: str, tokenizer: str, chars: int, tokens: int) -> None:
        if chars < _MIN_CHARS:
            return
        key = (scope, tokenizer)
        seen = self._seen.get(key)
        if seen is None:
            if len(self._seen) >= self._MAX_KEYS:
                old, _ = self._seen.popitem(last=False)
                self._high.pop(old, None)
            seen = self._seen[key] = deque(maxlen=_WINDOW)
        else:
            self._seen.move_to_end(key)
        seen.append(tokens / chars)
        if len(seen) >= _MIN_SAMPLES:
            self._high[key] = _quantile(list(seen), _QUANTILE)

    def ratio(self, scope: str, tokenizer: str) -> float | None:
        """The high quantile of tokens per character, or None while too few texts were counted."""
        return self._high.get((scope, tokenizer))

    def estimate(self, scope: str, tokenizer: str, chars: int, margin: float) -> int | None:
        ratio = self._high.get((scope, tokenizer))
        return None if ratio is None else math.ceil(chars * ratio * (1.0 + margin))

    def snapshot(self) -> dict[str, dict[str, float | int]]:
        """Per tokenizer: how many tenants have a ratio, and the lowest, median and highest."""
        by_tokenizer: dict[str, list[float]] = {}
        for (_, tokenizer), ratio in self._high.items():
            by_tokenizer.setdefault(tokenizer, []).append(ratio)
        return {
            name: {
                "tenants": len(ratios),
                "tokens_per_char_min": round(min(ratios), 4),
                "tokens_per_char_p50": round(_quantile(ratios, 0.5), 4),
                "tokens_per_char_max": round(max(ratios), 4),
            }
            for name, ratios in by_tokenizer.items()
        }


class EstimateErrors:
    """Exact / estimated prompt tokens of the last requests priced on an estimate (1.0: exact)."""

    def __init__(self, window: int = 1024) -> None:
        self._ratios: deque[float] = deque(maxlen=window)
        self.estimated = 0  # requests priced on an estimate
        self.counted = 0  # of those, how many were counted exactly since (the rest: cancelled)
        self.under = 0  # of those, how many the exact count found larger (their leases grew)

    def observe(self, estimated: int, exact: int) -> None:
        self.counted += 1
        if exact > estimated:
            self.under += 1
        self._ratios.append(exact / estimated if estimated > 0 else 1.0)

    def snapshot(self) -> dict[str, object]:
        ratios = list(self._ratios)
        if not ratios:
            return {
                "estimated": self.estimated,
                "counted": self.counted,
                "under": self.under,
                "exact_over_estimate": None,
            }
        return {
            "estimated": self.estimated,
            "counted": self.counted,
            "under": self.under,
            "exact_over_estimate": {
                "p50": round(_quantile(ratios, 0.5), 4),
                "p90": round(_quantile(ratios, 0.9), 4),
                "p99": round(_quantile(ratios, 0.99), 4),
                "max": round(max(ratios), 4),
                "min": round(min(ratios), 4),
            },
        }

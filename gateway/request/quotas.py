"""A request's quotas: reserve before it queues, settle once when it ends, and OpenAI's rate-limit
headers (budgets/quota.py has the rules, docs/quotas.md the behaviour).

The reservation comes before the in-flight budgets and their queue: a request that only time can
let through (its window is full) gets its 429 at once rather than waiting for a grant it would then
be refused. A request refused or abandoned after reserving (queue full, waited too long, cancelled)
settles with nothing used; one that ran settles with the engine's usage (prompt + output tokens, or
their cost at its model's price); one whose usage is unknown, at its reservation. Reservations live
while their request does (heartbeats), so a gateway that dies leaves them to expire in the store at
the amount reserved.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import secrets
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from fnmatch import fnmatchcase

from budgets.background import BackgroundTask
from budgets.quota import MICRO, Charge, ModelPrice, QuotaSpec, Refused, Reserved, cost_micros, retry_after_s
from budgets.quotas import QuotaLedger
from budgets.types import StoreUnavailable
from classifiers.bymodel import ByModel
from gateway.config.schema import ModelConfig, TenantConfig
from gateway.request.errors import ApiError

log = logging.getLogger("tokengate.quotas")


@dataclass(frozen=True, slots=True)
class QuotaHold:
    """What one request reserved: its quotas, the amount in each and the model's price."""

    rid: str
    specs: tuple[QuotaSpec, ...]
    amounts: tuple[int, ...]
    price: ModelPrice | None


@dataclass(frozen=True, slots=True)
class Usage:
    prompt: int
    cached: int
    output: int
    ran: bool = True  # False: never admitted (a request quota counts it as no request)


NOT_RUN = Usage(0, 0, 0, ran=False)


class QuotaGate:
    def __init__(
        self,
        ledger: QuotaLedger,
        *,
        wall: Callable[[], float] = time.time,
        on_refused: Callable[[QuotaSpec, bool], None] | None = None,
    ) -> None:
        self.ledger = ledger
        self._wall = wall
        self._specs: dict[str, tuple[QuotaSpec, ...]] = {}
        self._prices: ByModel[ModelPrice | None] = ByModel((), None)
        # Reservations of requests in flight (heartbeated): None a quota hold (at shutdown charged
        # what it reserved); n a gauge of n charges (hold(): released with nothing used)
        self._live: dict[str, int | None] = {}
        self._ids = itertools.count(1)
        self._prefix = secrets.token_hex(6)
        self._beat = BackgroundTask("quota-heartbeat", self._heartbeat, log)
        self._on_refused = on_refused  # (quota, enforced): metrics
        self.refused = 0
        self.would_refuse = 0
        self.shadow_counts: dict[tuple[str, str], int] = {}  # shadow quota (tenant, name) -> would-refuse
        self._logged: set[tuple[str, int]] = set()  # shadow refusals logged: (quota key, bucket)

    def bind(self, tenants: Sequence[TenantConfig], models: Sequence[ModelConfig]) -> None:
        self._specs = {t.name: t.quotas for t in tenants if t.quotas}
        self._prices = ByModel(((m.pattern, m.price) for m in models if m.price is not None), None)

    @property
    def configured(self) -> bool:
        return bool(self._specs)

    def price_of(self, model: str) -> ModelPrice | None:
        return self._prices.get(model)

    def applying(self, tenant: str, model: str) -> tuple[QuotaSpec, ...]:
        specs = self._specs.get(tenant, ())
        return tuple(q for q in specs if not q.models or any(fnmatchcase(model, g) for g in q.models))

    async def start(self) -> None:
        await self.ledger.start()
        self._beat.start()

    async def close(self) -> None:
        await self._beat.stop()
        for rid in list(self._live):  # requests cut by the shutdown: what they reserved is charged
            n = self._live.pop(rid, None)
            try:
                await self.ledger.settle(rid, None if n is None else [0] * n)
            except Exception:
                log.exception("settling quota reservation %s at shutdown failed", rid)
        await self.ledger.close()

    async def reserve(
        self, tenant: str, model: str, prefill: int, decode: int, api_key: str = ""
    ) -> tuple[QuotaHold | None, list[tuple[bytes, bytes]]]:
        """Reserve in every quota of ``tenant`` that applies to ``model`` (per-key ones in
        ``api_key``'s window); the hold (None when none applies) and the rate-limit headers. Raises
        the 429 (or 413) of the first full quota."""
        specs = self.applying(tenant, model)
        if not specs:
            return None, []
        price = self._prices.get(model) if any(q.unit == "cost" for q in specs) else None
        if price is None and any(q.unit == "cost" for q in specs):
            raise ApiError(
                403,
                f"Model {model!r} has no price, and a cost quota of this tenant applies to it: the "
                "gateway's operator must give the model a price (models.<glob>.price) before it can be used",
                code="model_not_priced",
            )
        amounts = tuple(_amount_of(q, Usage(prefill, 0, decode), price) for q in specs)
        now = self._wall()
        rid = f"{self._prefix}-{next(self._ids):x}"
        try:
            outcome = await self.ledger.reserve(
                rid, [q.charge(a, now, api_key) for q, a in zip(specs, amounts, strict=True)]
            )
        except StoreUnavailable as exc:
            raise ApiError(503, exc.message, code="store_unavailable", retry_after_s=1.0) from None
        if isinstance(outcome, Refused):
            q, amount = specs[outcome.index], amounts[outcome.index]
            self.refused += 1
            if self._on_refused is not None:
                self._on_refused(q, True)
            used = sum(outcome.buckets.values())
            headers = _headers(q, used, outcome.buckets, now) if q.unit != "cost" else []
            raise _refusal(q, amount, outcome, now, headers)
        for i in outcome.over:
            q = specs[i]
            self.would_refuse += 1
            self.shadow_counts[q.tenant, q.name] = self.shadow_counts.get((q.tenant, q.name), 0) + 1
            if self._on_refused is not None:
                self._on_refused(q, False)
            mark = (q.key, q.window.bucket(now))
            if mark in self._logged:  # once per quota and window (bucket): counted every time
                continue
            if len(self._logged) >= 4096:
                self._logged.clear()
            self._logged.add(mark)
            log.warning(
                "shadow quota %s of tenant %s would have refused a request (%s of %s used); it is not "
                "enforced, so nothing was refused (logged once per window, counted in "
                'tokengate_quota_refusals_total{enforced="false"})',
                q.name,
                q.tenant,
                _amount(q, outcome.used[i]),
                _amount(q, q.limit),
            )
        self._live[rid] = None
        return QuotaHold(rid, specs, amounts, price), self._tightest(specs, outcome.used, now)

    async def settle(self, hold: QuotaHold, usage: Usage | None) -> None:
        """Once per hold. ``usage`` None: what was reserved (the use is unknown)."""
        self._live.pop(hold.rid, None)
        actual = None if usage is None else [_amount_of(q, usage, hold.price) for q in hold.specs]
        try:
            await self.ledger.settle(hold.rid, actual)
        except Exception:
            # Left in the store, it expires there at the amount reserved: never lost, at worst
            # over-counted by what the request did not use.
            log.exception("settling quota reservation %s failed", hold.rid)

    async def hold(self, charges: Sequence[Charge]) -> tuple[str, Reserved]:
        """Hold ``charges`` (none enforced) as a gauge while a request runs, heartbeated like a
        quota reservation; :meth:`drop` gives it back with nothing used."""
        assert not any(c.enforce for c in charges)
        rid = f"{self._prefix}-{next(self._ids):x}"
        outcome = await self.ledger.reserve(rid, charges)
        assert isinstance(outcome, Reserved)  # (nothing enforced: nothing refuses)
        self._live[rid] = len(charges)
        return rid, outcome

    async def drop(self, rid: str) -> None:
        n = self._live.pop(rid, None)
        if n is not None:
            await self.ledger.settle(rid, [0] * n)

    def _tightest(
        self, specs: Sequence[QuotaSpec], used: Sequence[int], now: float
    ) -> list[tuple[bytes, bytes]]:
        headers: list[tuple[bytes, bytes]] = []
        for unit in ("tokens", "requests"):
            mine = [(q, u) for q, u in zip(specs, used, strict=True) if q.unit == unit and q.enforce]
            if mine:
                q, u = min(mine, key=lambda p: p[0].limit - p[1])
                headers += _headers(q, u, None, now)
        return headers

    async def _heartbeat(self) -> None:
        while True:
            await asyncio.sleep(max(0.01, self.ledger.ttl_s / 3))
            if self._live:
                try:
                    await self.ledger.heartbeat(list(self._live))
                except Exception:
                    log.exception("quota heartbeat failed")


def _refusal(
    q: QuotaSpec, amount: int, outcome: Refused, now: float, headers: list[tuple[bytes, bytes]]
) -> ApiError:
    wait = retry_after_s(q, amount, outcome.buckets, now)
    if wait is None:
        return ApiError(
            413,
            f"This request needs {_amount(q, amount)} of quota {q.name!r}, more than its whole limit of "
            f"{_amount(q, q.limit)} per {q.window.period}: ask for fewer tokens (max_tokens, a shorter "
            "prompt) or have the quota raised",
            code="cost_exceeds_quota",
            headers=headers,
        )
    used = sum(outcome.buckets.values())
    return ApiError(
        429,
        f"Quota {q.name!r} is used up: {_amount(q, used)} of {_amount(q, q.limit)} per "
        f"{'rolling ' if q.window.rolling else ''}{q.window.period} are used or reserved and this request "
        f"needs {_amount(q, amount)}; retry after {max(1, round(wait))} s",
        code="quota_exceeded",
        retry_after_s=max(wait, 1.0),
        headers=headers,
    )


def _amount_of(q: QuotaSpec, usage: Usage, price: ModelPrice | None) -> int:
    """What ``usage`` (or a price: the prompt and the reserved output) counts in quota ``q``."""
    if q.unit == "tokens":
        return usage.prompt + usage.output
    if q.unit == "requests":
        return 1 if usage.ran else 0
    assert price is not None  # (a cost quota on an unpriced model is refused before this)
    return cost_micros(usage.prompt, usage.cached, usage.output, price)


def _amount(q: QuotaSpec, n: int) -> str:
    return f"{n:,} {q.unit}" if q.unit != "cost" else f"{n / MICRO:,.2f}"


def _headers(
    q: QuotaSpec, used: int, buckets: Mapping[int, int] | None, now: float
) -> list[tuple[bytes, bytes]]:
    """OpenAI's ``x-ratelimit-*-tokens`` (``-requests``) for token (request) quota ``q`` holding
    ``used``: its limit, what is left, and when it is whole again (the window's end; a rolling
    window's oldest use leaving)."""
    w = q.window
    if w.rolling:
        oldest = min(buckets) if buckets else w.bucket(now)
        reset = w.frees_at(oldest, now) - now
    else:
        reset = w.frees_at(w.bucket(now), now) - now
    unit = q.unit
    return [
        (f"x-ratelimit-limit-{unit}".encode(), str(q.limit).encode()),
        (f"x-ratelimit-remaining-{unit}".encode(), str(max(0, q.limit - used)).encode()),
        (f"x-ratelimit-reset-{unit}".encode(), duration(reset).encode()),
    ]


def duration(seconds: float) -> str:
    """OpenAI's form of a reset time: ``"1s"``, ``"6m0s"``, ``"2h3m4s"``, ``"120ms"``."""
    if seconds < 1:
        return f"{max(0, round(seconds * 1000))}ms"
    s = round(seconds)
    h, rest = divmod(s, 3600)
    m, sec = divmod(rest, 60)
    if h:
        return f"{h}h{m}m{sec}s"
    if m:
        return f"{m}m{sec}s"
    return f"{sec}s"


async def quota_usage(
    ledger: QuotaLedger, specs: Sequence[QuotaSpec], keys: Mapping[str, str], now: float
) -> list[dict[str, object]]:
    """Each quota's window at ``now`` as the admin API shows it (cost in currency units); a per-key
    quota once per key of ``keys`` (key id -> how the operator knows it)."""
    rows = [(q, k) for q in specs for k in (keys if q.per_key else [""])]
    found = await ledger.usage([(q.key_for(k), q.window.oldest(now)) for q, k in rows])
    out: list[dict[str, object]] = []
    for (q, k), (used, reserved) in zip(rows, found, strict=True):
        w = q.window

        def shown(n: int, q: QuotaSpec = q) -> float | int:
            return n if q.unit != "cost" else n / MICRO

        row: dict[str, object] = {
            "name": q.name,
            "unit": q.unit,
            "window": w.period,
            "rolling": w.rolling,
            "enforce": q.enforce,
            "limit": shown(q.limit),
            "used": shown(used),
            "reserved": shown(reserved),
            "remaining": shown(max(0, q.limit - used - reserved)),
            "window_start": w.oldest(now) if w.rolling else w.bucket(now),
            "window_end": now if w.rolling else w.frees_at(w.bucket(now), now),
            "models": list(q.models),
        }
        if q.per_key:
            row["key"] = keys[k]
        out.append(row)
    return out

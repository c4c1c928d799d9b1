"""Quotas over time: pure rules. No asyncio, no I/O; the wall-clock ``now`` is always passed in.

An in-flight budget bounds what a tenant has running *at once*; a quota bounds what it uses *over a
window* ("5M tokens a day", "$200 a month"). Both stores keep quotas with exactly these rules (the
Redis store in Lua, budgets/redis/lua/quota.lua); this docstring is the specification.

Windows
-------
A quota counts an integer *amount* (tokens, requests, or cost in micro-units of a currency) in
*buckets*, each
named by its start (epoch seconds, an integer).

- **Fixed** windows (the default) are one bucket each. ``minute`` and windows given in seconds
  (``"90s"``, ``"15m"``) start at multiples of their length since the epoch; ``hour``, ``day``,
  ``week`` (Monday) and ``month`` (the 1st) follow the calendar of the quota's ``timezone``
  (daylight saving included: a day is 23 or 25 hours twice a year), day/week/month windows start
  ``reset`` seconds after local midnight. A fixed window's usage is forgotten when it ends.
- **Rolling** windows count the last ``length`` seconds (``month`` is 30 days) in 60 buckets of
  ``length / 60`` (at least one second): a bucket leaves the window ``length`` after its end, so a
  use is counted for between ``length`` and ``length + length/60``.

Reserve, then settle
--------------------
A request *reserves* its priced amount (prompt + reserved output, or their cost) in the current
bucket of every quota that applies, all or nothing: if, for an enforced quota,
``used + reserved + amount > limit`` over the window's buckets, nothing is reserved and the request
is refused with the time until the window frees enough (:func:`retry_after_s`). Reservations count
like use, so concurrent requests never take more than the limit together. At the end of the
request the reservation is *settled* exactly once: the reserved amount leaves the bucket it was
taken in and the actual amount (from the engine's usage; more than reserved when the output grew
past its reservation) is added there as used. A reservation that is never settled (its gateway
died) expires after its TTL and is settled at the amount reserved. A request that is refused after
reserving (queue full, waited too long, cancelled) settles with nothing used.

A quota with ``enforce = False`` (shadow mode) reserves and settles the same way but never refuses:
:func:`reserve` reports it as *would refuse* and the gateway counts and logs that.

An operator's *reset* forgets what a quota's buckets used; the reservations in them stay (their
requests are running) and settle as usual.

A request whose amount alone is larger than an enforced quota's limit can never be admitted in any
window: :func:`reserve` reports it like any refusal, and ``retry_after_s`` is None for it.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import date, datetime, time, timedelta
from functools import lru_cache
from typing import Literal
from zoneinfo import ZoneInfo

Unit = Literal["tokens", "requests", "cost"]

CALENDAR = ("hour", "day", "week", "month")
_NAMED_S = {"minute": 60, "hour": 3600, "day": 86_400, "week": 7 * 86_400, "month": 30 * 86_400}
_LENGTH_RE = re.compile(r"^([1-9][0-9]{0,6})([smhd])$")
_UNIT_S = {"s": 1, "m": 60, "h": 3600, "d": 86_400}
ROLLING_BUCKETS = 60
# Cost is kept in micro-units of the currency: a price "per million tokens" is then micro-units per
# token, and sums of integers are exact in Redis and in Lua's doubles far beyond any bill.
MICRO = 1_000_000


def window_length(period: str) -> int | None:
    """Seconds of a window named ``minute``/``hour``/``day``/``week``/``month`` or ``<n>[smhd]``;
    None when ``period`` is neither."""
    if period in _NAMED_S:
        return _NAMED_S[period]
    m = _LENGTH_RE.match(period)
    return int(m.group(1)) * _UNIT_S[m.group(2)] if m else None


@lru_cache(maxsize=64)
def _zone(name: str) -> ZoneInfo:
    return ZoneInfo(name)


@dataclass(frozen=True, slots=True)
class Window:
    period: str  # minute | hour | day | week | month | "<n>[smhd]"
    rolling: bool = False
    timezone: str = "UTC"
    reset_s: int = 0  # day/week/month fixed windows start this long after local midnight
    length_s: int = field(init=False)

    def __post_init__(self) -> None:
        length = window_length(self.period)
        if length is None:
            raise ValueError(f"unknown window {self.period!r}")
        object.__setattr__(self, "length_s", length)

    @property
    def bucket_s(self) -> int:
        """A rolling window's bucket; a fixed window is one bucket (its length varies by calendar)."""
        return max(1, self.length_s // ROLLING_BUCKETS) if self.rolling else self.length_s

    @property
    def tag(self) -> str:
        """What the stored buckets mean: a quota whose window changes starts counting afresh."""
        kind = "rolling" if self.rolling else "fixed"
        zone = f"@{self.timezone}+{self.reset_s}" if not self.rolling and self.period in CALENDAR else ""
        return f"{kind}:{self.period}{zone}"

    def bucket(self, now: float) -> int:
        """The bucket a use at ``now`` is counted in."""
        if self.rolling or self.period not in CALENDAR:
            b = self.bucket_s
            return int(now // b) * b
        return int(self.bounds(now)[0])

    def oldest(self, now: float) -> int:
        """The first bucket still inside the window at ``now`` (older buckets count for nothing)."""
        if not self.rolling:
            return self.bucket(now)
        b = self.bucket_s  # (the first bucket whose frees_at is still ahead)
        return int((now - self.length_s) // b) * b

    def frees_at(self, bucket: int, now: float) -> float:
        """When what is counted in ``bucket`` stops counting."""
        if self.rolling:
            return bucket + self.bucket_s + self.length_s
        if self.period not in CALENDAR:
            return bucket + self.length_s
        return self.bounds(now)[1]

    def bounds(self, now: float) -> tuple[float, float]:
        """Start and end (epoch seconds) of the fixed calendar window holding ``now``."""
        tz = _zone(self.timezone)
        if self.period == "hour":
            local = datetime.fromtimestamp(now, tz).replace(minute=0, second=0, microsecond=0)
            start = local.timestamp()
            return start, _local(local.replace(tzinfo=None) + timedelta(hours=1), tz)
        day = datetime.fromtimestamp(now, tz).date()
        start_day = self._period_start(day)
        start = self._at(start_day, tz)
        if start > now:  # before today's reset: still the previous window
            start_day = self._period_start(start_day - timedelta(days=1))
            start = self._at(start_day, tz)
        return start, self._at(self._next(start_day), tz)

    def _period_start(self, d: date) -> date:
        if self.period == "week":
            return d - timedelta(days=d.weekday())
        if self.period == "month":
            return d.replace(day=1)
        return d

    def _next(self, d: date) -> date:
        if self.period == "week":
            return d + timedelta(days=7)
        if self.period == "month":
            return date(d.year + d.month // 12, d.month % 12 + 1, 1)
        return d + timedelta(days=1)

    def _at(self, d: date, tz: ZoneInfo) -> float:
        return _local(datetime.combine(d, time()) + timedelta(seconds=self.reset_s), tz)


def _local(naive: datetime, tz: ZoneInfo) -> float:
    """A local wall-clock time as epoch seconds: a time repeated when clocks go back is its first
    occurrence; one skipped when they go forward (fold 0 reads it with the offset before the change)
    is the instant the clocks changed plus how far past the change it is named, so a day starting
    inside the gap starts at the change."""
    return naive.replace(tzinfo=tz).timestamp()


@dataclass(frozen=True, slots=True)
class QuotaSpec:
    """One quota: ``limit`` of ``unit`` per ``window``. ``key`` names it in the store (tenant, name
    and window's tag: a changed window counts afresh; a changed limit keeps what was used)."""

    name: str
    tenant: str
    unit: Unit
    limit: int  # tokens, requests, or micro-units of the currency
    window: Window
    models: tuple[str, ...] = ()  # model globs it applies to; () every model
    enforce: bool = True
    per_key: bool = False  # each API key of the tenant has a window of its own
    key: str = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "key", f"{self.tenant}/{self.name}/{self.window.tag}")

    def charge(self, amount: int, now: float, api_key: str = "") -> Charge:
        """``api_key``: the key's id (a digest) when the quota is per key."""
        w = self.window
        # (kept in the store for two windows and an hour: a month's hash outlives a 31-day month)
        keep = 2 * w.length_s + 3600
        key = self.key_for(api_key)
        return Charge(key, self.limit, amount, w.bucket(now), w.oldest(now), self.enforce, keep)

    def key_for(self, api_key: str) -> str:
        """The store's name of the window this quota counts a request with ``api_key`` in."""
        return f"{self.key}/key:{api_key}" if self.per_key else self.key


@dataclass(frozen=True, slots=True)
class Charge:
    """What one request asks of one quota, as both stores receive it."""

    key: str
    limit: int
    amount: int
    bucket: int  # where the amount is counted
    oldest: int  # buckets before it are outside the window
    enforce: bool = True
    keep_s: int = 3600  # how long the store keeps the quota's buckets after a write


@dataclass(frozen=True, slots=True)
class Reserved:
    used: tuple[int, ...]  # per charge: what the window holds now, this request's amount included
    over: tuple[int, ...] = ()  # charges of shadow quotas that would have refused


@dataclass(frozen=True, slots=True)
class Refused:
    index: int  # the first enforced charge that did not fit
    buckets: Mapping[int, int]  # its window: bucket -> used + reserved


@dataclass(slots=True)
class _Held:
    charges: tuple[Charge, ...]
    expires_at: float


@dataclass(slots=True)
class LedgerState:
    buckets: dict[str, dict[int, list[int]]] = field(
        default_factory=dict
    )  # key -> bucket -> [used, reserved]
    held: dict[str, _Held] = field(default_factory=dict)  # reservation id -> what it holds


def window_buckets(state: LedgerState, key: str, oldest: int) -> dict[int, list[int]]:
    """The quota's buckets inside the window, older ones dropped for good."""
    buckets = state.buckets.setdefault(key, {})
    for b in [b for b in buckets if b < oldest]:
        del buckets[b]
    return buckets


def reserve(state: LedgerState, rid: str, charges: Sequence[Charge], expires_at: float) -> Reserved | Refused:
    totals: list[int] = []
    over: list[int] = []
    for i, c in enumerate(charges):
        buckets = window_buckets(state, c.key, c.oldest)
        total = sum(u + r for u, r in buckets.values())
        if total + c.amount > c.limit:
            if c.enforce:
                return Refused(i, {b: u + r for b, (u, r) in sorted(buckets.items())})
            over.append(i)
        totals.append(total + c.amount)
    for c in charges:
        state.buckets[c.key].setdefault(c.bucket, [0, 0])[1] += c.amount
    state.held[rid] = _Held(tuple(charges), expires_at)
    return Reserved(tuple(totals), tuple(over))


def settle(state: LedgerState, rid: str, actual: Sequence[int] | None) -> bool:
    """Settle reservation ``rid``: per charge, the amount used (None: what was reserved). False
    when it is not held (settled already, or expired and settled by :func:`expire`)."""
    held = state.held.pop(rid, None)
    if held is None:
        return False
    for i, c in enumerate(held.charges):
        cell = state.buckets.get(c.key, {}).get(c.bucket)
        if cell is None:  # its window has passed: nothing left to count it in
            continue
        cell[1] -= c.amount
        cell[0] += c.amount if actual is None else max(0, int(actual[i]))
    return True


def heartbeat(state: LedgerState, rids: Iterable[str], expires_at: float) -> None:
    for rid in rids:
        held = state.held.get(rid)
        if held is not None:
            held.expires_at = expires_at


def expire(state: LedgerState, now: float) -> int:
    """Settle every reservation past its expiry at the amount reserved; how many."""
    due = [rid for rid, held in state.held.items() if held.expires_at <= now]
    for rid in due:
        settle(state, rid, None)
    return len(due)


def reset(state: LedgerState, key: str) -> int:
    """Forget what the quota's windows used (an operator's reset); reservations of requests still
    running stay, and settle as usual. Returns the use forgotten."""
    cleared = 0
    for cell in state.buckets.get(key, {}).values():
        cleared += cell[0]
        cell[0] = 0
    return cleared


def usage(state: LedgerState, key: str, oldest: int) -> tuple[int, int]:
    """(used, reserved) inside the window."""
    buckets = window_buckets(state, key, oldest)
    return sum(u for u, _ in buckets.values()), sum(r for _, r in buckets.values())


def retry_after_s(spec: QuotaSpec, amount: int, buckets: Mapping[int, int], now: float) -> float | None:
    """How long until the window has room for ``amount``: the earliest time enough of what it holds
    has left it (reservations counted like use; they may settle for less, which only frees room
    sooner). None when ``amount`` is more than the whole limit: no window will ever take it."""
    if amount > spec.limit:
        return None
    need = sum(buckets.values()) + amount - spec.limit
    if need <= 0:
        return 0.0
    for b in sorted(buckets):
        need -= buckets[b]
        if need <= 0:
            return max(0.0, spec.window.frees_at(b, now) - now)
    return float(spec.window.length_s)  # (not reached: every bucket freed leaves only ``amount``)


def cost_micros(prompt: int, cached: int, output: int, price: ModelPrice) -> int:
    """The cost of a use in micro-units: prices are per million tokens, so per token in micro-units."""
    fresh = max(0, prompt - cached)
    cached_price = price.input if price.cached_input is None else price.cached_input
    return math.ceil(fresh * price.input + min(cached, prompt) * cached_price + output * price.output)


@dataclass(frozen=True, slots=True)
class ModelPrice:
    """Currency per million tokens."""

    input: float
    output: float
    cached_input: float | None = None

    def __post_init__(self) -> None:
        if self.cached_input is None:
            object.__setattr__(self, "cached_input", self.input)

"""The prefill gate: per backend, a limit on prompt tokens sent but not yet prefilled.

On one shared server a long prompt's prefill stalls every co-batched request; several long prompts
prefilling at once stall them for longer still. Token budgets bound what a backend *holds* (KV cache),
not what it is *prefilling now*. The gate bounds the latter: a request enters with its prompt tokens
before it is forwarded and leaves at its first streamed token (its prefill is done), or when its
answer ends (non-streaming, errors). The rules below read only the settings, the counters and
``now`` (``clock``): the same state and time always give the same decision.

Settings and state
------------------
- ``limit``: prompt tokens the gate lets in (``prefill_gate_tokens``).
- ``reserve`` (``prefill_gate_reserve_tokens``, default ``limit // 4``, ``0 <= reserve < limit``):
  the part of ``limit`` only short prompts may use. A prompt is *short* when its tokens are
  ``<= reserve`` and *long* otherwise; ``lane = limit - reserve`` is what long prompts share.
- ``hold_s``: how long a long prompt lets short ones borrow the lane before it claims it.
- Inside: ``long_tokens`` and ``short_tokens`` (``tokens`` = both); a pass leaves from the counter
  it entered (``reconfigure`` never moves a prompt inside from one class to the other).
- Waiting: one queue of long prompts and one of short prompts, each in arrival order.
- ``spill = max(0, short_tokens - reserve)``: the short tokens inside that are in the lane, not in the
  reserve. ``lane_used = long_tokens + spill``.

Rules
-----
1. *Long prompts, in arrival order.* Only the first waiting long prompt may enter, and it enters when
   ``lane_used + tokens <= lane``, or when the lane is empty (no long prompt inside and
   ``spill == 0``): a long prompt larger than the lane runs alone among long ones, with the reserve
   still open to short ones. No long prompt passes another, so none starves another.
2. *The claim.* The first waiting long prompt *claims the lane* when it has waited ``hold_s`` and only
   short prompts keep it out: ``long_tokens + tokens <= lane`` (or no long prompt is inside), but
   ``spill`` is in its way. A long prompt kept out by other long ones never claims: stopping short
   ones would not let it in any sooner.
3. *Short prompts, in arrival order.* Only the first waiting short prompt may enter, and it enters
   when ``short_tokens + tokens <= reserve`` (the reserve: always open to it, whatever long prompts
   are inside or waiting), or when ``tokens_inside + tokens <= limit`` and no long prompt claims the
   lane (it borrows free room in the lane). Under a claim the spill only drains: short prompts inside
   the lane leave and none enters it, so the claiming prompt gets in as soon as they have left.
4. A waiter cancelled while waiting leaves its queue (which may end a claim or unblock those behind);
   one cancelled just after it was let in gives its tokens back at once. Every pass is released
   exactly once (:meth:`GatePass.release` is idempotent). Each release, cancellation and
   reconfiguration re-applies rules 1 and 3, long prompts first.

Guarantees
----------
- *A short prompt never waits for a long one.* It waits only while the short prompts inside and
  ahead of it fill the room it may use: at least the reserve, and the lane's free room unless a long
  prompt claims it. Since a short prompt fits in the reserve alone, the first waiting short prompt
  enters at the latest when the short prompts inside have left: its wait is bounded by their prefill,
  and a later one's by that of the short prompts ahead of it.
- *A long prompt waits for the long prompts ahead of it, and then briefly for short ones.* Let ``T``
  be the later of its arrival plus ``hold_s`` and the moment the long prompts inside and ahead of it
  leave it room in the lane (or leave the lane, if it is larger than the lane). It enters by ``T``
  plus the longest prefill among the short prompts inside at ``T``: from ``T`` on, if short prompts
  are in its way, it claims the lane, so no short prompt enters the lane after ``T``.
- *Tokens inside never exceed* ``limit``, except while a long prompt larger than the lane is inside:
  then at most ``max(limit, that prompt + reserve)``. Long tokens never exceed ``lane`` except for
  one such prompt alone.

Sizing
------
Size ``lane`` at least at the largest prompt (a larger one goes over ``limit`` by up to the reserve),
and below two long prompts for them to prefill one at a time; size ``reserve`` at least at the
largest short prompt (it is what makes a prompt short) plus the short prompts that arrive while a
long one prefills. A reserve of 0 makes every prompt long: one first-come-first-served line.

Statistics
----------
Per class (short, long), :class:`PromptStats` counts the prompts let in, those that had to wait and
their total wait, and keeps the last ``RECENT`` prompts' waits, sizes and times inside (enter to
first token): ``/stats`` shows their p99 wait, the largest prompt, the prompt tokens per second, the
most prompt tokens let in within one second and the p99 time inside, so ``tokengate doctor`` can tell
when short prompts wait (the reserve is too small for them) and what reserve they need: the largest
short prompt plus the short prompt tokens that arrive while one stays inside, at least their
one-second burst.

One gate per backend, used only on the event loop: plain counters, no locks; a wake is O(waiters).
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from gateway.observe.percentile import percentile

RECENT = 512  # prompts per class whose waits, sizes and times inside the statistics read


@dataclass(slots=True)
class PromptStats:
    """One class's prompts at the gate: totals since start, and the last ``RECENT`` of them."""

    requests: int = 0  # let in
    held: int = 0  # of which had to wait
    wait_s_total: float = 0.0
    # (time let in, tokens, wait) of the last RECENT let in; how long the last RECENT stayed inside
    recent: deque[tuple[float, int, float]] = field(default_factory=lambda: deque(maxlen=RECENT))
    inside: deque[float] = field(default_factory=lambda: deque(maxlen=RECENT))

    def entered(self, now: float, tokens: int, waited_s: float) -> None:
        self.requests += 1
        if waited_s > 0:
            self.held += 1
            self.wait_s_total += waited_s
        self.recent.append((now, tokens, waited_s))

    def tokens_per_s(self, now: float) -> float | None:
        """Prompt tokens let in per second over the recent prompts (None: fewer than two)."""
        if len(self.recent) < 2:
            return None
        span = now - self.recent[0][0]
        return sum(t for _, t, _ in self.recent) / span if span > 0 else None

    def burst_tokens(self, window_s: float = 1.0) -> int:
        """The most prompt tokens let in within any ``window_s`` over the recent prompts."""
        best = total = 0
        start = 0
        recent = self.recent
        for t, tokens, _ in recent:
            total += tokens
            while recent[start][0] <= t - window_s:
                total -= recent[start][1]
                start += 1
            best = max(best, total)
        return best

    def as_dict(self, now: float) -> dict[str, float | int | None]:
        waits = [w for _, _, w in self.recent]
        rate = self.tokens_per_s(now)
        p99_wait, p99_inside = percentile(waits, 99), percentile(self.inside, 99)
        return {
            "requests": self.requests,
            "held": self.held,
            "wait_s_total": round(self.wait_s_total, 3),
            "wait_p99_s": None if p99_wait is None else round(p99_wait, 4),
            "wait_max_s": round(max(waits), 4) if waits else None,
            "max_tokens": max((t for _, t, _ in self.recent), default=None),
            "min_tokens": min((t for _, t, _ in self.recent), default=None),
            "tokens_per_s": None if rate is None else round(rate, 1),
            "burst_tokens_1s": self.burst_tokens() if self.recent else None,
            "inside_p99_s": None if p99_inside is None else round(p99_inside, 4),
        }


@dataclass(slots=True, eq=False)
class _Waiter:
    tokens: int
    long: bool
    seq: int  # arrival order across both queues (reconfigure re-sorts waiters into them)
    since: float
    future: asyncio.Future[None]


class GatePass:
    """A request's tokens in a gate; ``release`` returns them (once, whoever calls it first)."""

    __slots__ = ("entered_at", "gate", "long", "tokens", "waited_s")

    def __init__(
        self,
        gate: PrefillGate,
        tokens: int,
        waited_s: float,
        long: bool = False,
        entered_at: float | None = None,
    ) -> None:
        self.gate: PrefillGate | None = gate
        self.tokens = tokens
        self.waited_s = waited_s
        self.long = long  # the class it entered as: it leaves from that counter
        self.entered_at = entered_at  # the gate's clock when it was let in

    def release(self) -> None:
        gate = self.gate
        if gate is not None:
            self.gate = None
            inside = None if self.entered_at is None else gate.clock() - self.entered_at
            gate.leave(self.tokens, self.long, inside)

    @property
    def released(self) -> bool:
        return self.gate is None


def default_reserve(limit: int) -> int:
    """The reserve when none is configured: a quarter of the limit."""
    return limit // 4


class PrefillGate:
    __slots__ = (
        "_longs",
        "_seq",
        "_shorts",
        "clock",
        "held_total",
        "hold_s",
        "limit",
        "long_requests",
        "long_stats",
        "long_tokens",
        "requests",
        "reserve",
        "short_stats",
        "tokens",
        "wait_s_total",
    )

    def __init__(
        self,
        limit: int,
        hold_s: float = 1.0,
        reserve: int | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.limit = limit
        self.hold_s = hold_s
        self.reserve = _checked_reserve(limit, reserve)
        self.clock = clock
        self.tokens = 0  # prompt tokens inside (sent, first token not seen yet), long and short
        self.requests = 0  # requests inside
        self.long_tokens = 0  # of which long prompts'
        self.long_requests = 0
        self.held_total = 0  # requests that had to wait
        self.wait_s_total = 0.0
        self.short_stats = PromptStats()  # per class: waits, sizes, times inside
        self.long_stats = PromptStats()
        self._longs: deque[_Waiter] = deque()
        self._shorts: deque[_Waiter] = deque()
        self._seq = 0

    # ---- the state the rules read ----------------------------------------------------------

    @property
    def lane(self) -> int:
        """Tokens long prompts share: the limit less the reserve."""
        return self.limit - self.reserve

    @property
    def short_tokens(self) -> int:
        return self.tokens - self.long_tokens

    @property
    def waiting(self) -> int:
        return len(self._longs) + len(self._shorts)

    def is_long(self, tokens: int) -> bool:
        return tokens > self.reserve

    def _spill(self) -> int:
        """Short tokens inside beyond the reserve: the part of the lane short prompts borrow."""
        return max(0, self.short_tokens - self.reserve)

    # ---- the rules -------------------------------------------------------------------------

    def _long_fits(self, tokens: int) -> bool:
        """Rule 1: room in the lane, or the lane empty (a prompt larger than the lane runs alone)."""
        used = self.long_tokens + self._spill()
        return used + tokens <= self.lane or (self.long_requests == 0 and used == 0)

    def _only_shorts_in_the_way(self, tokens: int) -> bool:
        """Would a long prompt of ``tokens`` fit if the short prompts in the lane left?"""
        return self.long_tokens + tokens <= self.lane or self.long_requests == 0

    def _first_long(self) -> _Waiter | None:
        return next((w for w in self._longs if not w.future.done()), None)

    def claimed(self, now: float) -> bool:
        """Rule 2: the first waiting long prompt has waited ``hold_s`` and only short ones keep it out."""
        w = self._first_long()
        return (
            w is not None
            and now - w.since >= self.hold_s
            and self._only_shorts_in_the_way(w.tokens)
            and not self._long_fits(w.tokens)
        )

    def _short_fits(self, tokens: int, now: float) -> bool:
        """Rule 3: the reserve, or free room in the lane while no long prompt claims it."""
        if self.short_tokens + tokens <= self.reserve:
            return True
        return self.tokens + tokens <= self.limit and not self.claimed(now)

    # ---- the async API ---------------------------------------------------------------------

    def reconfigure(self, limit: int, hold_s: float, reserve: int | None = None) -> None:
        """New settings (``reserve`` None: a quarter of ``limit``); prompts inside keep their class,
        waiters are sorted into the classes of the new reserve, in arrival order."""
        self.reserve = _checked_reserve(limit, reserve)
        self.limit, self.hold_s = limit, hold_s
        waiters = sorted([*self._longs, *self._shorts], key=lambda w: w.seq)
        for w in waiters:
            w.long = self.is_long(w.tokens)
        self._longs = deque(w for w in waiters if w.long)
        self._shorts = deque(w for w in waiters if not w.long)
        self._wake()  # a raised limit or a new reserve may let waiters in

    async def enter(self, tokens: int) -> GatePass:
        """Wait until ``tokens`` may be prefilled on this backend; the pass must be released."""
        long = self.is_long(tokens)
        now = self.clock()
        if long:
            fits = not self._longs and self._long_fits(tokens)
        else:
            fits = not self._shorts and self._short_fits(tokens, now)
        if fits:
            self._take(tokens, long)
            (self.long_stats if long else self.short_stats).entered(now, tokens, 0.0)
            return GatePass(self, tokens, 0.0, long, now)
        self._seq += 1
        waiter = _Waiter(tokens, long, self._seq, now, asyncio.get_running_loop().create_future())
        (self._longs if long else self._shorts).append(waiter)
        self.held_total += 1
        try:
            await waiter.future
        except asyncio.CancelledError:
            if waiter.future.done() and not waiter.future.cancelled():
                self.leave(tokens, waiter.long)  # let in just as it was cancelled: give the tokens back
            else:
                self._drop(waiter)
            raise
        entered_at = self.clock()
        waited = entered_at - now
        self.wait_s_total += waited
        (self.long_stats if waiter.long else self.short_stats).entered(entered_at, tokens, waited)
        return GatePass(self, tokens, waited, waiter.long, entered_at)

    def leave(self, tokens: int, long: bool, inside_s: float | None = None) -> None:
        """``tokens`` leave the class they entered as; ``inside_s``: how long they were inside."""
        if inside_s is not None:
            (self.long_stats if long else self.short_stats).inside.append(inside_s)
        self.tokens -= tokens
        self.requests -= 1
        if long:
            self.long_tokens -= tokens
            self.long_requests -= 1
        self._wake()

    def _take(self, tokens: int, long: bool) -> None:
        self.tokens += tokens
        self.requests += 1
        if long:
            self.long_tokens += tokens
            self.long_requests += 1

    def _drop(self, waiter: _Waiter) -> None:
        queue = self._longs if waiter.long else self._shorts
        try:
            queue.remove(waiter)
        except ValueError:
            return
        self._wake()  # it may have been claiming the lane, or first in its line

    def _wake(self) -> None:
        """Let in, first long prompts then short ones, each line in arrival order, every waiter at
        the head of its line that the rules admit; stop each line at the first that they do not."""
        if not self._longs and not self._shorts:
            return
        now = self.clock()
        for line in (self._longs, self._shorts):
            while line:
                w = line[0]
                if w.future.done():  # cancelled, its task not yet run: _drop would find it gone
                    line.popleft()
                    continue
                if not (self._long_fits(w.tokens) if w.long else self._short_fits(w.tokens, now)):
                    break
                line.popleft()
                self._take(w.tokens, w.long)
                w.future.set_result(None)

    def as_dict(self) -> dict[str, object]:
        now = self.clock()
        return {
            "limit": self.limit,
            "reserve": self.reserve,
            "hold_s": self.hold_s,
            "tokens": self.tokens,
            "long_tokens": self.long_tokens,
            "short_tokens": self.short_tokens,
            "requests": self.requests,
            "waiting": self.waiting,
            "waiting_long": len(self._longs),
            "claimed": self.claimed(now),
            "held_total": self.held_total,
            "wait_s_total": round(self.wait_s_total, 3),
            "short": self.short_stats.as_dict(now),
            "long": self.long_stats.as_dict(now),
        }


def _checked_reserve(limit: int, reserve: int | None) -> int:
    if reserve is None:
        return default_reserve(limit)
    if not 0 <= reserve < limit:
        raise ValueError(f"the prefill gate's reserve ({reserve}) must be >= 0 and below its limit ({limit})")
    return reserve

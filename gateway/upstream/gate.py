"""The prefill gate: per backend, a limit on prompt tokens sent but not yet prefilled.

On one shared server a long prompt's prefill stalls every co-batched request; several long prompts
prefilling at once stall them for longer still. Token budgets bound what a backend *holds* (KV cache),
not what it is *prefilling now*. The gate bounds the latter: a request enters with its prompt tokens
before it is forwarded and leaves at its first streamed token (its prefill is done), or when its
answer ends (non-streaming, errors). So:

- several long prompts are never prefilled at once: with ``limit`` below two long prompts, the
  second waits for the first one's first token;
- a long prompt is held back briefly while short ones are prefilling: a request that does not fit
  waits, and smaller ones that fit may pass it. After ``hold_s``, if only smaller requests keep it out
  (it would fit once they leave), it holds the line: nobody passes it until it is in, so a stream of
  short prompts cannot starve it. A prompt waiting for another long one does not hold the line: short
  ones keep passing (it would gain nothing from stopping them);
- a prompt larger than ``limit`` enters only an empty gate (it runs, alone).

Size ``limit`` at the largest prompt plus room for the short prompts that arrive while it prefills;
a limit below the largest prompt makes short requests wait behind it at the gateway.

One gate per backend, used only on the event loop: plain counters, no locks. Every entered pass is
released exactly once (:meth:`GatePass.release` is idempotent); a waiter cancelled while waiting
(client gone, shutdown) leaves the queue, and one cancelled just after it was let in gives its tokens
back at once.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(slots=True, eq=False)
class _Waiter:
    tokens: int
    since: float
    future: asyncio.Future[None]


class GatePass:
    """A request's tokens in a gate; ``release`` returns them (once, whoever calls it first)."""

    __slots__ = ("gate", "tokens", "waited_s")

    def __init__(self, gate: PrefillGate, tokens: int, waited_s: float) -> None:
        self.gate: PrefillGate | None = gate
        self.tokens = tokens
        self.waited_s = waited_s

    def release(self) -> None:
        gate = self.gate
        if gate is not None:
            self.gate = None
            gate.leave(self.tokens)

    @property
    def released(self) -> bool:
        return self.gate is None


class PrefillGate:
    __slots__ = (
        "_sizes",
        "_waiters",
        "clock",
        "held_total",
        "hold_s",
        "limit",
        "requests",
        "tokens",
        "wait_s_total",
    )

    def __init__(self, limit: int, hold_s: float = 1.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.limit = limit
        self.hold_s = hold_s
        self.clock = clock
        self.tokens = 0  # prompt tokens inside (sent, first token not seen yet)
        self.requests = 0  # requests inside
        self.held_total = 0  # requests that had to wait
        self.wait_s_total = 0.0
        self._waiters: deque[_Waiter] = deque()
        self._sizes: dict[int, int] = {}  # prompt size -> requests of that size inside

    @property
    def waiting(self) -> int:
        return len(self._waiters)

    def reconfigure(self, limit: int, hold_s: float) -> None:
        self.limit, self.hold_s = limit, hold_s
        self._wake()  # a raised limit may let waiters in

    def _fits(self, tokens: int) -> bool:
        return self.tokens + tokens <= self.limit or self.requests == 0

    def _only_smaller_in_the_way(self, tokens: int) -> bool:
        """Would ``tokens`` fit if every request inside smaller than it left?"""
        larger = sum(size * n for size, n in self._sizes.items() if size >= tokens)
        if tokens > self.limit:
            return larger == 0
        return larger + tokens <= self.limit

    def _holds_line(self, w: _Waiter, now: float) -> bool:
        return now - w.since >= self.hold_s and self._only_smaller_in_the_way(w.tokens)

    def _line_held(self, now: float) -> bool:
        """A waiter has been passed for ``hold_s`` by smaller ones: newcomers queue behind it."""
        return any(self._holds_line(w, now) for w in self._waiters)

    async def enter(self, tokens: int) -> GatePass:
        """Wait until ``tokens`` may be prefilled on this backend; the pass must be released."""
        if self._fits(tokens) and (not self._waiters or not self._line_held(self.clock())):
            self._take(tokens)
            return GatePass(self, tokens, 0.0)
        start = self.clock()
        waiter = _Waiter(tokens, start, asyncio.get_running_loop().create_future())
        self._waiters.append(waiter)
        self.held_total += 1
        try:
            await waiter.future
        except asyncio.CancelledError:
            if waiter.future.done() and not waiter.future.cancelled():
                self.leave(tokens)  # let in just as it was cancelled: give the tokens back
            else:
                self._drop(waiter)
            raise
        waited = self.clock() - start
        self.wait_s_total += waited
        return GatePass(self, tokens, waited)

    def leave(self, tokens: int) -> None:
        self.tokens -= tokens
        self.requests -= 1
        left = self._sizes[tokens] - 1
        if left:
            self._sizes[tokens] = left
        else:
            del self._sizes[tokens]
        self._wake()

    def _take(self, tokens: int) -> None:
        self.tokens += tokens
        self.requests += 1
        self._sizes[tokens] = self._sizes.get(tokens, 0) + 1

    def _drop(self, waiter: _Waiter) -> None:
        try:
            self._waiters.remove(waiter)
        except ValueError:
            return
        self._wake()  # it may have been holding the line

    def _wake(self) -> None:
        """Let in, in arrival order, every waiter that fits; one that does not fit may be passed by
        those behind it, unless it holds the line (waited ``hold_s``, kept out only by smaller ones)."""
        if not self._waiters:
            return
        now = self.clock()
        kept: deque[_Waiter] = deque()
        blocked = False
        for w in self._waiters:
            if blocked or w.future.done():
                if not w.future.done():
                    kept.append(w)
                continue
            if self._fits(w.tokens):
                self._take(w.tokens)
                w.future.set_result(None)
                continue
            kept.append(w)
            if self._holds_line(w, now):
                blocked = True
        self._waiters = kept

    def as_dict(self) -> dict[str, float | int]:
        return {
            "limit": self.limit,
            "hold_s": self.hold_s,
            "tokens": self.tokens,
            "requests": self.requests,
            "waiting": len(self._waiters),
            "held_total": self.held_total,
            "wait_s_total": round(self.wait_s_total, 3),
        }

"""Tokenizing long never-seen texts off the event loop, so a loop keeps serving meanwhile.

A never-seen 28k-token prompt is ~7 ms of tiktoken. `Encoder.price` runs a walk in two passes:

1. a first synchronous pass validates and prices everything cheap: the request's texts are
   counted inline while they total at most ``settings.inline_max_chars`` characters, and
   beyond that the texts the tokenizer has memoised; other texts are set aside (counting 0);
2. nothing set aside (every short request): the `Cost` is returned at once, with no thread hop
   and no suspension of the caller;
3. otherwise the set-aside texts are encoded concurrently in a pool of
   ``settings.encode_threads`` threads (tiktoken and ``encode_batch`` release the GIL, so the
   loop keeps serving other requests meanwhile), then a second pass prices with their counts.
   On Linux those threads run ``settings.encode_nice`` lower in CPU priority than the loop, and
   under ``SCHED_IDLE`` (``settings.encode_idle``, on by default): on
   a saturated machine a thread at the loop's priority takes the CPU from it as surely as an
   inline encode would (measured, docs/benchmarks.md), so long prompts wait for the CPU instead.

Every count of the second pass is exact, so the result (or exception) is the one an inline walk
gives. Validation errors raised by the first pass are raised at once (they do not depend on
counts); a context-length verdict waits for the real count so its message carries it. Only
tokenizers implementing `OffLoopCounting` (tiktoken, Hugging Face) are offloaded; the byte
estimate holds the GIL, so a thread would not free the loop, and it runs inline (about 1 ms per
100 KB).

Overload: the pool is bounded (``encode_threads``) and shared fairly among the callers'
``fair_key`` (the gateway passes the tenant; classifiers.fair_pool). A flood of huge prompts
queues there, waiting for a thread, instead of stalling the loop: their own pricing gets
slower, other requests' does not — not even another tenant's long prompt, which waits for one
chunk per thread, not for the flood. What can wait is bounded by the gateway's
own limits (``limits.max_body_bytes`` per request, ``max_connections`` requests), i.e. by
bodies the gateway already holds in memory; the queue holds references to those texts, no
copies. A caller cancelled while its texts wait (client disconnect) drops its queued encodes;
one already running finishes (at most one body's text). `Encoder.close` stops the pool at shutdown.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import os
import sys
import threading
from collections.abc import Callable

from classifiers.fair_pool import FairPool
from classifiers.pricing.cost import Cost, InvalidRequest
from classifiers.pricing.estimate import CharRatios, EstimateErrors
from classifiers.pricing.settings import PricingSettings
from classifiers.pricing.tokenizing import offloadable, scoped
from classifiers.tokenizers import OffLoopCounting, Tokenizer

# Errors that depend on how many tokens a text has: off the loop they wait for the real count.
_COUNT_VERDICTS = ("context_length_exceeded", "prompt_logprobs_too_long")

# Characters per job of the encode pool (Encoder._encode): ~1 ms of tiktoken, so a job's thread
# overhead is small next to its work, and the two threads still share a long prompt's texts.
_JOB_CHARS = 16_384

# A piece of a text to count: (the text, its index among the texts, start, stop).
_Span = tuple[str, int, int, int]


class Encoder:
    """Runs walks with long never-seen texts counted in a fair, low-priority thread pool."""

    def __init__(self, settings: PricingSettings) -> None:
        self._s = settings
        self._pool: FairPool | None = None
        self._pool_lock = threading.Lock()
        self._closed = False
        self.ratios = CharRatios()  # learned from every text encoded off the loop
        self.errors = EstimateErrors()

    async def price(self, walk: Callable[[Tokenizer], Cost], tok: Tokenizer, fair_key: str) -> Cost:
        """``walk(tok)``'s exact result (or exception): inline when nothing large and new is left
        after a first pass, else finished once the pool has counted those texts.

        ``fair_key`` (the tenant) is also the scope of the tokenizer's memo: a tenant's prices
        never come faster for texts another tenant sent (classifiers.tokenizers)."""
        tok = scoped(tok, fair_key)
        first = self._first_pass(walk, tok)
        if isinstance(first, Cost):
            return first
        texts = list(first.pending or ())
        estimated = self._estimated(walk, first, texts, fair_key)
        if estimated is not None:
            return estimated
        counts = await self._encode(first.tok, texts, fair_key)
        first.settle(dict(zip(texts, counts, strict=True)))
        return walk(first)

    def _estimated(
        self, walk: Callable[[Tokenizer], Cost], first: _Probe, texts: list[str], fair_key: str
    ) -> Cost | None:
        """The walk priced on estimates of ``texts`` (estimate.py), its exact cost being counted
        meanwhile; None where the exact count is wanted now: estimate mode off, these texts too
        short, no ratio learned yet, or a verdict (context length) that depends on the count."""
        s = self._s
        if not s.estimate_above_chars or sum(map(len, texts)) < s.estimate_above_chars:
            return None
        margin = s.estimate_margin_percent / 100
        name = first.tok.name
        estimates: dict[str, int] = {}
        for text in texts:
            n = self.ratios.estimate(fair_key, name, len(text), margin)
            if n is None:
                return None
            estimates[text] = n
        guess = _Probe(first.tok, 0)
        guess.settle(estimates)
        try:
            cost = walk(guess)
        except InvalidRequest as exc:
            if exc.code in _COUNT_VERDICTS:
                return None  # near the context length: the exact count decides, and names itself
            raise
        exact = asyncio.ensure_future(self._exact(walk, first, texts, fair_key, cost.prefill))
        self.errors.estimated += 1
        return Cost(cost.prefill, cost.decode, cost.per_choice, exact=exact)

    async def _exact(
        self, walk: Callable[[Tokenizer], Cost], first: _Probe, texts: list[str], fair_key: str, estimate: int
    ) -> Cost:
        counts = await self._encode(first.tok, texts, fair_key)
        first.settle(dict(zip(texts, counts, strict=True)))
        cost = walk(first)
        self.errors.observe(estimate, cost.prefill)
        return cost

    def backlog(self) -> dict[str, int]:
        """Characters waiting for an encode thread, per ``fair_key`` with any."""
        pool = self._pool
        return {} if pool is None else pool.backlog()

    def close(self) -> None:
        """Stop the pool; idempotent. Encodes still queued are cancelled and their callers count
        those texts inline instead; encodes already running finish first (each is one text, at most
        one request body long), so this returns within one encode. Pricing goes on, inline."""
        with self._pool_lock:
            self._closed = True
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown()

    def executor(self) -> FairPool | None:
        """The pool, started on first need (a pricer that never offloads has no threads); None once
        closed."""
        pool = self._pool
        if pool is None and not self._closed:
            with self._pool_lock:
                if self._pool is None and not self._closed:
                    self._pool = FairPool(
                        self._s.encode_threads,
                        name="tokengate-encode",
                        initializer=_lower_priority,
                        initargs=(self._s.encode_nice, self._s.encode_idle),
                    )
                pool = self._pool
        return pool

    def _first_pass(self, walk: Callable[[Tokenizer], Cost], tok: Tokenizer) -> Cost | _Probe:
        """Price with what is cheap now; a `_Probe` holding the texts to encode off the loop, if any."""
        if self._closed or self._s.encode_threads <= 0 or not offloadable(tok):
            return walk(tok)
        probe = _Probe(tok, self._s.inline_max_chars)
        try:
            cost = walk(probe)
        except InvalidRequest as exc:
            # A deferred text counted 0 so far: only a context-length verdict depends on it, and
            # its message must carry the real count, so that one waits for the encode.
            if probe.pending is None or exc.code not in _COUNT_VERDICTS:
                raise
            return probe
        return cost if probe.pending is None else probe

    async def _encode(self, tok: Tokenizer, texts: list[str], fair_key: str) -> list[int]:
        """Token counts of `texts`, encoded in the pool while the loop runs on.

        The pool shares its threads fairly among ``fair_key`` values (tenants; classifiers.fair_pool):
        one tenant's flood of long prompts is encoded beside, not before, another's. For that a
        long text goes to the pool as the chunks its tokenizer counts apart (``cuts``), so a
        newcomer waits for one job per thread, not for a whole body. Chunks go in jobs of at least
        ``_JOB_CHARS`` characters: a body of 100,000 tiny texts is a few dozen jobs, not 100,000
        (docs/benchmarks.md, "Many tiny texts"); and a request is one
        future, so the loop wakes once per request, not once per job."""
        pool = self.executor()
        off: OffLoopCounting = tok  # type: ignore[assignment]  # _first_pass checked offloadable
        jobs = _jobs(_spans(tok, texts))
        future: concurrent.futures.Future[list[list[int]]] | None = None
        if pool is not None:
            try:
                count = functools.partial(_count_each, off.count_nogil)
                future = pool.submit(fair_key, count, jobs, [_job_chars(job) for job in jobs])
            except RuntimeError:  # closed between executor() and submit: counted inline below
                pass
        if future is not None:
            try:
                await asyncio.wait([asyncio.wrap_future(future)])
            except asyncio.CancelledError:
                future.cancel()  # the caller went away (client disconnect): drop what has not started
                raise
        if future is None or future.cancelled():
            # Not submitted, or cancelled by close(): counted here, inline (shutdown fails no request).
            return [tok.count(text) for text in texts]
        counts = [0] * len(texts)
        for job, job_counts in zip(jobs, future.result(), strict=True):
            for (_, i, _, _), n in zip(job, job_counts, strict=True):
                counts[i] += n
        for text, n in zip(texts, counts, strict=True):
            self.ratios.observe(fair_key, tok.name, len(text), n)
        return counts


class _Probe:
    """The tokenizer a walk sees in `Encoder.price`: counts now what is cheap, defers the rest.

    First pass: texts are counted at once while the request's texts so far total at most
    `budget` characters (the inline budget: small requests never leave the loop), and beyond that
    any text the tokenizer has memoised; any other text is recorded in `pending` and counts 0 for
    now. The budget is per request, not per text, so many medium texts cannot add up to a long
    stall. After the pending texts are encoded off the loop, `settle` hands their counts over and
    the walk runs again: every count is then exact, so the second walk returns exactly what an
    inline walk would.
    """

    __slots__ = ("_budget", "_known", "name", "pending", "tok")

    def __init__(self, tok: Tokenizer, budget: int) -> None:
        self.tok = tok
        self.name = tok.name
        self._budget = budget
        self._known: dict[str, int] | None = None
        self.pending: dict[str, None] | None = None  # insertion-ordered set, made on first need

    def count(self, text: str) -> int:
        known = self._known
        if known is not None:
            n = known.get(text)
            # Second pass: a text not encoded off the loop is short or memoised: count it here.
            return n if n is not None else self.tok.count(text)
        size = len(text)
        if size <= self._budget:
            self._budget -= size
            return self.tok.count(text)
        self._budget = 0
        n = self.tok.cached_count(text)  # type: ignore[attr-defined]  # offloadable checked it
        if n is not None:
            return int(n)
        if self.pending is None:
            self.pending = {}
        self.pending[text] = None
        return 0

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text)

    def settle(self, counts: dict[str, int]) -> None:
        self._known = counts
        self.pending = None


def _lower_priority(nice: int, idle: bool) -> None:
    """Run in each encode thread as it starts: lower that thread's CPU priority alone."""
    if not sys.platform.startswith("linux"):
        return  # elsewhere PRIO_PROCESS takes a process id, not a thread's
    me = threading.get_native_id()
    # A sandbox may refuse either; the pool works the same, unprioritised.
    if nice > 0:
        with contextlib.suppress(OSError):
            os.setpriority(os.PRIO_PROCESS, me, min(19, os.getpriority(os.PRIO_PROCESS, me) + nice))
    if idle:
        with contextlib.suppress(OSError):
            os.sched_setscheduler(me, os.SCHED_IDLE, os.sched_param(0))


def _spans(tok: Tokenizer, texts: list[str]) -> list[_Span]:
    """``texts`` as the pieces ``tok`` counts apart (see TiktokenTokenizer.cuts); else whole."""
    cuts: Callable[[str], list[int]] | None = getattr(tok, "cuts", None)
    spans: list[_Span] = []
    for i, text in enumerate(texts):
        start = 0
        for stop in cuts(text) if cuts is not None else (len(text),):
            spans.append((text, i, start, stop))
            start = stop
    return spans


def _jobs(spans: list[_Span]) -> list[list[_Span]]:
    """``spans`` in order, cut into runs of at least ``_JOB_CHARS`` characters (the last may be less)."""
    jobs: list[list[_Span]] = []
    job: list[_Span] = []
    size = 0
    for span in spans:
        job.append(span)
        size += span[3] - span[2]
        if size >= _JOB_CHARS:
            jobs.append(job)
            job, size = [], 0
    if job:
        jobs.append(job)
    return jobs


def _job_chars(job: list[_Span]) -> int:
    return sum(stop - start for _, _, start, stop in job)


def _count_each(count: Callable[[str], int], job: list[_Span]) -> list[int]:
    # (the slice of a whole text is that text itself, not a copy)
    return [count(text[start:stop]) for text, _, start, stop in job]

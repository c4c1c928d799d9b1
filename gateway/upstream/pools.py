"""Backend pools: which backends serve a model, and which one gets the next request.

Each backend has a capacity in tokens (its KV cache) and a gateway-local count of tokens in
flight on it; routing picks, within the class's pool, the healthy backend serving the model
with the most free tokens. Health is a passive circuit breaker (consecutive connect failures
open it for a cooldown) plus an active probe (:mod:`gateway.upstream.health`) that closes it again;
a backend without a probe (``probe: off``) lets one request through after the cooldown instead
(half-open), and that request's answer closes the breaker.
"""

from __future__ import annotations

import time
from collections.abc import Collection, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Protocol

import aiohttp

from gateway.upstream.gate import PrefillGate


@dataclass(frozen=True, slots=True)
class Timeouts:
    connect_s: float = 2.0
    # Longest silence between two reads of the upstream answer (not the whole answer: a long
    # stream is fine as long as tokens keep coming).
    read_s: float = 600.0


@dataclass(frozen=True, slots=True)
class HealthProbe:
    """The active health probe of one backend: ``method path``, healthy on any status below 400;
    on a 404, ``fallback`` (when set) is asked instead."""

    path: str = "/health"
    method: str = "GET"  # GET or HEAD
    fallback: str | None = None


# GET /health (vLLM, SGLang, the reference backend), else GET /v1/models where there is no /health.
DEFAULT_PROBE = HealthProbe("/health", "GET", fallback="/v1/models")


@dataclass(frozen=True, slots=True)
class BackendSpec:
    url: str  # base URL without /v1, e.g. http://127.0.0.1:8001
    capacity_tokens: int
    models: tuple[str, ...] = ()  # empty = serves every model (the gateway forwards the name)
    api_key: str | None = None
    accepts_priority: bool = False
    # The engine's most running sequences (vLLM / SGLang --max-num-seqs / --max-running-requests):
    # with it on every backend of a pool, each sequence holds at least the pool's tokens per
    # sequence, so tiny requests cannot fill the engine's sequence slots past the gateway's queue.
    max_num_seqs: int | None = None
    # Tokens per block of the engine's KV cache (vLLM --block-size, 16 on GPUs; TGI 16; SGLang's
    # page size, 1 by default): a sequence holds whole blocks, so each request holds its tokens per
    # sequence rounded up to whole blocks, and capacity_tokens may be the whole cache
    # (num_gpu_blocks x block_size) without the engine running out of blocks first.
    block_size: int = 1
    # "client": a request's own cache_salt goes as sent; "tenant": the gateway sets it from the
    # tenant, so no two tenants share the engine's prefix cache (gateway.request.cache_salt).
    cache_salt: str = "client"
    # A header the gateway sets to the authenticated tenant's name on every request to this backend
    # (any value a client sent under that name is dropped): the fairness id of an llm-d / Gateway
    # API inference gateway's flow control (x-gateway-inference-fairness-id), SGLang's model-gateway
    # routing key (x-smg-routing-key: each tenant's requests share one worker's prefix cache).
    tenant_header: str | None = None
    # The header that carries the gateway's request id to this backend (joins its logs to ours);
    # None: not sent. Ids are UUID-shaped, which engines that validate the header accept.
    request_id_header: str | None = "x-request-id"
    # The active health probe; None: none (an engine that serves one request at a time, or cuts a
    # running stream when another request arrives, as llama-cpp-python's server does): its health
    # then comes from requests only.
    probe: HealthProbe | None = DEFAULT_PROBE
    timeouts: Timeouts = Timeouts()
    name: str = ""  # defaults to the URL; used in metrics and logs
    draining: bool = False  # takes no new requests; those in flight finish (before removing it)


@dataclass(frozen=True, slots=True)
class BackendPoolSpec:
    name: str
    backends: tuple[BackendSpec, ...]
    budget_tokens: int | None = None  # the pool's budget; default: its backends' capacities summed
    # Per backend of the pool: prompt tokens sent but not yet prefilled (None: no gate). See
    # gateway.upstream.gate: several long prompts never prefill at once on one server.
    prefill_gate_tokens: int | None = None
    prefill_gate_hold_s: float = 1.0  # a long prompt lets short ones borrow its lane this long
    # Of prefill_gate_tokens, what only short prompts (at most this many tokens) may use; None: a quarter.
    prefill_gate_reserve_tokens: int | None = None

    @property
    def capacity_tokens(self) -> int:
        """Tokens the pool may hold in flight."""
        if self.budget_tokens is not None:
            return self.budget_tokens
        return sum(b.capacity_tokens for b in self.backends if not b.draining)


@dataclass(frozen=True, slots=True)
class BreakerSettings:
    failure_threshold: int = 3  # consecutive connect failures that open the breaker
    cooldown_s: float = 5.0  # the breaker stays open at least this long


class LoadSignal(Protocol):
    """What a backend's own metrics say about its load (set by a scraper, read per request).

    ``penalty()`` is 0 for a backend with room, rising towards 1 as its KV cache fills; a
    ``saturated`` backend (KV full, preemption thrash, stale metrics) is avoided while another
    one can take the request.
    """

    @property
    def saturated(self) -> bool: ...

    def penalty(self) -> float: ...


@dataclass(slots=True, eq=False)
class Backend:
    """One backend's live state. Mutated only from the event loop thread.

    A reconfiguration (reload, admin API) keeps the object of a backend that stays (same pool and
    URL) and gives it its new spec (``respec``): requests in flight hold this object, so its counters
    and health must carry over.
    """

    spec: BackendSpec
    pool: str
    breaker: BreakerSettings = BreakerSettings()
    in_flight_tokens: int = 0
    in_flight_requests: int = 0
    healthy: bool = True  # optimistic until failures open the breaker: routing may try it
    # It has answered (a health probe or a request) at least once. Until then its health is unknown:
    # it still takes requests, but /readyz does not count it.
    confirmed: bool = False
    consecutive_failures: int = 0
    down_since: float = 0.0
    discovered_models: tuple[str, ...] = ()
    # Response bytes (or headers) arrived since the health checker last looked: set by the request
    # path per chunk read, a bare attribute store (no clock read on the hot path); the checker folds
    # it into ``last_progress`` (``progress_seen``) once per probe of this backend.
    progressed: bool = False
    last_progress: float = 0.0  # time.monotonic() of the last pass that found ``progressed`` set
    load: LoadSignal | None = None  # optional, from scraping the backend's /metrics
    gate: PrefillGate | None = None  # the pool's prefill gate, one per backend (None: off)
    # Metered answers (chat, completions, Responses) that carried usage, and that did not (their
    # usage estimated: gateway.request.usage); /stats and the doctor name a backend that never reports it.
    usage_reported: int = 0
    usage_missing: int = 0
    # Derived from the spec once (the proxy uses them per request).
    request_timeout: aiohttp.ClientTimeout = field(default_factory=aiohttp.ClientTimeout)
    auth_header: tuple[str, str] | None = None
    _models: frozenset[str] = field(default_factory=frozenset)

    def __post_init__(self) -> None:
        self.respec(self.spec, self.breaker)

    def respec(self, spec: BackendSpec, breaker: BreakerSettings) -> None:
        self.spec = spec
        self.breaker = breaker
        self._models = frozenset(spec.models)
        t = spec.timeouts
        self.request_timeout = aiohttp.ClientTimeout(total=None, sock_connect=t.connect_s, sock_read=t.read_s)
        self.auth_header = ("Authorization", f"Bearer {spec.api_key}") if spec.api_key else None

    @property
    def available(self) -> bool:
        """May take a new request: healthy and not draining. A backend without an active probe
        whose breaker is open is half-open once the cooldown has passed: it takes one request at a
        time (none other in flight) to find out whether it is back."""
        if self.healthy:
            return not self.spec.draining
        return (
            self.spec.probe is None
            and not self.spec.draining
            and self.in_flight_requests == 0
            and time.monotonic() - self.down_since >= self.breaker.cooldown_s
        )

    @property
    def name(self) -> str:
        return self.spec.name or self.spec.url

    @property
    def free_tokens(self) -> int:
        return self.spec.capacity_tokens - self.in_flight_tokens

    @contextmanager
    def occupy(self, tokens: int) -> Iterator[None]:
        """Count a request against this backend while it is being served (routing prefers the freest)."""
        self.in_flight_tokens += tokens
        self.in_flight_requests += 1
        # A request handed to it counts as progress: the health checker leaves it one probe period
        # to answer before it probes a busy backend (a probe could cut its stream just as it starts).
        self.progressed = True
        try:
            yield
        finally:
            self.in_flight_tokens -= tokens
            self.in_flight_requests -= 1

    def serves(self, model: str) -> bool:
        return not self._models or model in self._models

    @property
    def state(self) -> str:
        """``up``, ``down`` (breaker open) or ``unknown`` (never answered yet), for /stats and the doctor."""
        if not self.healthy:
            return "down"
        return "up" if self.confirmed else "unknown"

    def set_gate(self, limit: int | None, hold_s: float, reserve: int | None = None) -> None:
        """Turn the prefill gate on, off, or change it; requests inside keep the gate they entered.
        ``reserve`` None: a quarter of ``limit``."""
        if limit is None:
            self.gate = None
        elif self.gate is None:
            self.gate = PrefillGate(limit, hold_s, reserve)
        else:
            self.gate.reconfigure(limit, hold_s, reserve)

    def record_success(self) -> bool:
        """A request got its answer's headers; True when this closed the breaker (a half-open
        request to a backend without a probe: with one, only the probe closes it)."""
        self.consecutive_failures = 0
        self.confirmed = True
        if self.healthy or self.spec.probe is not None:
            return False
        self.healthy = True
        return True

    def record_connect_failure(self, now: float | None = None) -> bool:
        """Count a failure to reach the backend; True when this opened the breaker."""
        self.consecutive_failures += 1
        if self.healthy and self.consecutive_failures >= self.breaker.failure_threshold:
            self.healthy = False
            self.down_since = time.monotonic() if now is None else now
            return True
        if not self.healthy and self.spec.probe is None:
            self.down_since = time.monotonic() if now is None else now  # half-open failed: reopen
        return False

    def progress_seen(self, now: float) -> float:
        """``last_progress``, brought up to ``now`` if bytes arrived since the last call (the flag
        is cleared): one reader, the health checker, calls it once per probe of this backend."""
        if self.progressed:
            self.progressed = False
            self.last_progress = now
        return self.last_progress

    def probe_succeeded(self, now: float | None = None) -> bool:
        """An active health probe answered; True when this closed the breaker."""
        now = time.monotonic() if now is None else now
        self.confirmed = True
        if self.healthy:
            self.consecutive_failures = 0
            return False
        if now - self.down_since < self.breaker.cooldown_s:
            return False
        self.healthy = True
        self.consecutive_failures = 0
        return True

    def probe_failed(self, now: float | None = None) -> bool:
        return self.record_connect_failure(now)


class BackendPool:
    def __init__(self, name: str, backends: Sequence[Backend]) -> None:
        self.name = name
        self.backends: tuple[Backend, ...] = tuple(backends)
        self.capacity_tokens = sum(b.spec.capacity_tokens for b in self.backends)
        # Tokens one running sequence stands for (0: some backend's max_num_seqs is not known).
        seqs = [b.spec.max_num_seqs or 0 for b in self.backends]
        self.sequence_tokens = -(-self.capacity_tokens // sum(seqs)) if seqs and all(seqs) else 0
        # A sequence's tokens held in whole blocks of this size (the largest of the pool's backends).
        self.block_tokens = max((b.spec.block_size for b in self.backends), default=1)

    def serves(self, model: str) -> bool:
        if len(self.backends) == 1:  # the common pool of one, on every request: no generator
            return self.backends[0].serves(model)
        return any(b.serves(model) for b in self.backends)

    def has_healthy(self, model: str) -> bool:
        if len(self.backends) == 1:
            b = self.backends[0]
            return b.available and b.serves(model)
        return any(b.available and b.serves(model) for b in self.backends)

    def pick(self, model: str | None, exclude: Collection[Backend] = ()) -> Backend | None:
        """The healthy backend serving ``model`` (None: any) with the most free tokens (first on ties),
        leaving out ``exclude`` (backends a request already failed to connect to).

        With a load signal, free tokens are scaled by ``1 - penalty()`` and saturated backends are
        used only when no other one serves the model.
        """
        if len(self.backends) == 1:  # the common pool of one: nothing to rank
            b = self.backends[0]
            ok = b.available and (model is None or b.serves(model)) and b not in exclude
            return b if ok else None
        best: Backend | None = None
        best_key = (False, 0.0)
        for b in self.backends:
            if b.available and (model is None or b.serves(model)) and b not in exclude:
                load = b.load
                if load is None:
                    key = (True, float(b.free_tokens))
                else:
                    key = (not load.saturated, b.free_tokens * (1.0 - load.penalty()))
                if best is None or key > best_key:
                    best, best_key = b, key
        return best


class NoBackend(Exception):
    """No backend can take the request; ``unknown_model`` distinguishes 404 from 503."""

    def __init__(self, message: str, *, unknown_model: bool) -> None:
        super().__init__(message)
        self.message = message
        self.unknown_model = unknown_model


@dataclass(frozen=True, slots=True)
class Reconfigured:
    added: tuple[Backend, ...]
    removed: tuple[Backend, ...]


class Router:
    def __init__(
        self, pools: Sequence[BackendPoolSpec], breaker: BreakerSettings = BreakerSettings()
    ) -> None:
        self.pools: dict[str, BackendPool] = {}
        self._serves_all = False
        self._configured_models: frozenset[str] = frozenset()
        self.reconfigure(pools, breaker)

    def reconfigure(
        self, pools: Sequence[BackendPoolSpec], breaker: BreakerSettings = BreakerSettings()
    ) -> Reconfigured:
        """Take a new set of pools; backends that stay (same pool and URL) keep their live state.

        Returns what was added and removed (the health checker and scraper follow).
        """
        if not pools:
            raise ValueError("at least one backend pool is required")
        old = {(b.pool, b.spec.url): b for b in self.backends}
        kept: set[int] = set()
        added: list[Backend] = []
        new_pools: dict[str, BackendPool] = {}
        for p in pools:
            members = []
            for spec in p.backends:
                b = old.get((p.name, spec.url))
                if b is None:
                    b = Backend(spec, p.name, breaker)
                    added.append(b)
                else:
                    b.respec(spec, breaker)
                    kept.add(id(b))
                b.set_gate(p.prefill_gate_tokens, p.prefill_gate_hold_s, p.prefill_gate_reserve_tokens)
                members.append(b)
            new_pools[p.name] = BackendPool(p.name, members)
        removed = tuple(b for b in old.values() if id(b) not in kept)
        self.pools = new_pools
        self._serves_all = any(not b.models for p in pools for b in p.backends)
        self._configured_models = frozenset(m for p in pools for b in p.backends for m in b.models)
        return Reconfigured(tuple(added), removed)

    @property
    def backends(self) -> Iterable[Backend]:
        for p in self.pools.values():
            yield from p.backends

    def known_model(self, model: str) -> bool:
        return self._serves_all or model in self._configured_models

    def served_models(self) -> list[str]:
        """Configured models plus what model-agnostic backends reported, in config order."""
        seen: dict[str, None] = {}
        for b in self.backends:
            for m in b.spec.models or b.discovered_models:
                seen.setdefault(m, None)
        return list(seen)

    def home_pool(self, model: str) -> str | None:
        """The first pool (config order) with a backend serving ``model``."""
        for p in self.pools.values():
            if p.serves(model):
                return p.name
        return None

    def choose_pool(self, model: str, primary: str | None, overflow: str | None) -> str:
        """The pool a request goes to: ``primary`` unless it has no healthy backend for the model.

        ``primary`` None means no class rule chose one: the model's home pool.
        """
        if not self.known_model(model):
            served = ", ".join(self.served_models()) or "(none)"
            raise NoBackend(
                f"The model {model!r} does not exist or is not served here; served models: {served}",
                unknown_model=True,
            )
        if primary is None:
            primary = self.home_pool(model)
            if primary is None:  # pragma: no cover - known_model guarantees a home
                raise NoBackend(f"The model {model!r} is not served by any pool", unknown_model=True)
        pool = self.pools[primary]
        if pool.has_healthy(model):
            return primary
        if overflow is not None and self.pools[overflow].has_healthy(model):
            return overflow
        if not pool.serves(model) and (overflow is None or not self.pools[overflow].serves(model)):
            served_by = [p.name for p in self.pools.values() if p.serves(model)]
            raise NoBackend(
                f"The model {model!r} is served by pool(s) {', '.join(served_by)}, but this request's class "
                f"routes to pool {primary!r}; change the class rules or the pool's models",
                unknown_model=True,
            )
        raise NoBackend(
            f"No healthy backend serves model {model!r} in pool {primary!r}"
            + (f" or overflow pool {overflow!r}" if overflow else ""),
            unknown_model=False,
        )

"""One request inside the gateway: the ``Exchange`` every step of the request path reads and fills.

The proxy's steps (``gateway.request.proxy``) each take the exchange and fill in their part: authenticate ->
tenant, tier, forwarded headers; read -> the raw body; price -> model, body, cost; classify -> class
and pool; admit -> lease; forward -> backend and the usage it reported. Drain and the disconnect
watcher see the same object (its phase, and ``cancel``), so there is exactly one per-request object.
"""

from __future__ import annotations

import asyncio
import enum
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from budgets.types import Lease
from classifiers import Cost
from gateway.config.schema import TenantConfig, TierConfig
from gateway.observe.accesslog import Record
from gateway.observe.metrics import Bound
from gateway.request.passthrough import PassthroughRoute
from gateway.request.quotas import QuotaHold
from gateway.request.reservations import Reserved
from gateway.request.shadow import ShadowHold
from gateway.upstream.client import HeaderNames
from gateway.upstream.gate import GatePass

if TYPE_CHECKING:
    from gateway.upstream.pools import Backend

NO_HEADERS = HeaderNames()

Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]


class RouteKind(enum.Enum):
    CHAT = "chat"
    COMPLETION = "completion"
    EMBEDDING = "embedding"
    RESPONSES = "responses"
    PASSTHROUGH = "passthrough"


class Phase(enum.IntEnum):
    """Where a request is; drain fails those not yet upstream."""

    PRE = 0  # authenticating, reading, pricing
    QUEUED = 1  # waiting for a grant
    UPSTREAM = 2  # forwarded: drain lets it finish


class CancelReason(enum.Enum):
    DISCONNECT = "disconnect"
    DRAINING = "draining"
    SHUTDOWN = "shutdown"


class Forwarder(Protocol):
    """A front end that forwards an admitted request itself (Envoy, through the external processor:
    gateway.extproc) instead of the proxy's own HTTP client.

    ``forward`` gets the request as the proxy would send it to ``backend`` (the body's bytes and the
    headers to forward) and ``grow``, the lease-growth hook of a stream (or None); it relays the
    answer, filling the record as the proxy's relays do (status, TTFT, time upstream, ``started``,
    ``sse``, ``streamed_tokens``, ``stream_complete``), and returns the usage object the answer
    carried (None: none). An answer >= 500 raises an ``ApiError``, as the proxy's relay does.
    """

    async def forward(
        self,
        x: Exchange,
        backend: Backend,
        payload: bytes,
        headers: list[tuple[str, str]],
        grow: Callable[[Exchange], Awaitable[None]] | None,
    ) -> Any: ...


@dataclass(frozen=True, slots=True)
class Placement:
    """Where a priced request goes: its class, the backend pool, and the class pool if it has one."""

    klass: str
    pool: str
    pools: tuple[str, ...]  # the budget pools the demand takes tokens from


@dataclass(slots=True, eq=False)
class Exchange:
    scope: Scope
    receive: Receive
    send: Send
    kind: RouteKind
    route: PassthroughRoute | None  # the allowlist entry of a pass-through request
    record: Record
    task: asyncio.Task[Any]
    # The request's life, as drain and the disconnect watcher see it.
    phase: Phase = Phase.PRE
    cancel_reason: CancelReason | None = None
    done: bool = False  # the final response message is being sent: never cancel now
    started: bool = False  # response headers sent
    sse: bool = False  # the answer under way is an SSE stream (one that fails ends with an error event)
    bound: Bound | None = None  # metrics children, once the class is known
    # authenticate
    tenant: TenantConfig | None = None
    tier: TierConfig | None = None
    api_key: str = ""  # the key's id (its SHA-256, hex) when it named a tenant; "" in open mode
    headers: list[tuple[str, str]] = field(default_factory=list)  # forwarded upstream
    has_content_type: bool = False
    content_length: int = -1
    max_wait_s: float = 0.0
    private_headers: HeaderNames = NO_HEADERS  # the serving stack's: kept out of the answer too
    held_body: int = 0  # bytes of body it holds in the process's HeldBodies
    # read, price
    raw: bytes = b""
    body: dict[str, Any] | None = None  # parsed JSON object (priced routes; pass-through if JSON)
    sent: bytes = (
        b""  # ``body`` serialized: what the backend reads unless a field must change (b"": made at the send)
    )
    model: str = ""  # "" only for a pass-through request that names no served model
    cost: Cost | None = None
    # What the model's prompt overhead added to the priced prompt (negative: took off); cost.prefill
    # holds it, and the priced prompt is cost.prefill - prompt_overhead (classifiers/prompt_overhead.py).
    prompt_overhead: int = 0
    # Priced on an estimate (classifiers/pricing/estimate.py): the exact cost being counted, the
    # estimate's priced prompt, and the cost as priced (to classify again on the exact count);
    # the task that corrects the lease once the exact count is in.
    exact: asyncio.Future[Cost] | None = None
    estimated_prefill: int = 0
    priced: Cost | None = None
    correction: asyncio.Task[None] | None = None
    # classify, admit
    placement: Placement | None = None
    reserved: Reserved | None = None  # output tokens held for it, and what they may grow to
    oracle_output: int | None = None  # benchmarks: the true output length (x-tokengate-oracle-output)
    lease: Lease | None = None
    quota: QuotaHold | None = None  # what its quotas hold for it (settled once, at its end)
    ratelimit: list[tuple[bytes, bytes]] | None = None  # OpenAI's x-ratelimit-* headers of its quotas
    shadow: ShadowHold | None = None  # its place in the gauges of limits in shadow mode (given back once)
    # forward
    forwarder: Forwarder | None = None  # another front end forwards it (None: the proxy's client)
    client_wants_usage: bool = True
    gate: GatePass | None = None  # in the backend's prefill gate: released at the first token or the end
    # Served output for fair share: as reported; 0 when nothing reached a backend or it answered an
    # error; None when unknown (the store then charges the whole reservation).
    completion_tokens: int | None = None
    streamed_tokens: int = 0  # output events relayed so far (a stream's tokens, about one an event)
    # The stream's end ([DONE], or its final usage event) was relayed: the answer is whole, and a
    # client that hangs up now (the official SDKs close at [DONE]) has its request completed.
    stream_complete: bool = False
    extended_tokens: int = 0  # what lease growth added to the reservation
    grow_at: float = float("inf")  # streamed tokens at which the lease grows next (inf: never)

    def cancel(self, reason: CancelReason) -> None:
        if not self.done and self.cancel_reason is None:
            self.cancel_reason = reason
            self.task.cancel()

    def disconnected(self) -> None:
        """The client hung up (called by the server's signal or the disconnect watcher)."""
        self.cancel(CancelReason.DISCONNECT)

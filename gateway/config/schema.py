"""The gateway's configuration: frozen dataclasses, one per YAML section.

Every key is optional; ``GatewayConfig()`` is the embedded default (memory store, three tiers,
one open tenant, no pools -> ``tokengate serve`` starts two simulated reference backends
in-process as pools ``short`` and ``long`` with a class rule between them, see
:mod:`gateway.process.embedded`). Parsing and validation live in :mod:`gateway.config.loader`; nothing
here reads files.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from budgets.quota import ModelPrice, QuotaSpec
from budgets.redis import RedisOptions
from budgets.types import QueueOrder
from classifiers import ClassRule, PricingSettings
from classifiers.images import ImageRule
from classifiers.reservation import ReservationSettings
from gateway.observe.settings import ObserveSettings
from gateway.observe.tracing import TracingSettings
from gateway.request.passthrough import DEFAULT_ROUTES, PassthroughRoute
from gateway.request.reservations import ReservationConfig
from gateway.upstream.client import PRIVATE_HEADERS
from gateway.upstream.pools import BackendPoolSpec, BackendSpec, Timeouts

DEFAULT_CONTEXT_LENGTH = 32768
DEFAULT_TOKENIZER = "cl100k_base"
OPEN_TENANT = "default"


@dataclass(frozen=True, slots=True)
class ListenConfig:
    host: str = "127.0.0.1"
    port: int = 8080


@dataclass(frozen=True, slots=True)
class StoreConfig:
    kind: Literal["memory", "redis"] = "memory"
    redis: RedisOptions | None = None  # the redis section, typed (gateway.config.stores.parse_store)
    # Budget domains beside the default one (budgets.domains): each owns some backend pools.
    domains: tuple[DomainConfig, ...] = ()


@dataclass(frozen=True, slots=True)
class DomainConfig:
    """One budget domain of ``store.domains``: its backend pools and, for Redis, where its keys
    live (the store's options with this domain's ``key_prefix`` and, if set, its own ``url``)."""

    name: str
    pools: tuple[str, ...]
    redis: RedisOptions | None = None


@dataclass(frozen=True, slots=True)
class TierConfig:
    name: str
    rank: int
    ceiling: float = 1.0
    max_queue_wait_s: float = 60.0
    # False: shadow mode, the ceiling never holds a request back; what it would have is counted
    # (gateway/request/shadow.py).
    ceiling_enforce: bool = True


DEFAULT_TIERS: tuple[TierConfig, ...] = (
    TierConfig("critical", 0, 1.0, 30.0),
    TierConfig("standard", 1, 0.9, 60.0),
    TierConfig("batch", 2, 0.7, 600.0),
)


@dataclass(frozen=True, slots=True)
class FairnessConfig:
    prefill_weight: float = 1.0
    decode_weight: float = 2.0
    backfill_limit_s: float = 2.0
    # Order inside one tenant's queue (budgets/policy.py): "fifo", or "shortest_first" (shortest
    # predicted output first, a ticket passed only by its tenant's tickets enqueued less than
    # max_defer_s after it; the delay per predicted output token is defer_s_per_token).
    tenant_queue_order: QueueOrder = "fifo"
    max_defer_s: float = 10.0
    defer_s_per_token: float = 0.01


@dataclass(frozen=True, slots=True)
class LeasesConfig:
    ttl_s: float = 10.0


@dataclass(frozen=True, slots=True)
class UsageLogConfig:
    """Usage kept for billing (gateway/request/billing.py): per hour, tenant, key and model."""

    enabled: bool = True
    keep_days: int = 35  # how long an hour's rows are kept after its last request
    flush_s: float = 1.0  # how often a replica adds what it counted to the store


EXTPROC_HEADROOM = 1 << 20  # room for a request's headers beside its body in one ext_proc message


@dataclass(frozen=True, slots=True)
class ExtprocConfig:
    """Envoy's external processor (``tokengate extproc``, gateway/extproc): the same admission as the
    proxy, for requests Envoy forwards. Off unless enabled here or by the command."""

    enabled: bool = False
    host: str = "127.0.0.1"
    port: int = 9002  # the gRPC listener Envoy's ext_proc filter calls
    # How long Envoy is asked to wait for the answer to a request's body while it is priced and
    # queued (its override_message_timeout); at most Envoy's max_message_timeout.
    max_message_timeout_s: float = 60.0
    # Sent to Envoy that long after the body came when no answer is ready yet (the request queues,
    # or a long prompt is counted): under Envoy's message_timeout, which it extends.
    extend_after_s: float = 0.1
    # The largest message taken from Envoy (the request's body buffered whole, and its headers): at
    # least Envoy's buffer limit (per_connection_buffer_limit_bytes, 32 MiB in deploy/envoy), so a
    # body past limits.max_body_bytes still reaches the gateway and gets its 413; a larger message
    # fails the stream, and Envoy answers 500 itself. None: the larger of 34 MiB and
    # limits.max_body_bytes + 1 MiB (``message_limit``).
    max_message_bytes: int | None = None
    pool_header: str = "x-tokengate-pool"  # the pool, for the route's cluster_header
    # For an endpoint picker behind Envoy (llm-d's flow control): the tenant and the tier.
    fairness_header: str = "x-llm-d-inference-fairness-id"
    objective_header: str = "x-llm-d-inference-objective"

    def message_limit(self, max_body_bytes: int) -> int:
        """The gRPC receive limit: ``max_message_bytes``, or what its comment says when unset."""
        if self.max_message_bytes is not None:
            return self.max_message_bytes
        return max(34 << 20, max_body_bytes + EXTPROC_HEADROOM)


# The backend-side shapes are defined with the routing code (gateway.upstream.pools) and used
# directly as the config sections.
TimeoutsConfig = Timeouts
BackendConfig = BackendSpec
PoolConfig = BackendPoolSpec


@dataclass(frozen=True, slots=True)
class ModelConfig:
    pattern: str  # fnmatch glob over the request's model name
    tokenizer: str | None = None  # spec for classifiers.TokenizerRegistry
    context_length: int = DEFAULT_CONTEXT_LENGTH
    images: ImageRule | None = None  # what one image costs; None: pricing.image_tokens
    # Rows of the model's embedding / LM head (config.json's vocab_size): token ids the request
    # carries (token-id prompts, stop_token_ids, allowed_token_ids, logit_bias) must be below it.
    # None: only their shape and count are checked.
    vocab_size: int | None = None
    # Tokens the model's chat template adds to every chat / responses prompt beyond what pricing
    # counts (system prompt, special tokens); None: learned from the usage engines report, when
    # learn_prompt_overhead (classifiers/prompt_overhead.py).
    prompt_overhead_tokens: int | None = None
    learn_prompt_overhead: bool = True
    # Currency per million tokens, for cost quotas (budgets.quota); None: not priced.
    price: ModelPrice | None = None


@dataclass(frozen=True, slots=True)
class PricingConfig:
    default_max_tokens: int = 1024
    # The pricer's own settings (per_message_tokens, image_tokens, encode_threads, ...): owned by
    # classifiers, read from the same `pricing:` section.
    settings: PricingSettings = field(default_factory=PricingSettings)


@dataclass(frozen=True, slots=True)
class TenantConfig:
    name: str
    keys: tuple[str, ...] = ()  # plain keys or "sha256:<hex>"
    budget_tokens: int | None = None  # None = bounded only by the backend pools
    # False: shadow mode, the budget never holds a request back; what it would have is counted
    # (gateway/request/shadow.py).
    budget_enforce: bool = True
    weight: float = 1.0
    tier: str = "standard"  # highest tier this tenant may use
    default_max_tokens: int | None = None  # None = pricing.default_max_tokens
    max_max_tokens: int | None = None  # larger per-choice requests are a 400
    max_queue_len: int = 64
    models: tuple[str, ...] = ()  # model globs this tenant may use; empty = every served model
    # Server-run Responses tools it may use (gateway/request/server_tools.py): tool types, "mcp:<label>",
    # "mcp:*"; () none; None whatever the engine runs.
    server_tools: tuple[str, ...] | None = None
    # Token and cost quotas over time (budgets.quota; docs/quotas.md).
    quotas: tuple[QuotaSpec, ...] = ()

    @property
    def enforced_budget(self) -> int | None:
        """The budget the pools hold it to: None without one, or with one in shadow mode."""
        return self.budget_tokens if self.budget_enforce else None


# The keys of a tenant's section in the file (all but its name).
TENANT_KEYS: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(TenantConfig) if f.name != "name")


# Request fields an engine reads from the body but trusts only from its own serving stack:
# vLLM's prefill/decode connector metadata (a client's remote_host / remote_port steered the decode
# instance's connections, vLLM PR #47843; its tp_size made it allocate without bound, #51137);
# SGLang's prefill/decode bootstrap address and room; SGLang's custom_logit_processor, a serialized
# Python callable the server runs when started with --enable-custom-logit-processor; SGLang's rid,
# the request's id inside the engine (two requests with one rid hung or crashed SGLang before PR
# #19035, and since then the second is refused: a tenant must not choose ids others could hold).
ENGINE_INTERNAL_FIELDS: tuple[str, ...] = (
    "kv_transfer_params",
    "bootstrap_host",
    "bootstrap_port",
    "bootstrap_room",
    "custom_logit_processor",
    "rid",
)


@dataclass(frozen=True, slots=True)
class LimitsConfig:
    max_body_bytes: int = 4 * 1024 * 1024
    max_header_bytes: int = 32 * 1024  # request line + headers; above: 431
    header_timeout_s: float = 10.0  # headers complete within this of the connection/request start
    body_timeout_s: float = 30.0  # the whole body within this of the headers; then 408
    body_idle_timeout_s: float = 5.0  # and no gap longer than this between two body chunks
    max_connections: int = 4096  # open client connections per process; beyond: 503 at once
    # ...of which one tenant may hold (0: no bound): its request on one more is a 429, and that
    # connection is closed (gateway/request/tenant_connections.py). Not in open mode.
    max_connections_per_tenant: int = 1024
    # Bytes of request bodies one process holds at once (read, queued or forwarded; 0: no bound):
    # beyond the tenant's share a 429, beyond the whole a 503 (gateway/request/held_bodies.py). Each body
    # is counted once; the process holds ~2.5x that (parsed, and serialized to send): 256 MiB fits
    # the 1 GiB container of deploy/k8s beside the process's own ~100 MiB.
    max_held_body_bytes: int = 256 * 1024 * 1024
    max_held_body_bytes_per_tenant: int = 64 * 1024 * 1024
    # Top-level body fields that only the serving stack may set: a request carrying one is a 400.
    refused_fields: tuple[str, ...] = ENGINE_INTERNAL_FIELDS
    # The serving stack's own headers (names, or prefixes ending in "*"): never forwarded from a
    # client, never relayed to one (gateway/upstream/client.py PRIVATE_HEADERS).
    private_headers: tuple[str, ...] = PRIVATE_HEADERS


@dataclass(frozen=True, slots=True)
class AdminConfig:
    # Lines "<role> <token>" (admin | read | metrics), besides TOKENGATE_ADMIN_TOKEN,
    # TOKENGATE_READONLY_TOKEN and TOKENGATE_METRICS_TOKEN. No token at all: the admin API is off.
    tokens_file: str | None = None
    # Memory store: persist what the admin API changed here (JSON). With the Redis store the state
    # lives in Redis, shared by every replica.
    state_file: str | None = None


@dataclass(frozen=True, slots=True)
class OpsConfig:
    """The ops listener: /metrics, /stats, /insights, /dashboard, /admin (and /healthz, /readyz)."""

    host: str = "127.0.0.1"
    port: int | None = 9091  # None: no listener of its own; ops routes on the API port, token required
    metrics_auth: bool = False  # /metrics needs a metrics/read/admin token on the ops listener too


@dataclass(frozen=True, slots=True)
class GcConfig:
    """The process's garbage collector, as ``gc.set_threshold(threshold0, threshold1, threshold2)``.

    Python's defaults (700, 10, 10) run a young collection every ~700 net new container objects
    and a full one every 100 young ones (when a quarter of the heap is new). Every request in
    flight or waiting is a few dozen containers, so under load the defaults walk the whole heap
    (every waiting request) several times a second: 59 µs of collector per request, and one
    200+ ms stall per full collection with 100,000 waiters (docs/benchmarks.md, "Garbage
    collection"). Reference counting still frees everything that is not a cycle at once. With tens
    of thousands of requests waiting, a young collection walks many times ``threshold0`` objects
    (frees of old objects count against new ones): a lower ``threshold0`` gives shorter, more
    frequent stalls (docs/observability.md, "The gateway's own pauses").
    """

    threshold0: int = 10_000
    threshold1: int = 10
    threshold2: int = 100


@dataclass(frozen=True, slots=True)
class LoggingConfig:
    # Adopt a client's x-request-id as the request's id (only when every client is trusted to send
    # unique ids); otherwise the gateway makes its own and logs the client's as client_request_id.
    trust_request_id: bool = False


@dataclass(frozen=True, slots=True)
class MetricsConfig:
    top_tenants: int = 20


@dataclass(frozen=True, slots=True)
class HealthConfig:
    interval_s: float = 5.0  # active probe period for healthy backends
    unhealthy_interval_s: float = 1.0  # probe period for backends marked down
    failure_threshold: int = 3  # consecutive connect failures that open the breaker
    cooldown_s: float = 5.0  # minimum time a backend stays down once marked
    probe_timeout_s: float = 2.0


@dataclass(frozen=True, slots=True)
class UpstreamConfig:
    max_connections: int = 1024
    # Below uvicorn's (and so vLLM's) 5 s keep-alive so we never reuse a socket the backend is
    # about to close.
    keepalive_s: float = 4.0


@dataclass(frozen=True, slots=True)
class EmbeddedBackendConfig:
    """The simulated backends ``tokengate serve`` starts when no pools are configured (gateway.process.embedded)."""

    host: str = "127.0.0.1"
    port: int = 8001  # 0 = a free port; with split, pool long is on the next port
    # Two backends, pools short and long, with class rules between them (unless `classes` is set);
    # false: one backend, pool default.
    split: bool = True
    long_prompt_tokens: int = 8000  # with split: prompts from this many tokens are class long
    capacity_tokens: int | None = None  # None = derived from the backend's KV cache size
    # Passed to backends.reference.server.BackendSettings (validated against its fields).
    settings: Mapping[str, Any] = field(default_factory=dict)

    @property
    def pool_names(self) -> tuple[str, ...]:
        """The pools the embedded backends serve, one backend each, in port order."""
        return ("short", "long") if self.split else ("default",)


@dataclass(frozen=True, slots=True)
class GatewayConfig:
    listen: ListenConfig = ListenConfig()
    workers: int = 1
    store: StoreConfig = StoreConfig()
    tiers: tuple[TierConfig, ...] = DEFAULT_TIERS
    fairness: FairnessConfig = FairnessConfig()
    leases: LeasesConfig = LeasesConfig()
    usage_log: UsageLogConfig = UsageLogConfig()
    extproc: ExtprocConfig = ExtprocConfig()
    classes: tuple[ClassRule, ...] = ()  # first match wins (gateway.config.class_rules)
    pools: tuple[PoolConfig, ...] = ()
    models: tuple[ModelConfig, ...] = ()
    pricing: PricingConfig = PricingConfig()
    tenants: tuple[TenantConfig, ...] = ()
    limits: LimitsConfig = LimitsConfig()
    # /v1 routes forwarded besides the priced ones (gateway.request.passthrough); anything else is a 404.
    passthrough: tuple[PassthroughRoute, ...] = DEFAULT_ROUTES
    admin: AdminConfig = AdminConfig()
    # Output tokens each request reserves (gateway.request.reservations): the default, and overrides of
    # its settings per pool and per class.
    reservation: ReservationConfig = field(default_factory=ReservationConfig)
    reservation_by_pool: Mapping[str, ReservationSettings] = field(default_factory=dict)
    reservation_by_class: Mapping[str, ReservationSettings] = field(default_factory=dict)
    ops: OpsConfig = OpsConfig()
    logging: LoggingConfig = LoggingConfig()
    metrics: MetricsConfig = MetricsConfig()
    health: HealthConfig = HealthConfig()
    upstream: UpstreamConfig = UpstreamConfig()
    embedded_backend: EmbeddedBackendConfig = EmbeddedBackendConfig()
    drain_timeout_s: float = 30.0
    gc: GcConfig = GcConfig()
    # Inject max_tokens = the reserved per-choice decode when the client set neither max_tokens
    # nor max_completion_tokens, so the backend cannot run past what was reserved.
    enforce_max_tokens: bool = True
    # Request-class observability (windows, HOL, shape, backend scraping, per-class SLOs).
    observability: ObserveSettings = field(default_factory=ObserveSettings)
    # OpenTelemetry traces (gateway.observe.tracing): off by default.
    tracing: TracingSettings = field(default_factory=TracingSettings)

    @property
    def open_mode(self) -> bool:
        """No tenants configured: one open tenant accepts any key or none."""
        return not self.tenants

    def tier(self, name: str) -> TierConfig | None:
        for t in self.tiers:
            if t.name == name:
                return t
        return None

    def pool(self, name: str) -> PoolConfig | None:
        for p in self.pools:
            if p.name == name:
                return p
        return None

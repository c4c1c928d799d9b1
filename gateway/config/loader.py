"""Load and validate the YAML configuration into :class:`gateway.config.schema.GatewayConfig`.

Every error names the field by its path (``tenants.acme.budget_tokens``,
``pools.short.backends[0].url``) and says what was expected and what was found; unknown keys
are errors too, with a did-you-mean when a known key is close. Validation is complete at load
time so a bad file fails before anything starts listening.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import re
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, cast

import yaml

from backends.reference.settings import BackendSettings
from budgets.types import QUEUE_ORDERS, QueueOrder
from classifiers import PricingSettings, load_tokenizer
from classifiers.images import ImageRule
from classifiers.media_urls import MediaUrls
from classifiers.reservation import ReservationSettings
from gateway.config import stores
from gateway.config.class_rules import parse_classes
from gateway.config.fields import (
    ConfigError,
    boolean,
    check_keys,
    choice,
    did_you_mean,
    integer,
    join,
    mapping,
    number,
    opt_integer,
    opt_string,
    positive_number,
    section,
    show,
    string,
    string_list,
    valid_name,
)
from gateway.config.quotas import model_price, tenant_quotas
from gateway.config.schema import (
    DEFAULT_CONTEXT_LENGTH,
    DEFAULT_TIERS,
    EXTPROC_HEADROOM,
    TENANT_KEYS,
    AdminConfig,
    BackendConfig,
    EmbeddedBackendConfig,
    ExtprocConfig,
    FairnessConfig,
    GatewayConfig,
    GcConfig,
    HealthConfig,
    LeasesConfig,
    LimitsConfig,
    ListenConfig,
    LoggingConfig,
    MetricsConfig,
    ModelConfig,
    OpsConfig,
    PoolConfig,
    PricingConfig,
    TenantConfig,
    TierConfig,
    TimeoutsConfig,
    UpstreamConfig,
    UsageLogConfig,
)
from gateway.observe.settings import ObserveConfigError, ObserveSettings
from gateway.observe.tracing import PROTOCOLS, Protocol, TracingSettings, otel_available
from gateway.request.passthrough import DEFAULT_ROUTES, PassthroughRoute
from gateway.request.paths import path_problem
from gateway.request.reservations import ReservationConfig
from gateway.request.server_tools import entry_problem
from gateway.upstream.client import header_pattern_problem
from gateway.upstream.pools import DEFAULT_PROBE, HealthProbe

_SHA256_RE = re.compile(r"^sha256:[0-9a-f]{64}$")


def load_config(path: str | Path | None) -> GatewayConfig:
    """Read ``path`` (YAML); ``None`` means the embedded defaults."""
    return parse_config(load_raw(path) if path is not None else {})


def load_raw(path: str | Path) -> dict[str, Any]:
    """The file's YAML as a mapping (not yet validated); errors name the file."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"{p}: cannot read: {exc.strerror or exc}") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{p}: not UTF-8 text (byte {exc.start}): is it the YAML config file?") from None
    try:
        data = yaml.safe_load(text)
    except yaml.MarkedYAMLError as exc:
        raise ConfigError(f"{p}: not valid YAML: {_yaml_problem(exc)}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{p}: not valid YAML: {exc}") from None
    except ValueError as exc:  # a scalar YAML resolves but cannot build, e.g. the date 2026-13-45
        raise ConfigError(f"{p}: not valid YAML: {exc}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{p}: expected a mapping of sections at the top, got {show(data)}")
    expanded: dict[str, Any] = expand_env(data, "", os.environ)
    return expanded


_ENV_REF = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}")


def expand_env(value: Any, where: str, environ: Mapping[str, str]) -> Any:
    """``${NAME}`` and ``${NAME:-default}`` in the file's strings, from the environment.

    A value that is exactly one reference takes the variable's YAML meaning (``port: ${PORT}`` is a
    number); inside a longer string it is text. An unset variable without a default is an error that
    names the field and the variable. ``$${`` writes a literal ``${``.
    """
    if isinstance(value, dict):
        return {k: expand_env(v, join(where, str(k)), environ) for k, v in value.items()}
    if isinstance(value, list):
        return [expand_env(v, f"{where}[{i}]", environ) for i, v in enumerate(value)]
    if not isinstance(value, str) or "${" not in value:
        return value

    def lookup(m: re.Match[str]) -> str:
        name, default = m.group(1), m.group(2)
        got = environ.get(name, default)
        if got is None:
            raise ConfigError(f"{where}: the environment variable {name} is not set (used as ${{{name}}})")
        return got

    literal = value.replace("$${", "\x00")
    whole = _ENV_REF.fullmatch(literal)
    if whole is not None:
        text = lookup(whole)
        scalar = yaml.safe_load(text) if text else text
        # Numbers and booleans take their meaning; anything else (a URL, a key) stays the text.
        return scalar if isinstance(scalar, int | float | bool) else text
    return _ENV_REF.sub(lookup, literal).replace("\x00", "${")


def _yaml_problem(exc: yaml.MarkedYAMLError) -> str:
    """``line 3, column 9: expected ',' or '}', but got ':' (while parsing a flow mapping from line 1)``:
    the file's line and column (1-based), not PyYAML's ``in "<unicode string>"``."""
    mark = exc.problem_mark or exc.context_mark
    where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
    text = where + (exc.problem or "syntax error")
    if exc.context:
        ctx = exc.context_mark
        text += f" ({exc.context}" + (f" from line {ctx.line + 1}" if ctx is not None else "") + ")"
    return text


def parse_config(data: Any) -> GatewayConfig:
    root = mapping(data, "config", top=True)
    check_keys(root, _TOP_KEYS, "")
    tiers = _tiers(root.get("tiers"))
    tier_names = {t.name for t in tiers}
    pools = _pools(root.get("pools"))
    embedded = _embedded(root.get("embedded_backend"))
    store = stores.parse_store(root.get("store"))
    stores.check_domain_pools(store, [p.name for p in pools] or list(embedded.pool_names))
    cfg = GatewayConfig(
        listen=_listen(root.get("listen")),
        workers=integer(root, "workers", "", 1, minimum=1),
        store=store,
        tiers=tiers,
        fairness=_fairness(root.get("fairness")),
        leases=_leases(root.get("leases")),
        usage_log=_usage_log(root.get("usage_log")),
        extproc=_extproc(root.get("extproc")),
        # Without pools, the embedded backends' pools are the ones a class may name.
        classes=parse_classes(root.get("classes"), {p.name for p in pools} or set(embedded.pool_names)),
        pools=pools,
        models=_models(root.get("models")),
        pricing=_pricing(root.get("pricing")),
        tenants=_tenants(root.get("tenants"), tiers, tier_names),
        limits=_limits(root.get("limits")),
        passthrough=_passthrough(root.get("passthrough")),
        **_reservations(root),
        admin=_admin(root.get("admin")),
        ops=_ops(root.get("ops")),
        logging=_logging(root.get("logging")),
        metrics=_metrics_section(root.get("metrics")),
        health=_health(root.get("health")),
        upstream=_upstream(root.get("upstream")),
        embedded_backend=embedded,
        drain_timeout_s=number(root, "drain_timeout_s", "", 30.0, minimum=0.0),
        gc=_gc(root.get("gc")),
        enforce_max_tokens=boolean(root, "enforce_max_tokens", "", True),
        observability=_observability(root.get("observability")),
        tracing=_tracing(root.get("tracing")),
    )
    _check_extproc_message(cfg)
    return cfg


def _check_extproc_message(cfg: GatewayConfig) -> None:
    """A body the gateway would refuse must reach it: past the gRPC limit, Envoy answers 500 itself."""
    given = cfg.extproc.max_message_bytes
    if given is not None and given - cfg.limits.max_body_bytes < EXTPROC_HEADROOM:
        raise ConfigError(
            f"extproc.max_message_bytes: {given} must exceed limits.max_body_bytes "
            f"({cfg.limits.max_body_bytes}) by at least {EXTPROC_HEADROOM} (the request's headers), or a "
            "body the gateway would refuse with a 413 fails in Envoy as a 500"
        )


def _observability(v: Any) -> ObserveSettings:
    try:
        return ObserveSettings.from_dict(v)
    except ObserveConfigError as exc:
        raise ConfigError(str(exc)) from None


def check_workers(config: GatewayConfig, workers: int) -> None:
    """Several processes with a process-local store would multiply every budget; and they cannot
    share one ops listener (each would answer /metrics for itself only)."""
    if workers > 1 and not stores.is_shared(config.store.kind):
        raise ConfigError(
            f"--workers {workers} with store.kind={config.store.kind} would give every tenant "
            f"{workers}x its budget; use store.kind=redis"
        )
    if workers > 1 and config.ops.port is not None:
        raise ConfigError(
            f"--workers {workers} cannot share the ops listener on port {config.ops.port}: set ops.port: null "
            "(operator routes on the API port, a read or admin token required) or run one process per replica"
        )


def hash_key(key: str) -> str:
    """The form to store a key in the config file instead of the key itself."""
    return "sha256:" + hashlib.sha256(key.encode("utf-8")).hexdigest()


# ---- sections ----

_TOP_KEYS = (
    "listen",
    "workers",
    "store",
    "tiers",
    "fairness",
    "leases",
    "usage_log",
    "extproc",
    "classes",
    "pools",
    "models",
    "pricing",
    "tenants",
    "limits",
    "passthrough",
    "reservation",
    "admin",
    "ops",
    "logging",
    "metrics",
    "health",
    "upstream",
    "embedded_backend",
    "drain_timeout_s",
    "gc",
    "enforce_max_tokens",
    "observability",
    "tracing",
)


def _listen(v: Any) -> ListenConfig:
    m = section(v, "listen", ("host", "port"))
    return ListenConfig(
        host=string(m, "host", "listen", "127.0.0.1"),
        port=integer(m, "port", "listen", 8080, minimum=0, maximum=65535),
    )


def _tiers(v: Any) -> tuple[TierConfig, ...]:
    if v is None:
        return DEFAULT_TIERS
    m = mapping(v, "tiers")
    if not m:
        raise ConfigError("tiers: expected at least one tier")
    out = []
    ranks: dict[int, str] = {}
    for name, body in m.items():
        where = f"tiers.{valid_name(name, 'tiers')}"
        t = section(body, where, ("rank", "ceiling", "max_queue_wait_s", "ceiling_enforce"))
        rank = integer(t, "rank", where, None, minimum=0)
        if rank in ranks:
            raise ConfigError(f"{where}.rank: {rank} is already the rank of tier {ranks[rank]!r}")
        ranks[rank] = name
        ceiling = number(t, "ceiling", where, 1.0, minimum=0.0)
        if not 0.0 < ceiling <= 1.0:
            raise ConfigError(f"{where}.ceiling: expected a number in (0, 1], got {show(ceiling)}")
        wait = number(t, "max_queue_wait_s", where, 60.0, minimum=0.0)
        enforce = boolean(t, "ceiling_enforce", where, True)
        out.append(
            TierConfig(name=name, rank=rank, ceiling=ceiling, max_queue_wait_s=wait, ceiling_enforce=enforce)
        )
    out.sort(key=lambda t: t.rank)
    return tuple(out)


def _fairness(v: Any) -> FairnessConfig:
    m = section(
        v,
        "fairness",
        (
            "prefill_weight",
            "decode_weight",
            "backfill_limit_s",
            "tenant_queue_order",
            "max_defer_s",
            "defer_s_per_token",
        ),
    )
    base = FairnessConfig()
    return FairnessConfig(
        prefill_weight=number(m, "prefill_weight", "fairness", base.prefill_weight, minimum=0.0),
        decode_weight=number(m, "decode_weight", "fairness", base.decode_weight, minimum=0.0),
        backfill_limit_s=number(m, "backfill_limit_s", "fairness", base.backfill_limit_s, minimum=0.0),
        tenant_queue_order=cast(
            QueueOrder, choice(m, "tenant_queue_order", "fairness", base.tenant_queue_order, QUEUE_ORDERS)
        ),
        max_defer_s=number(m, "max_defer_s", "fairness", base.max_defer_s, minimum=0.0),
        defer_s_per_token=number(m, "defer_s_per_token", "fairness", base.defer_s_per_token, minimum=0.0),
    )


def _extproc(v: Any) -> ExtprocConfig:
    fields = (
        "enabled",
        "host",
        "port",
        "max_message_timeout_s",
        "extend_after_s",
        "max_message_bytes",
        "pool_header",
        "fairness_header",
        "objective_header",
    )
    m = section(v, "extproc", fields)
    d = ExtprocConfig()
    headers = {}
    for name in ("pool_header", "fairness_header", "objective_header"):
        value = string(m, name, "extproc", getattr(d, name)).strip().lower()
        if header_pattern_problem(value) is not None or value.endswith("*"):
            raise ConfigError(f"extproc.{name}: {show(value)} is not a header name (letters, digits, '-')")
        headers[name] = value
    longest = number(m, "max_message_timeout_s", "extproc", d.max_message_timeout_s, minimum=0.001)
    extend = number(m, "extend_after_s", "extproc", d.extend_after_s, minimum=0.0)
    if extend >= longest:
        raise ConfigError(
            f"extproc.extend_after_s: {extend:g} must be below extproc.max_message_timeout_s ({longest:g})"
        )
    return ExtprocConfig(
        enabled=boolean(m, "enabled", "extproc", d.enabled),
        host=string(m, "host", "extproc", d.host),
        port=integer(m, "port", "extproc", d.port, minimum=0, maximum=65535),
        max_message_timeout_s=longest,
        extend_after_s=extend,
        max_message_bytes=(
            integer(m, "max_message_bytes", "extproc", 0, minimum=1 << 20)
            if m.get("max_message_bytes") is not None
            else None
        ),
        **headers,
    )


def _usage_log(v: Any) -> UsageLogConfig:
    m = section(v, "usage_log", ("enabled", "keep_days", "flush_s"))
    flush = number(m, "flush_s", "usage_log", 1.0, minimum=0.0)
    if not 0.0 < flush <= 60.0:
        raise ConfigError(f"usage_log.flush_s: expected a number of seconds in (0, 60], got {show(flush)}")
    return UsageLogConfig(
        enabled=boolean(m, "enabled", "usage_log", True),
        keep_days=integer(m, "keep_days", "usage_log", 35, minimum=1),
        flush_s=flush,
    )


def _leases(v: Any) -> LeasesConfig:
    m = section(v, "leases", ("ttl_s",))
    ttl = number(m, "ttl_s", "leases", 10.0, minimum=0.0)
    if ttl <= 0:
        raise ConfigError(f"leases.ttl_s: expected a positive number, got {show(ttl)}")
    return LeasesConfig(ttl_s=ttl)


def _pools(v: Any) -> tuple[PoolConfig, ...]:
    if v is None:
        return ()
    m = mapping(v, "pools")
    out = []
    seen_urls: dict[str, str] = {}
    for name, body in m.items():
        where = f"pools.{valid_name(name, 'pools')}"
        p = section(
            body,
            where,
            (
                "backends",
                "budget_tokens",
                "reservation",
                "prefill_gate_tokens",
                "prefill_gate_hold_s",
                "prefill_gate_reserve_tokens",
            ),
        )
        raw = p.get("backends")
        if not isinstance(raw, list) or not raw:
            raise ConfigError(f"{where}.backends: expected a non-empty list of backends, got {show(raw)}")
        backends = []
        for i, b in enumerate(raw):
            be = _backend(b, f"{where}.backends[{i}]")
            if be.url in seen_urls:
                raise ConfigError(
                    f"{where}.backends[{i}].url: {be.url} is already a backend of {seen_urls[be.url]}"
                )
            seen_urls[be.url] = where
            backends.append(be)
        gate = opt_integer(p, "prefill_gate_tokens", where, minimum=1)
        reserve = opt_integer(p, "prefill_gate_reserve_tokens", where, minimum=0)
        if reserve is not None and gate is None:
            raise ConfigError(
                f"{where}.prefill_gate_reserve_tokens: a reserve of the prefill gate, which is off;"
                " set prefill_gate_tokens too, or remove it"
            )
        if reserve is not None and gate is not None and reserve >= gate:
            raise ConfigError(
                f"{where}.prefill_gate_reserve_tokens: expected less than prefill_gate_tokens ({gate}),"
                f" got {reserve}: long prompts share what the reserve leaves of it"
            )
        out.append(
            PoolConfig(
                name=name,
                backends=tuple(backends),
                budget_tokens=opt_integer(p, "budget_tokens", where, minimum=1),
                prefill_gate_tokens=gate,
                prefill_gate_hold_s=number(p, "prefill_gate_hold_s", where, 1.0, minimum=0.0),
                prefill_gate_reserve_tokens=reserve,
            )
        )
    return tuple(out)


def _backend(v: Any, where: str) -> BackendConfig:
    m = section(
        v,
        where,
        (
            "url",
            "capacity_tokens",
            "models",
            "api_key",
            "accepts_priority",
            "max_num_seqs",
            "block_size",
            "cache_salt",
            "tenant_header",
            "request_id_header",
            "probe",
            "timeouts",
            "name",
            "draining",
        ),
    )
    url = string(m, "url", where, None)
    if not re.match(r"^https?://[^/\s]+", url):
        raise ConfigError(f"{where}.url: expected an http(s) URL like http://127.0.0.1:8001, got {show(url)}")
    url = url.rstrip("/")
    if url.endswith("/v1"):
        url = url[: -len("/v1")]
    tw = f"{where}.timeouts"
    t = section(m.get("timeouts"), tw, ("connect_s", "read_s"))
    timeouts = TimeoutsConfig(
        connect_s=positive_number(t, "connect_s", tw, 2.0), read_s=positive_number(t, "read_s", tw, 600.0)
    )
    return BackendConfig(
        url=url,
        capacity_tokens=integer(m, "capacity_tokens", where, None, minimum=1),
        models=string_list(m, "models", where),
        api_key=opt_string(m, "api_key", where),
        accepts_priority=boolean(m, "accepts_priority", where, False),
        max_num_seqs=opt_integer(m, "max_num_seqs", where, minimum=1),
        block_size=integer(m, "block_size", where, 1, minimum=1),
        cache_salt=choice(m, "cache_salt", where, "client", ("client", "tenant")),
        tenant_header=_tenant_header(m, where),
        request_id_header=_request_id_header(m, where),
        probe=_probe(m.get("probe"), f"{where}.probe"),
        timeouts=timeouts,
        name=string(m, "name", where, url),
        draining=boolean(m, "draining", where, False),
    )


def _tenant_header(m: Mapping[str, Any], where: str) -> str | None:
    name = opt_string(m, "tenant_header", where)
    if name is None:
        return None
    if name.endswith("*") or header_pattern_problem(name) is not None:
        raise ConfigError(f"{where}.tenant_header: {show(name)} is not a header name")
    if name.lower() in ("authorization", "host", "content-length", "content-type", "x-request-id"):
        raise ConfigError(f"{where}.tenant_header: {name} is a header the gateway sets itself; pick another")
    return name.lower()


def _request_id_header(m: Mapping[str, Any], where: str) -> str | None:
    """The header the request id goes upstream under: a name, ``none`` / ``false`` for none."""
    v = m.get("request_id_header", "x-request-id")
    if v is False or (isinstance(v, str) and v.strip().lower() in ("none", "off")):
        return None
    if not isinstance(v, str) or v.endswith("*") or header_pattern_problem(v) is not None:
        raise ConfigError(
            f"{where}.request_id_header: expected a header name (default x-request-id) or none, got {show(v)}"
        )
    if v.lower() in ("authorization", "host", "content-length", "content-type"):
        raise ConfigError(f"{where}.request_id_header: {v} is a header the gateway sets itself; pick another")
    return v.lower()


_PROBE_PATH_RE = re.compile(r"^/[!-~]*$")  # printable ASCII, no spaces
_PROBE_FORMS = "expected off, a path starting with '/', or {path, method}"


def _probe(v: Any, where: str) -> HealthProbe | None:
    """A backend's health probe: omitted (or null) the default, ``off`` / ``false`` none, a path
    (GET), or ``{path, method}``."""
    if v is None:
        return DEFAULT_PROBE
    if v is False or (isinstance(v, str) and v.strip().lower() == "off"):
        return None
    if isinstance(v, str):
        if not _PROBE_PATH_RE.match(v):
            raise ConfigError(f"{where}: {_PROBE_FORMS}, got {show(v)}")
        return HealthProbe(v, "GET")
    if not isinstance(v, Mapping):
        raise ConfigError(f"{where}: {_PROBE_FORMS}, got {show(v)}")
    m = section(v, where, ("path", "method"))
    path = string(m, "path", where, None)
    if not _PROBE_PATH_RE.match(path):
        raise ConfigError(f"{where}.path: expected a path starting with '/' (no spaces), got {show(path)}")
    method = m.get("method", "GET")
    if not isinstance(method, str) or method.upper() not in ("GET", "HEAD"):
        raise ConfigError(f"{where}.method: expected GET or HEAD, got {show(method)}")
    return HealthProbe(path, method.upper())


def _models(v: Any) -> tuple[ModelConfig, ...]:
    if v is None:
        return ()
    m = mapping(v, "models")
    out = []
    for pattern, body in m.items():
        where = f"models.{pattern}"
        b = section(
            body,
            where,
            (
                "tokenizer",
                "context_length",
                "images",
                "vocab_size",
                "prompt_overhead_tokens",
                "learn_prompt_overhead",
                "price",
            ),
        )
        tokenizer = opt_string(b, "tokenizer", where)
        if tokenizer is not None:
            _check_tokenizer(tokenizer, f"{where}.tokenizer")
        context_length = integer(b, "context_length", where, DEFAULT_CONTEXT_LENGTH, minimum=1)
        overhead = opt_integer(b, "prompt_overhead_tokens", where, minimum=0)
        if overhead is not None and overhead >= context_length:
            raise ConfigError(
                f"{where}.prompt_overhead_tokens: {overhead} is not below the model's context_length "
                f"({context_length}); it is the tokens the chat template adds to every prompt"
            )
        out.append(
            ModelConfig(
                pattern=str(pattern),
                tokenizer=tokenizer,
                context_length=context_length,
                images=_image_rule(b.get("images"), f"{where}.images"),
                vocab_size=opt_integer(b, "vocab_size", where, minimum=1),
                prompt_overhead_tokens=overhead,
                learn_prompt_overhead=boolean(b, "learn_prompt_overhead", where, True),
                price=model_price(b.get("price"), f"{where}.price"),
            )
        )
    return tuple(out)


_IMAGE_KEYS = ("tokens", "patch_pixels", "min_pixels", "max_pixels", "extra_tokens")


def _image_rule(v: Any, where: str) -> ImageRule | None:
    """``{tokens: N}`` (every image the same) or the dynamic-resolution fields (classifiers.images)."""
    if v is None:
        return None
    b = section(v, where, _IMAGE_KEYS)
    base = ImageRule()
    tokens = opt_integer(b, "tokens", where, minimum=0)
    if tokens is not None:
        extra = [k for k in _IMAGE_KEYS[1:] if k in b]
        if extra:
            raise ConfigError(
                f"{where}: 'tokens' prices every image the same; drop {', '.join(extra)} (those describe "
                "a dynamic-resolution model instead)"
            )
        return ImageRule(tokens=tokens)
    patch = integer(b, "patch_pixels", where, base.patch_pixels, minimum=1)
    least = integer(b, "min_pixels", where, base.min_pixels, minimum=1)
    most = integer(b, "max_pixels", where, base.max_pixels, minimum=1)
    if most < max(least, patch * patch):
        raise ConfigError(
            f"{where}.max_pixels: {most} is less than min_pixels ({least}) or one patch "
            f"({patch} x {patch} = {patch * patch}); raise it"
        )
    return ImageRule(
        patch_pixels=patch,
        min_pixels=least,
        max_pixels=most,
        extra_tokens=integer(b, "extra_tokens", where, base.extra_tokens, minimum=0),
    )


def _check_tokenizer(spec: str, where: str) -> None:
    """Load it now (cached by the classifiers package) so a bad spec fails at load time."""
    try:
        load_tokenizer(spec)
    except (ValueError, OSError) as exc:
        raise ConfigError(f"{where}: {exc}") from None


def _pricing(v: Any) -> PricingConfig:
    own = [f.name for f in dataclasses.fields(PricingSettings)]
    m = section(v, "pricing", ("default_max_tokens", *own))
    d = PricingSettings()
    values: dict[str, Any] = {}
    for k in own:  # each knob read by its default's type: a switch or a count
        default = getattr(d, k)
        if k == "media_urls":
            values[k] = _media_urls(m.get(k))
        elif isinstance(default, bool):
            values[k] = boolean(m, k, "pricing", default)
        else:
            values[k] = integer(m, k, "pricing", default, minimum=0)
    settings = PricingSettings(**values)
    return PricingConfig(
        default_max_tokens=integer(m, "default_max_tokens", "pricing", 1024, minimum=1), settings=settings
    )


def _tenants(v: Any, tiers: Sequence[TierConfig], tier_names: set[str]) -> tuple[TenantConfig, ...]:
    if v is None:
        return ()
    m = mapping(v, "tenants")
    # A tenant without a tier gets "standard" if there is one, else the lowest-priority tier.
    default_tier = "standard" if "standard" in tier_names else max(tiers, key=lambda t: t.rank).name
    out = []
    owner: dict[str, str] = {}
    for name, body in m.items():
        where = f"tenants.{valid_name(name, 'tenants')}"
        t = section(body, where, TENANT_KEYS)
        keys = string_list(t, "keys", where)
        for i, key in enumerate(keys):
            if key.startswith("sha256:") and not _SHA256_RE.match(key):
                raise ConfigError(
                    f"{where}.keys[{i}]: expected sha256: followed by 64 lowercase hex digits, got {len(key) - 7} chars"
                )
            canonical = key if key.startswith("sha256:") else hash_key(key)
            if canonical in owner:
                raise ConfigError(
                    f"{where}.keys[{i}]: the same key is already a key of tenant {owner[canonical]!r}"
                )
            owner[canonical] = name
        tier = string(t, "tier", where, default_tier)
        if tier not in tier_names:
            raise ConfigError(
                f"{where}.tier: unknown tier {tier!r}{did_you_mean(tier, tier_names)}; "
                f"configured tiers: {', '.join(t.name for t in tiers)}"
            )
        weight = positive_number(t, "weight", where, 1.0)
        default_max = opt_integer(t, "default_max_tokens", where, minimum=1)
        max_max = opt_integer(t, "max_max_tokens", where, minimum=1)
        if default_max is not None and max_max is not None and default_max > max_max:
            raise ConfigError(
                f"{where}.default_max_tokens: {default_max} is larger than max_max_tokens ({max_max})"
            )
        out.append(
            TenantConfig(
                name=name,
                keys=keys,
                budget_tokens=opt_integer(t, "budget_tokens", where, minimum=1),
                budget_enforce=boolean(t, "budget_enforce", where, True),
                weight=weight,
                tier=tier,
                default_max_tokens=default_max,
                max_max_tokens=max_max,
                max_queue_len=integer(t, "max_queue_len", where, 64, minimum=0),
                models=string_list(t, "models", where),
                server_tools=_server_tools(t, where),
                quotas=tenant_quotas(t.get("quotas"), f"{where}.quotas", name),
            )
        )
    return tuple(out)


def _server_tools(t: Mapping[str, Any], where: str) -> tuple[str, ...] | None:
    if t.get("server_tools") is None:
        return None
    if t["server_tools"] == []:
        return ()
    return _each_checked(string_list(t, "server_tools", where), f"{where}.server_tools", entry_problem)


def _each_checked(
    items: tuple[str, ...], where: str, problem: Callable[[str], str | None]
) -> tuple[str, ...]:
    """``items``, once ``problem`` finds nothing wrong with any; else the error naming the first."""
    for i, item in enumerate(items):
        why = problem(item)
        if why is not None:
            raise ConfigError(f"{where}[{i}]: {show(item)} {why}")
    return items


def _limits(v: Any) -> LimitsConfig:
    if v is not None and isinstance(v, Mapping) and "passthrough_cost_tokens" in v:
        raise ConfigError(
            "limits.passthrough_cost_tokens: removed: pass-through routes are now an allowlist "
            "(passthrough.routes) and an allowed POST is priced from its body; delete this key"
        )
    keys = (
        "max_body_bytes",
        "max_header_bytes",
        "header_timeout_s",
        "body_timeout_s",
        "body_idle_timeout_s",
        "max_connections",
        "max_connections_per_tenant",
        "max_held_body_bytes",
        "max_held_body_bytes_per_tenant",
        "refused_fields",
        "private_headers",
    )
    m = section(v, "limits", keys)
    d = LimitsConfig()
    return LimitsConfig(
        max_body_bytes=integer(m, "max_body_bytes", "limits", d.max_body_bytes, minimum=1),
        max_header_bytes=integer(m, "max_header_bytes", "limits", d.max_header_bytes, minimum=1024),
        header_timeout_s=positive_number(m, "header_timeout_s", "limits", d.header_timeout_s),
        body_timeout_s=positive_number(m, "body_timeout_s", "limits", d.body_timeout_s),
        body_idle_timeout_s=positive_number(m, "body_idle_timeout_s", "limits", d.body_idle_timeout_s),
        max_connections=integer(m, "max_connections", "limits", d.max_connections, minimum=1),
        max_connections_per_tenant=integer(
            m, "max_connections_per_tenant", "limits", d.max_connections_per_tenant, minimum=0
        ),
        max_held_body_bytes=integer(m, "max_held_body_bytes", "limits", d.max_held_body_bytes, minimum=0),
        max_held_body_bytes_per_tenant=integer(
            m, "max_held_body_bytes_per_tenant", "limits", d.max_held_body_bytes_per_tenant, minimum=0
        ),
        refused_fields=d.refused_fields
        if m.get("refused_fields") is None
        else string_list(m, "refused_fields", "limits"),
        private_headers=_private_headers(m, d.private_headers),
    )


def _private_headers(m: Mapping[str, Any], default: tuple[str, ...]) -> tuple[str, ...]:
    if m.get("private_headers") is None:
        return default
    return _each_checked(
        string_list(m, "private_headers", "limits"), "limits.private_headers", header_pattern_problem
    )


def _media_urls(v: Any) -> MediaUrls:
    where = "pricing.media_urls"
    m = section(
        v,
        where,
        (
            "schemes",
            "hosts",
            "private_hosts",
            "fetch",
            "fetch_max_bytes",
            "fetch_timeout_s",
            "fetch_per_tenant",
        ),
    )
    d = MediaUrls()
    schemes = d.schemes if m.get("schemes") is None else string_list(m, "schemes", where)
    hosts = string_list(m, "hosts", where)
    private = boolean(m, "private_hosts", where, d.private_hosts)
    for i, scheme in enumerate(schemes):
        try:
            MediaUrls(schemes=(scheme,))
        except ValueError as exc:
            raise ConfigError(f"{where}.schemes[{i}]: {exc}; write it as data, http or https") from None
    for i, host in enumerate(hosts):
        try:
            MediaUrls(hosts=(host,))
        except ValueError as exc:
            raise ConfigError(f"{where}.hosts[{i}]: {exc}, e.g. images.example.com") from None
    if hosts and private:
        raise ConfigError(
            f"{where}: set hosts or private_hosts, not both (with hosts listed, only they are fetched)"
        )
    return MediaUrls(
        schemes=schemes,
        hosts=hosts,
        private_hosts=private,
        fetch=boolean(m, "fetch", where, d.fetch),
        fetch_max_bytes=integer(m, "fetch_max_bytes", where, d.fetch_max_bytes, minimum=1),
        fetch_timeout_s=positive_number(m, "fetch_timeout_s", where, d.fetch_timeout_s),
        fetch_per_tenant=integer(m, "fetch_per_tenant", where, d.fetch_per_tenant, minimum=1),
    )


_PRICED_ROUTES = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/responses", "/v1/models")
_METHODS = ("GET", "POST", "PUT", "PATCH", "DELETE", "*")


def _passthrough(v: Any) -> tuple[PassthroughRoute, ...]:
    m = section(v, "passthrough", ("routes",))
    if m.get("routes") is None:
        return DEFAULT_ROUTES
    routes = m["routes"]
    if not isinstance(routes, list):
        raise ConfigError(
            f"passthrough.routes: expected a list of {{method, path}} mappings, got {show(routes)}"
        )
    out = []
    for i, item in enumerate(routes):
        where = f"passthrough.routes[{i}]"
        r = section(item, where, ("method", "path", "generates"))
        method = string(r, "method", where, None).upper()
        if method not in _METHODS:
            raise ConfigError(
                f"{where}.method: expected one of {', '.join(_METHODS)}, got {show(r['method'])}"
            )
        path = string(r, "path", where, None)
        if not path.startswith("/v1/"):
            raise ConfigError(
                f"{where}.path: must start with /v1/ (only /v1 routes are forwarded), got {show(path)}"
            )
        if path in _PRICED_ROUTES:
            raise ConfigError(f"{where}.path: {path} is a priced route the gateway serves itself; remove it")
        if path.startswith("/v1/models/"):
            raise ConfigError(
                f"{where}.path: the gateway answers GET /v1/models/{{id}} itself (each tenant sees "
                f"only the models it may use); remove {path}"
            )
        if path_problem(path.replace("*", "x").replace("?", "x").encode()) is not None:
            raise ConfigError(
                f"{where}.path: {show(path)} is not a valid path (no dot segments, '//' or escapes)"
            )
        out.append(PassthroughRoute(method, path, boolean(r, "generates", where, method != "GET")))
    return tuple(out)


_RESERVATION_KEYS = (
    "mode",
    "quantile",
    "fixed_tokens",
    "min_samples",
    "half_life_s",
    "prompt_buckets",
    "max_keys",
)


def _reservation_settings(v: Any, where: str, base: ReservationSettings) -> ReservationSettings:
    m = section(v, where, _RESERVATION_KEYS)
    buckets = base.prompt_buckets
    if m.get("prompt_buckets") is not None:
        raw = m["prompt_buckets"]
        if not isinstance(raw, list) or not all(type(b) is int and b > 0 for b in raw):
            raise ConfigError(
                f"{where}.prompt_buckets: expected a list of positive integers, got {show(raw)}"
            )
        buckets = tuple(sorted(raw))
    quantile = positive_number(m, "quantile", where, base.quantile, maximum=1.0)
    return ReservationSettings(
        mode=cast(Any, choice(m, "mode", where, base.mode, ("max_tokens", "learned", "fixed"))),
        quantile=quantile,
        fixed_tokens=integer(m, "fixed_tokens", where, base.fixed_tokens, minimum=1),
        min_samples=positive_number(m, "min_samples", where, base.min_samples),
        half_life_s=positive_number(m, "half_life_s", where, base.half_life_s),
        prompt_buckets=buckets,
        max_keys=integer(m, "max_keys", where, base.max_keys, minimum=1),
    )


def _reservations(root: Mapping[str, Any]) -> dict[str, Any]:
    """The ``reservation:`` section and its overrides under ``pools.<name>`` and ``classes[i]``."""
    where = "reservation"
    m = section(
        root.get("reservation"),
        where,
        (*_RESERVATION_KEYS, "grow", "grow_factor", "kv_high", "kv_low", "oracle_header"),
    )
    settings = _reservation_settings(
        {k: v for k, v in m.items() if k in _RESERVATION_KEYS}, where, ReservationSettings()
    )
    kv_high = positive_number(m, "kv_high", where, 0.90, maximum=1.0)
    kv_low = positive_number(m, "kv_low", where, 0.75, maximum=1.0)
    if kv_low > kv_high:
        raise ConfigError(f"reservation.kv_low: must be <= kv_high ({kv_high:g}), got {kv_low:g}")
    grow_factor = positive_number(m, "grow_factor", where, 2.0)
    if grow_factor <= 1.0:
        raise ConfigError(f"reservation.grow_factor: expected a number above 1, got {grow_factor:g}")
    default = ReservationConfig(
        settings=settings,
        grow=boolean(m, "grow", where, True),
        grow_factor=grow_factor,
        kv_high=kv_high,
        kv_low=kv_low,
        oracle_header=boolean(m, "oracle_header", where, False),
    )
    by_pool = {
        name: _reservation_settings(body["reservation"], f"pools.{name}.reservation", settings)
        for name, body in (root.get("pools") or {}).items()
        if isinstance(body, Mapping) and body.get("reservation") is not None
    }
    by_class = {
        str(rule.get("name")): _reservation_settings(
            rule["reservation"], f"classes[{i}].reservation", settings
        )
        for i, rule in enumerate(root.get("classes") or [])
        if isinstance(rule, Mapping) and rule.get("reservation") is not None
    }
    return {"reservation": default, "reservation_by_pool": by_pool, "reservation_by_class": by_class}


def _admin(v: Any) -> AdminConfig:
    m = section(v, "admin", ("tokens_file", "state_file"))
    return AdminConfig(
        tokens_file=opt_string(m, "tokens_file", "admin"), state_file=opt_string(m, "state_file", "admin")
    )


def _ops(v: Any) -> OpsConfig:
    m = section(v, "ops", ("host", "port", "metrics_auth"))
    port: int | None = OpsConfig().port
    if "port" in m:
        port = opt_integer(m, "port", "ops", minimum=0)
        if port is not None and port > 65535:
            raise ConfigError(f"ops.port: expected at most 65535, got {port}")
    return OpsConfig(
        host=string(m, "host", "ops", "127.0.0.1"),
        port=port,
        metrics_auth=boolean(m, "metrics_auth", "ops", False),
    )


def _logging(v: Any) -> LoggingConfig:
    m = section(v, "logging", ("trust_request_id",))
    return LoggingConfig(trust_request_id=boolean(m, "trust_request_id", "logging", False))


def _metrics_section(v: Any) -> MetricsConfig:
    m = section(v, "metrics", ("top_tenants",))
    return MetricsConfig(top_tenants=integer(m, "top_tenants", "metrics", 20, minimum=0))


def _tracing(v: Any) -> TracingSettings:
    w = "tracing"
    m = section(v, w, ("enabled", "protocol", "endpoint", "sample_ratio", "client_context", "service_name"))
    enabled = boolean(m, "enabled", w, False)
    protocol: Protocol | None = None
    if m.get("protocol") is not None:
        protocol = (
            "http/protobuf" if choice(m, "protocol", w, "grpc", PROTOCOLS) == "http/protobuf" else "grpc"
        )
    endpoint = opt_string(m, "endpoint", w)
    if endpoint is not None and not endpoint.startswith(("http://", "https://")):
        raise ConfigError(
            f"{w}.endpoint: expected an http:// or https:// URL of the OTLP receiver, got {show(endpoint)}"
        )
    ratio = None
    if m.get("sample_ratio") is not None:
        ratio = number(m, "sample_ratio", w, 1.0, minimum=0.0)
        if ratio > 1.0:
            raise ConfigError(
                f"{w}.sample_ratio: expected a share of traces between 0 and 1, got {show(ratio)}"
            )
    if enabled and not otel_available(TracingSettings(protocol=protocol).resolved_protocol(os.environ)):
        raise ConfigError(
            f"{w}.enabled: exporting traces over gRPC needs h2: pip install 'tokengate[otel]' "
            "(or set tracing.protocol: http/protobuf, which needs nothing more)"
        )
    return TracingSettings(
        enabled=enabled,
        protocol=protocol,
        endpoint=endpoint,
        sample_ratio=ratio,
        client_context="ignore"
        if choice(m, "client_context", w, "join", ("join", "ignore")) == "ignore"
        else "join",
        service_name=opt_string(m, "service_name", w),
    )


def _gc(v: Any) -> GcConfig:
    m = section(v, "gc", ("threshold0", "threshold1", "threshold2"))
    d = GcConfig()
    # threshold0 = 0 would switch the collector off: reference cycles would never be freed.
    return GcConfig(
        threshold0=integer(m, "threshold0", "gc", d.threshold0, minimum=1),
        threshold1=integer(m, "threshold1", "gc", d.threshold1, minimum=1),
        threshold2=integer(m, "threshold2", "gc", d.threshold2, minimum=1),
    )


def _health(v: Any) -> HealthConfig:
    keys = ("interval_s", "unhealthy_interval_s", "failure_threshold", "cooldown_s", "probe_timeout_s")
    m = section(v, "health", keys)
    return HealthConfig(
        interval_s=positive_number(m, "interval_s", "health", 5.0),
        unhealthy_interval_s=positive_number(m, "unhealthy_interval_s", "health", 1.0),
        failure_threshold=integer(m, "failure_threshold", "health", 3, minimum=1),
        cooldown_s=number(m, "cooldown_s", "health", 5.0, minimum=0.0),
        probe_timeout_s=positive_number(m, "probe_timeout_s", "health", 2.0),
    )


def _upstream(v: Any) -> UpstreamConfig:
    m = section(v, "upstream", ("max_connections", "keepalive_s"))
    return UpstreamConfig(
        max_connections=integer(m, "max_connections", "upstream", 1024, minimum=1),
        keepalive_s=positive_number(m, "keepalive_s", "upstream", 4.0),
    )


def _embedded(v: Any) -> EmbeddedBackendConfig:
    m = mapping(v, "embedded_backend") if v is not None else {}
    where = "embedded_backend"
    own = ("host", "port", "capacity_tokens", "split", "long_prompt_tokens")
    check_keys(m, (*own, *sorted(_backend_setting_fields())), where)
    settings = {k: val for k, val in m.items() if k not in own}
    return EmbeddedBackendConfig(
        host=string(m, "host", where, "127.0.0.1"),
        port=integer(m, "port", where, 8001, minimum=0, maximum=65535),
        split=boolean(m, "split", where, True),
        long_prompt_tokens=integer(m, "long_prompt_tokens", where, 8000, minimum=1),
        capacity_tokens=opt_integer(m, "capacity_tokens", where, minimum=1),
        settings=settings,
    )


def _backend_setting_fields() -> frozenset[str]:
    return frozenset(f.name for f in dataclasses.fields(BackendSettings)) - {"host", "port"}

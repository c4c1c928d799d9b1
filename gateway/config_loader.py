"""Load and validate the YAML configuration into :class:`gateway.config.GatewayConfig`.

Every error names the field by its path (``tenants.acme.budget_tokens``,
``pools.short.backends[0].url``) and says what was expected and what was found; unknown keys
are errors too, with a did-you-mean when a known key is close. Validation is complete at load
time so a bad file fails before anything starts listening.
"""

from __future__ import annotations

import dataclasses
import difflib
import hashlib
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

from gateway import stores
from gateway.config import (
    DEFAULT_CONTEXT_LENGTH,
    DEFAULT_TIERS,
    BackendConfig,
    EmbeddedBackendConfig,
    FairnessConfig,
    GatewayConfig,
    HealthConfig,
    LeasesConfig,
    LimitsConfig,
    ListenConfig,
    MetricsConfig,
    ModelConfig,
    PoolConfig,
    PricingConfig,
    StoreConfig,
    TenantConfig,
    TierConfig,
    TimeoutsConfig,
    UpstreamConfig,
)
from gateway.observe.settings import ObserveConfigError, ObserveSettings
from gateway.passthrough import DEFAULT_ROUTES, PassthroughRoute
from gateway.paths import path_problem


class ConfigError(ValueError):
    """A configuration problem; the message starts with the field's path."""


_SHA256_RE = re.compile(r"^sha256:[0-9a-f]{64}$")
_NAME_RE = re.compile(r"^[A-Za-z0-9_.\-]+$")

# Fields of classifiers.PricingSettings as the classifiers helper documented them; used only
# when the classifiers package cannot be imported (it is always there in a full install).
_FALLBACK_PRICING_FIELDS = frozenset(
    {"per_message_tokens", "per_name_tokens", "reply_priming_tokens", "image_tokens", "audio_tokens"}
)


def load_config(path: str | Path | None) -> GatewayConfig:
    """Read ``path`` (YAML); ``None`` means the embedded defaults."""
    if path is None:
        return parse_config({})
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"{p}: cannot read: {exc.strerror or exc}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"{p}: not valid YAML: {exc}") from None
    return parse_config({} if data is None else data)


def parse_config(data: Any) -> GatewayConfig:
    root = _mapping(data, "config", top=True)
    _check_keys(root, _TOP_KEYS, "")
    tiers = _tiers(root.get("tiers"))
    tier_names = {t.name for t in tiers}
    pools = _pools(root.get("pools"))
    store = _store(root.get("store"))
    cfg = GatewayConfig(
        listen=_listen(root.get("listen")),
        workers=_int(root, "workers", "", 1, minimum=1),
        store=store,
        tiers=tiers,
        fairness=_fairness(root.get("fairness")),
        leases=_leases(root.get("leases")),
        classes=_classes(root.get("classes"), {p.name for p in pools}),
        pools=pools,
        models=_models(root.get("models")),
        pricing=_pricing(root.get("pricing")),
        tenants=_tenants(root.get("tenants"), tiers, tier_names),
        limits=_limits(root.get("limits")),
        passthrough=_passthrough(root.get("passthrough")),
        metrics=_metrics_section(root.get("metrics")),
        health=_health(root.get("health")),
        upstream=_upstream(root.get("upstream")),
        embedded_backend=_embedded(root.get("embedded_backend")),
        drain_timeout_s=_float(root, "drain_timeout_s", "", 30.0, minimum=0.0),
        enforce_max_tokens=_bool(root, "enforce_max_tokens", "", True),
        observability=_observability(root.get("observability")),
    )
    return cfg


def _observability(v: Any) -> ObserveSettings:
    try:
        return ObserveSettings.from_dict(v)
    except ObserveConfigError as exc:
        raise ConfigError(str(exc)) from None


def check_workers(config: GatewayConfig, workers: int) -> None:
    """Several processes with a process-local store would multiply every budget."""
    if workers > 1 and not stores.is_shared(config.store.kind):
        raise ConfigError(
            f"--workers {workers} with store.kind={config.store.kind} would give every tenant "
            f"{workers}x its budget; use store.kind=redis"
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
    "classes",
    "pools",
    "models",
    "pricing",
    "tenants",
    "limits",
    "passthrough",
    "metrics",
    "health",
    "upstream",
    "embedded_backend",
    "drain_timeout_s",
    "enforce_max_tokens",
    "observability",
)


def _listen(v: Any) -> ListenConfig:
    m = _section(v, "listen", ("host", "port"))
    return ListenConfig(
        host=_str(m, "host", "listen", "127.0.0.1"),
        port=_int(m, "port", "listen", 8080, minimum=0, maximum=65535),
    )


def _store(v: Any) -> StoreConfig:
    m = _mapping(v, "store") if v is not None else {}
    kind = _str(m, "kind", "store", "memory")
    options = {k: val for k, val in m.items() if k != "kind"}
    try:
        stores.check_store_config(kind, options)
    except ValueError as exc:
        raise ConfigError(f"store.{exc}") from None
    return StoreConfig(kind=kind, options=options)


def _tiers(v: Any) -> tuple[TierConfig, ...]:
    if v is None:
        return DEFAULT_TIERS
    m = _mapping(v, "tiers")
    if not m:
        raise ConfigError("tiers: expected at least one tier")
    out = []
    ranks: dict[int, str] = {}
    for name, body in m.items():
        where = f"tiers.{_name(name, 'tiers')}"
        t = _section(body, where, ("rank", "ceiling", "max_queue_wait_s"))
        rank = _int(t, "rank", where, None, minimum=0)
        if rank in ranks:
            raise ConfigError(f"{where}.rank: {rank} is already the rank of tier {ranks[rank]!r}")
        ranks[rank] = name
        ceiling = _float(t, "ceiling", where, 1.0, minimum=0.0)
        if not 0.0 < ceiling <= 1.0:
            raise ConfigError(f"{where}.ceiling: expected a number in (0, 1], got {_show(ceiling)}")
        wait = _float(t, "max_queue_wait_s", where, 60.0, minimum=0.0)
        out.append(TierConfig(name=name, rank=rank, ceiling=ceiling, max_queue_wait_s=wait))
    out.sort(key=lambda t: t.rank)
    return tuple(out)


def _fairness(v: Any) -> FairnessConfig:
    m = _section(v, "fairness", ("prefill_weight", "decode_weight", "backfill_limit_s"))
    return FairnessConfig(
        prefill_weight=_float(m, "prefill_weight", "fairness", 1.0, minimum=0.0),
        decode_weight=_float(m, "decode_weight", "fairness", 2.0, minimum=0.0),
        backfill_limit_s=_float(m, "backfill_limit_s", "fairness", 2.0, minimum=0.0),
    )


def _leases(v: Any) -> LeasesConfig:
    m = _section(v, "leases", ("ttl_s",))
    ttl = _float(m, "ttl_s", "leases", 10.0, minimum=0.0)
    if ttl <= 0:
        raise ConfigError(f"leases.ttl_s: expected a positive number, got {_show(ttl)}")
    return LeasesConfig(ttl_s=ttl)


def _classes(v: Any, pool_names: set[str]) -> tuple[Mapping[str, Any], ...]:
    if v is None:
        return ()
    if not isinstance(v, list):
        raise ConfigError(f"classes: expected a list of rules, got {_show(v)}")
    try:
        from classifiers import ClassRule
    except ImportError:  # pragma: no cover - classifiers is part of the project
        ClassRule = None  # type: ignore[assignment,misc]
    names: set[str] = set()
    out = []
    for i, rule in enumerate(v):
        where = f"classes[{i}]"
        m = _mapping(rule, where)
        if ClassRule is not None:
            try:
                parsed = ClassRule.from_dict(m, where)
            except ValueError as exc:
                raise ConfigError(str(exc)) from None
            name, pool, overflow = parsed.name, parsed.pool, parsed.overflow_pool
        else:
            name, pool, overflow = str(m.get("name")), str(m.get("pool")), m.get("overflow_pool")
        if name in names:
            raise ConfigError(f"{where}.name: class {name!r} is defined twice")
        names.add(name)
        # Without pools the embedded backend's pool "default" is the only one.
        known = pool_names or {"default"}
        for key, ref in (("pool", pool), ("overflow_pool", overflow)):
            if ref is not None and ref not in known:
                raise ConfigError(
                    f"{where}.{key}: unknown pool {ref!r}{_did_you_mean(str(ref), known)}; "
                    f"configured pools: {', '.join(sorted(known))}"
                )
        out.append(dict(m))
    return tuple(out)


def _pools(v: Any) -> tuple[PoolConfig, ...]:
    if v is None:
        return ()
    m = _mapping(v, "pools")
    out = []
    seen_urls: dict[str, str] = {}
    for name, body in m.items():
        where = f"pools.{_name(name, 'pools')}"
        p = _section(body, where, ("backends",))
        raw = p.get("backends")
        if not isinstance(raw, list) or not raw:
            raise ConfigError(f"{where}.backends: expected a non-empty list of backends, got {_show(raw)}")
        backends = []
        for i, b in enumerate(raw):
            be = _backend(b, f"{where}.backends[{i}]")
            if be.url in seen_urls:
                raise ConfigError(
                    f"{where}.backends[{i}].url: {be.url} is already a backend of {seen_urls[be.url]}"
                )
            seen_urls[be.url] = where
            backends.append(be)
        out.append(PoolConfig(name=name, backends=tuple(backends)))
    return tuple(out)


def _backend(v: Any, where: str) -> BackendConfig:
    m = _section(
        v, where, ("url", "capacity_tokens", "models", "api_key", "accepts_priority", "timeouts", "name")
    )
    url = _str(m, "url", where, None)
    if not re.match(r"^https?://[^/\s]+", url):
        raise ConfigError(
            f"{where}.url: expected an http(s) URL like http://127.0.0.1:8001, got {_show(url)}"
        )
    url = url.rstrip("/")
    if url.endswith("/v1"):
        url = url[: -len("/v1")]
    tw = f"{where}.timeouts"
    t = _section(m.get("timeouts"), tw, ("connect_s", "read_s"))
    timeouts = TimeoutsConfig(
        connect_s=_positive_float(t, "connect_s", tw, 2.0), read_s=_positive_float(t, "read_s", tw, 600.0)
    )
    return BackendConfig(
        url=url,
        capacity_tokens=_int(m, "capacity_tokens", where, None, minimum=1),
        models=_str_list(m, "models", where),
        api_key=_opt_str(m, "api_key", where),
        accepts_priority=_bool(m, "accepts_priority", where, False),
        timeouts=timeouts,
        name=_str(m, "name", where, url),
    )


def _models(v: Any) -> tuple[ModelConfig, ...]:
    if v is None:
        return ()
    m = _mapping(v, "models")
    out = []
    for pattern, body in m.items():
        where = f"models.{pattern}"
        b = _section(body, where, ("tokenizer", "context_length"))
        tokenizer = _opt_str(b, "tokenizer", where)
        if tokenizer is not None:
            _check_tokenizer(tokenizer, f"{where}.tokenizer")
        out.append(
            ModelConfig(
                pattern=str(pattern),
                tokenizer=tokenizer,
                context_length=_int(b, "context_length", where, DEFAULT_CONTEXT_LENGTH, minimum=1),
            )
        )
    return tuple(out)


def _check_tokenizer(spec: str, where: str) -> None:
    """Load it now (cached by the classifiers package) so a bad spec fails at load time."""
    try:
        from classifiers import load_tokenizer
    except ImportError:  # pragma: no cover
        return
    try:
        load_tokenizer(spec)
    except (ValueError, OSError) as exc:
        raise ConfigError(f"{where}: {exc}") from None


def _pricing(v: Any) -> PricingConfig:
    fields = _pricing_fields()
    m = _section(v, "pricing", ("default_max_tokens", *sorted(fields)))
    settings = {k: _int(m, k, "pricing", None, minimum=0) for k in m if k != "default_max_tokens"}
    return PricingConfig(
        default_max_tokens=_int(m, "default_max_tokens", "pricing", 1024, minimum=1), settings=settings
    )


def _pricing_fields() -> frozenset[str]:
    try:
        from classifiers import PricingSettings
    except ImportError:  # pragma: no cover
        return _FALLBACK_PRICING_FIELDS
    return frozenset(f.name for f in dataclasses.fields(PricingSettings))


def _tenants(v: Any, tiers: Sequence[TierConfig], tier_names: set[str]) -> tuple[TenantConfig, ...]:
    if v is None:
        return ()
    m = _mapping(v, "tenants")
    # A tenant without a tier gets "standard" if there is one, else the lowest-priority tier.
    default_tier = "standard" if "standard" in tier_names else max(tiers, key=lambda t: t.rank).name
    out = []
    owner: dict[str, str] = {}
    for name, body in m.items():
        where = f"tenants.{_name(name, 'tenants')}"
        t = _section(
            body,
            where,
            (
                "keys",
                "budget_tokens",
                "weight",
                "tier",
                "default_max_tokens",
                "max_max_tokens",
                "max_queue_len",
            ),
        )
        keys = _str_list(t, "keys", where)
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
        tier = _str(t, "tier", where, default_tier)
        if tier not in tier_names:
            raise ConfigError(
                f"{where}.tier: unknown tier {tier!r}{_did_you_mean(tier, tier_names)}; "
                f"configured tiers: {', '.join(t.name for t in tiers)}"
            )
        weight = _positive_float(t, "weight", where, 1.0)
        default_max = _opt_int(t, "default_max_tokens", where, minimum=1)
        max_max = _opt_int(t, "max_max_tokens", where, minimum=1)
        if default_max is not None and max_max is not None and default_max > max_max:
            raise ConfigError(
                f"{where}.default_max_tokens: {default_max} is larger than max_max_tokens ({max_max})"
            )
        out.append(
            TenantConfig(
                name=name,
                keys=keys,
                budget_tokens=_opt_int(t, "budget_tokens", where, minimum=1),
                weight=weight,
                tier=tier,
                default_max_tokens=default_max,
                max_max_tokens=max_max,
                max_queue_len=_int(t, "max_queue_len", where, 64, minimum=0),
            )
        )
    return tuple(out)


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
    )
    m = _section(v, "limits", keys)
    d = LimitsConfig()
    return LimitsConfig(
        max_body_bytes=_int(m, "max_body_bytes", "limits", d.max_body_bytes, minimum=1),
        max_header_bytes=_int(m, "max_header_bytes", "limits", d.max_header_bytes, minimum=1024),
        header_timeout_s=_positive_float(m, "header_timeout_s", "limits", d.header_timeout_s),
        body_timeout_s=_positive_float(m, "body_timeout_s", "limits", d.body_timeout_s),
        body_idle_timeout_s=_positive_float(m, "body_idle_timeout_s", "limits", d.body_idle_timeout_s),
        max_connections=_int(m, "max_connections", "limits", d.max_connections, minimum=1),
    )


_PRICED_ROUTES = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/responses", "/v1/models")
_METHODS = ("GET", "POST", "PUT", "PATCH", "DELETE", "*")


def _passthrough(v: Any) -> tuple[PassthroughRoute, ...]:
    m = _section(v, "passthrough", ("routes",))
    if m.get("routes") is None:
        return DEFAULT_ROUTES
    routes = m["routes"]
    if not isinstance(routes, list):
        raise ConfigError(
            f"passthrough.routes: expected a list of {{method, path}} mappings, got {_show(routes)}"
        )
    out = []
    for i, item in enumerate(routes):
        where = f"passthrough.routes[{i}]"
        r = _section(item, where, ("method", "path", "generates"))
        method = _str(r, "method", where, None).upper()
        if method not in _METHODS:
            raise ConfigError(
                f"{where}.method: expected one of {', '.join(_METHODS)}, got {_show(r['method'])}"
            )
        path = _str(r, "path", where, None)
        if not path.startswith("/v1/"):
            raise ConfigError(
                f"{where}.path: must start with /v1/ (only /v1 routes are forwarded), got {_show(path)}"
            )
        if path in _PRICED_ROUTES:
            raise ConfigError(f"{where}.path: {path} is a priced route the gateway serves itself; remove it")
        if path_problem(path.replace("*", "x").replace("?", "x").encode()) is not None:
            raise ConfigError(
                f"{where}.path: {_show(path)} is not a valid path (no dot segments, '//' or escapes)"
            )
        out.append(PassthroughRoute(method, path, _bool(r, "generates", where, method != "GET")))
    return tuple(out)


def _metrics_section(v: Any) -> MetricsConfig:
    m = _section(v, "metrics", ("top_tenants",))
    return MetricsConfig(top_tenants=_int(m, "top_tenants", "metrics", 20, minimum=0))


def _health(v: Any) -> HealthConfig:
    keys = ("interval_s", "unhealthy_interval_s", "failure_threshold", "cooldown_s", "probe_timeout_s")
    m = _section(v, "health", keys)
    return HealthConfig(
        interval_s=_positive_float(m, "interval_s", "health", 5.0),
        unhealthy_interval_s=_positive_float(m, "unhealthy_interval_s", "health", 1.0),
        failure_threshold=_int(m, "failure_threshold", "health", 3, minimum=1),
        cooldown_s=_float(m, "cooldown_s", "health", 5.0, minimum=0.0),
        probe_timeout_s=_positive_float(m, "probe_timeout_s", "health", 2.0),
    )


def _upstream(v: Any) -> UpstreamConfig:
    m = _section(v, "upstream", ("max_connections", "keepalive_s"))
    return UpstreamConfig(
        max_connections=_int(m, "max_connections", "upstream", 1024, minimum=1),
        keepalive_s=_positive_float(m, "keepalive_s", "upstream", 4.0),
    )


def _embedded(v: Any) -> EmbeddedBackendConfig:
    m = _mapping(v, "embedded_backend") if v is not None else {}
    where = "embedded_backend"
    own = ("host", "port", "capacity_tokens")
    allowed = _backend_setting_fields()
    if allowed is not None:
        _check_keys(m, (*own, *sorted(allowed)), where)
    settings = {k: val for k, val in m.items() if k not in own}
    return EmbeddedBackendConfig(
        host=_str(m, "host", where, "127.0.0.1"),
        port=_int(m, "port", where, 8001, minimum=0, maximum=65535),
        capacity_tokens=_opt_int(m, "capacity_tokens", where, minimum=1),
        settings=settings,
    )


def _backend_setting_fields() -> frozenset[str] | None:
    try:
        from backends.reference.server import BackendSettings
    except ImportError:
        return None
    return frozenset(f.name for f in dataclasses.fields(BackendSettings)) - {"host", "port"}


# ---- typed getters: each error names the path ----


def _show(v: Any) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int | float):
        return str(v)
    if isinstance(v, str):
        return repr(v)
    if isinstance(v, Mapping):
        return "a mapping"
    if isinstance(v, list):
        return "a list"
    return type(v).__name__


def _join(where: str, key: str) -> str:
    return f"{where}.{key}" if where else key


def _did_you_mean(key: str, known: Sequence[str] | set[str]) -> str:
    close = difflib.get_close_matches(key, list(known), n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _mapping(v: Any, where: str, *, top: bool = False) -> Mapping[str, Any]:
    if not isinstance(v, Mapping):
        raise ConfigError(f"{where}: expected a mapping, got {_show(v)}")
    for k in v:
        if not isinstance(k, str):
            raise ConfigError(f"{where}: keys must be strings, got {_show(k)}")
    return v


def _check_keys(m: Mapping[str, Any], allowed: Sequence[str], where: str) -> None:
    for key in m:
        if key not in allowed:
            raise ConfigError(
                f"{_join(where, key)}: unknown key{_did_you_mean(key, allowed)}; "
                f"known keys here: {', '.join(allowed)}"
            )


def _section(v: Any, where: str, allowed: Sequence[str]) -> Mapping[str, Any]:
    if v is None:
        return {}
    m = _mapping(v, where)
    _check_keys(m, allowed, where)
    return m


def _name(name: str, where: str) -> str:
    if not _NAME_RE.match(name):
        raise ConfigError(f"{where}: name {name!r} may only use letters, digits, '_', '-' and '.'")
    return name


def _int(
    m: Mapping[str, Any],
    key: str,
    where: str,
    default: int | None,
    *,
    minimum: int | None = None,
    maximum: int | None = None,
) -> int:
    path = _join(where, key)
    if key not in m or m[key] is None:
        if default is None:
            raise ConfigError(f"{path}: required, expected {_int_kind(minimum)}")
        return default
    v = m[key]
    if isinstance(v, bool) or not isinstance(v, int) or (minimum is not None and v < minimum):
        raise ConfigError(f"{path}: expected {_int_kind(minimum)}, got {_show(v)}")
    if maximum is not None and v > maximum:
        raise ConfigError(f"{path}: expected at most {maximum}, got {_show(v)}")
    return v


def _int_kind(minimum: int | None) -> str:
    if minimum == 1:
        return "a positive integer"
    if minimum == 0:
        return "a non-negative integer"
    return "an integer"


def _opt_int(m: Mapping[str, Any], key: str, where: str, *, minimum: int | None = None) -> int | None:
    if m.get(key) is None:
        return None
    return _int(m, key, where, None, minimum=minimum)


def _float(
    m: Mapping[str, Any], key: str, where: str, default: float, *, minimum: float | None = None
) -> float:
    path = _join(where, key)
    v = m.get(key)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int | float):
        raise ConfigError(f"{path}: expected a number, got {_show(v)}")
    if minimum is not None and v < minimum:
        raise ConfigError(f"{path}: expected a non-negative number, got {_show(v)}")
    return float(v)


def _positive_float(m: Mapping[str, Any], key: str, where: str, default: float) -> float:
    v = _float(m, key, where, default)
    if v <= 0:
        raise ConfigError(f"{_join(where, key)}: expected a positive number, got {_show(m.get(key))}")
    return v


def _str(m: Mapping[str, Any], key: str, where: str, default: str | None) -> str:
    path = _join(where, key)
    v = m.get(key)
    if v is None:
        if default is None:
            raise ConfigError(f"{path}: required, expected a string")
        return default
    if not isinstance(v, str) or not v:
        raise ConfigError(f"{path}: expected a non-empty string, got {_show(v)}")
    return v


def _opt_str(m: Mapping[str, Any], key: str, where: str) -> str | None:
    if m.get(key) is None:
        return None
    return _str(m, key, where, None)


def _bool(m: Mapping[str, Any], key: str, where: str, default: bool) -> bool:
    v = m.get(key)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise ConfigError(f"{_join(where, key)}: expected true or false, got {_show(v)}")
    return v


def _str_list(m: Mapping[str, Any], key: str, where: str) -> tuple[str, ...]:
    v = m.get(key)
    if v is None:
        return ()
    if isinstance(v, str):
        v = [v]
    if not isinstance(v, list):
        raise ConfigError(f"{_join(where, key)}: expected a list of strings, got {_show(v)}")
    for i, item in enumerate(v):
        if not isinstance(item, str) or not item:
            raise ConfigError(f"{_join(where, key)}[{i}]: expected a non-empty string, got {_show(item)}")
    return tuple(v)

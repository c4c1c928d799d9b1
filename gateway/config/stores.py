"""The one budget-store factory, and the ``store:`` config section it is built from.

``memory`` is the embedded default (one process); ``redis`` shares pools and one queue across every
replica (``budgets.redis``). The section is read with the config toolkit into the store's own
typed options (``RedisOptions``), so every error names the field::

    store:
      kind: redis
      url: redis://127.0.0.1:6379/0  # or redis+sentinel://s1:26379,s2:26379,s3:26379/mymaster/0
      key_prefix: tokengate          # budget domain: all its keys share the tag {tg:<prefix>}
      timeouts: {connect_s: 0.5, op_s: 0.5}
      fail_mode: closed              # closed: 503 at once while Redis is down; open: local budget
      replicas: 1                    # gateway replicas: fail-open gives each capacity/replicas;
                                     # after Redis lost its data, grants wait for this many
      poll_interval_s: 0.25          # waiters re-check their ticket this often (lost wake-ups)
      max_connections: 32            # per replica
      domains:                       # more budget domains beside this one (budgets.domains)
        eu: {pools: [eu-chat, eu-long]}                # key_prefix: <key_prefix>-eu
        us: {pools: [us-chat], key_prefix: tg-us, url: redis://us-redis:6379/0}

Backend pools no domain names stay in the default domain (``key_prefix`` above). Each domain holds
its own pools and every tenant's and class's budget, each at its configured size: budgets are per
domain. ``kind: memory`` takes ``domains`` too (``pools`` only): one process-local store each.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Sequence
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from budgets.domains import DEFAULT_DOMAIN, DomainStore, domain_layout, pool_owners
from budgets.memory import MemoryStore
from budgets.quotas import MemoryQuotas, QuotaLedger
from budgets.redis import RedisOptions, RedisStore
from budgets.redis.cluster import is_cluster_url, parse_cluster_url
from budgets.redis.sentinel import is_sentinel_url, parse_sentinel_url
from budgets.types import BudgetLayout, BudgetStore
from budgets.usage_log import MemoryUsageLog, UsageLog
from gateway.config.fields import (
    ConfigError,
    choice,
    did_you_mean,
    integer,
    mapping,
    positive_number,
    section,
    show,
    string,
    string_list,
    valid_name,
)
from gateway.config.schema import DomainConfig, StoreConfig

KINDS = ("memory", "redis")
_REDIS_KEYS = (
    "kind",
    "url",
    "key_prefix",
    "timeouts",
    "fail_mode",
    "replicas",
    "poll_interval_s",
    "max_connections",
    "lua",
    "domains",
)
_DOMAIN_KEYS = ("pools", "key_prefix", "url")


def parse_store(v: Any, where: str = "store") -> StoreConfig:
    """The ``store:`` section, validated; errors name the field (``store.timeouts.op_s: ...``)."""
    m = mapping(v, where) if v is not None else {}
    kind = choice(m, "kind", where, "memory", KINDS)
    if kind == "memory":
        section(m, where, ("kind", "domains"))
        return StoreConfig(kind="memory", domains=_domains(m.get("domains"), f"{where}.domains", None))
    section(m, where, _REDIS_KEYS)
    d = RedisOptions()
    url = _url(string(m, "url", where, d.url), f"{where}.url")
    prefix = _prefix(string(m, "key_prefix", where, d.key_prefix), f"{where}.key_prefix")
    tw = f"{where}.timeouts"
    t = section(m.get("timeouts"), tw, ("connect_s", "op_s"))
    options = RedisOptions(
        url=url,
        key_prefix=prefix,
        connect_timeout_s=positive_number(t, "connect_s", tw, d.connect_timeout_s),
        op_timeout_s=positive_number(t, "op_s", tw, d.op_timeout_s),
        fail_mode="open"
        if choice(m, "fail_mode", where, d.fail_mode, ("closed", "open")) == "open"
        else "closed",
        replicas=integer(m, "replicas", where, d.replicas, minimum=1),
        poll_interval_s=positive_number(m, "poll_interval_s", where, d.poll_interval_s),
        max_connections=integer(m, "max_connections", where, d.max_connections, minimum=1),
        lua="scripts"
        if choice(m, "lua", where, d.lua, ("functions", "scripts")) == "scripts"
        else "functions",
    )
    return StoreConfig(
        kind="redis", redis=options, domains=_domains(m.get("domains"), f"{where}.domains", options)
    )


def _url(url: str, where: str) -> str:
    if is_sentinel_url(url) or is_cluster_url(url):
        try:
            (parse_sentinel_url if is_sentinel_url(url) else parse_cluster_url)(url)
        except ValueError as exc:
            raise ConfigError(f"{where}: {exc}") from None
    elif not url.startswith(("redis://", "rediss://", "unix://")):
        raise ConfigError(
            f"{where}: expected redis://host:port/db, rediss://..., unix://..., "
            f"redis+sentinel://host:port[,host:port...]/master[/db] or "
            f"redis+cluster://host:port[,host:port...], got {show(_without_secrets(url))}"
        )
    return url


def _without_secrets(url: str) -> str:
    """``url`` fit for a message: a password in its user info or its query is ``***``."""
    parts = urlsplit(url)
    netloc = parts.netloc
    auth, at, hosts = netloc.rpartition("@")
    if at:
        user, colon, _ = auth.partition(":")
        netloc = f"{user}:***@{hosts}" if colon else f"***@{hosts}"
    query = re.sub(r"(?i)(password=)[^&]*", r"\1***", parts.query)
    return urlunsplit(parts._replace(netloc=netloc, query=query))


def _prefix(prefix: str, where: str) -> str:
    if any(c in prefix for c in "{}") or not prefix.isprintable():
        raise ConfigError(
            f"{where}: expected a non-empty printable string without braces, got {show(prefix)}"
        )
    return prefix


def _domains(v: Any, where: str, base: RedisOptions | None) -> tuple[DomainConfig, ...]:
    """``store.domains``: name -> {pools, key_prefix, url}; ``base`` is the default domain's Redis
    options (None: memory), which every domain shares but for its prefix and, if given, its URL."""
    if v is None:
        return ()
    out: list[DomainConfig] = []
    prefixes = {(base.url, base.key_prefix): DEFAULT_DOMAIN} if base is not None else {}
    owner: dict[str, str] = {}
    for name, body in mapping(v, where).items():
        w = f"{where}.{name}"
        valid_name(str(name), w)
        if name == DEFAULT_DOMAIN:
            raise ConfigError(
                f"{w}: {DEFAULT_DOMAIN!r} is the domain of store.key_prefix (every pool no domain "
                "names); give this domain another name"
            )
        m = section(body, w, _DOMAIN_KEYS if base is not None else ("pools",))
        pools = string_list(m, "pools", w)
        if not pools:
            raise ConfigError(f"{w}.pools: list the backend pools this domain owns (at least one)")
        for pool in pools:
            if pool in owner:
                raise ConfigError(
                    f"{w}.pools: pool {pool!r} is already in domain {owner[pool]!r}; a pool belongs to one domain"
                )
            owner[pool] = name
        redis = None
        if base is not None:
            prefix = _prefix(string(m, "key_prefix", w, f"{base.key_prefix}-{name}"), f"{w}.key_prefix")
            url = _url(string(m, "url", w, base.url), f"{w}.url")
            if (url, prefix) in prefixes:
                raise ConfigError(
                    f"{w}.key_prefix: {prefix!r} on {url} is already used by domain {prefixes[url, prefix]!r}; "
                    "two domains sharing keys would grant one budget twice"
                )
            prefixes[url, prefix] = name
            redis = dataclasses.replace(base, url=url, key_prefix=prefix)
        out.append(DomainConfig(name=name, pools=pools, redis=redis))
    return tuple(out)


def check_domain_pools(config: StoreConfig, pools: Sequence[str], where: str = "store.domains") -> None:
    """Every pool a domain names must be a configured pool (a typo would leave it in the default
    domain, sharing budgets the operator meant to split)."""
    known = set(pools)
    for dom in config.domains:
        for pool in dom.pools:
            if pool not in known:
                raise ConfigError(
                    f"{where}.{dom.name}.pools: no pool {pool!r}{did_you_mean(pool, known)}; "
                    f"configured pools: {', '.join(sorted(known)) or '(none)'}"
                )


def is_shared(kind: str) -> bool:
    """Whether several gateway processes see one budget through this store."""
    return kind == "redis"


def build_store(
    config: StoreConfig, layout: BudgetLayout, clock: Callable[[], float] | None = None
) -> BudgetStore:
    """An unstarted store for ``config`` (the app starts and closes it): one domain's, or a
    :class:`DomainStore` over one store per domain."""
    if not config.domains:
        return _one_store(config.kind, config.redis, layout, clock)
    owner = pool_owners({dom.name: dom.pools for dom in config.domains})
    stores = {
        DEFAULT_DOMAIN: _one_store(
            config.kind, config.redis, domain_layout(layout, DEFAULT_DOMAIN, owner), clock
        )
    }
    for dom in config.domains:
        stores[dom.name] = _one_store(config.kind, dom.redis, domain_layout(layout, dom.name, owner), clock)
    return DomainStore(stores, owner)


def quota_ledger(store: BudgetStore, ttl_s: float) -> QuotaLedger:
    """Where quota windows live: a tenant's quotas are fleet-wide, so in the Redis of the store (of
    its default domain when there are several), else in this process."""
    if isinstance(store, DomainStore):
        store = store.stores[DEFAULT_DOMAIN]
    if isinstance(store, RedisStore):
        return store.quota_ledger(ttl_s)
    return MemoryQuotas(ttl_s)


def usage_log(store: BudgetStore) -> UsageLog:
    """Where usage for billing is kept: beside the quota windows."""
    if isinstance(store, DomainStore):
        store = store.stores[DEFAULT_DOMAIN]
    if isinstance(store, RedisStore):
        return store.usage_log()
    return MemoryUsageLog()


def _one_store(
    kind: str, redis: RedisOptions | None, layout: BudgetLayout, clock: Callable[[], float] | None
) -> BudgetStore:
    if kind == "redis":
        return RedisStore(layout, redis or RedisOptions())
    return MemoryStore(layout, clock=clock) if clock is not None else MemoryStore(layout)


__all__ = [
    "KINDS",
    "build_store",
    "check_domain_pools",
    "is_shared",
    "parse_store",
    "quota_ledger",
    "usage_log",
]

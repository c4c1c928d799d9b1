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
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from budgets.memory import MemoryStore
from budgets.redis import RedisOptions, RedisStore
from budgets.redis.cluster import is_cluster_url, parse_cluster_url
from budgets.redis.sentinel import is_sentinel_url, parse_sentinel_url
from budgets.types import BudgetLayout, BudgetStore
from gateway.config.fields import (
    ConfigError,
    choice,
    integer,
    mapping,
    positive_number,
    section,
    show,
    string,
)
from gateway.config.schema import StoreConfig

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
)


def parse_store(v: Any, where: str = "store") -> StoreConfig:
    """The ``store:`` section, validated; errors name the field (``store.timeouts.op_s: ...``)."""
    m = mapping(v, where) if v is not None else {}
    kind = choice(m, "kind", where, "memory", KINDS)
    if kind == "memory":
        section(m, where, ("kind",))
        return StoreConfig(kind="memory")
    section(m, where, _REDIS_KEYS)
    d = RedisOptions()
    url = string(m, "url", where, d.url)
    if is_sentinel_url(url) or is_cluster_url(url):
        try:
            (parse_sentinel_url if is_sentinel_url(url) else parse_cluster_url)(url)
        except ValueError as exc:
            raise ConfigError(f"{where}.url: {exc}") from None
    elif not url.startswith(("redis://", "rediss://", "unix://")):
        raise ConfigError(
            f"{where}.url: expected redis://host:port/db, rediss://..., unix://..., "
            f"redis+sentinel://host:port[,host:port...]/master[/db] or "
            f"redis+cluster://host:port[,host:port...], got {show(url)}"
        )
    prefix = string(m, "key_prefix", where, d.key_prefix)
    if any(c in prefix for c in "{}") or not prefix.isprintable():
        raise ConfigError(
            f"{where}.key_prefix: expected a non-empty printable string without braces, got {show(prefix)}"
        )
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
    return StoreConfig(kind="redis", redis=options)


def is_shared(kind: str) -> bool:
    """Whether several gateway processes see one budget through this store."""
    return kind == "redis"


def build_store(
    config: StoreConfig, layout: BudgetLayout, clock: Callable[[], float] | None = None
) -> BudgetStore:
    """An unstarted store for ``config`` (the app starts and closes it)."""
    if config.kind == "redis":
        return RedisStore(layout, config.redis or RedisOptions())
    return MemoryStore(layout, clock=clock) if clock is not None else MemoryStore(layout)


__all__ = ["KINDS", "build_store", "is_shared", "parse_store"]

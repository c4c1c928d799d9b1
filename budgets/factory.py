"""Store construction from the ``store:`` config section, for the stores that live in ``budgets``.

The gateway's own factory (gateway/stores.py) knows the memory store and delegates every other
kind here: :func:`check_options` validates the section (errors name the key, as the config
loader expects: ``"timeouts.op_s: expected a positive number, got -1"``; the caller adds
``store.``), :func:`build_store` returns an unstarted store.

Redis section (every key optional)::

    store:
      kind: redis
      url: redis://127.0.0.1:6379/0
      key_prefix: tokengate          # budget domain: all its keys share the tag {tg:<prefix>}
      timeouts: {connect_s: 0.5, op_s: 0.5}
      fail_mode: closed              # closed: 503 at once while Redis is down; open: local budget
      replicas: 1                    # gateway replicas: fail-open gives each capacity/replicas;
                                     # after Redis lost its data, grants wait for this many
      poll_interval_s: 0.25          # waiters re-check their ticket this often (lost wake-ups)
      max_connections: 32            # per replica
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from typing import Any

from budgets.redis_store import RedisOptions, RedisStore
from budgets.types import BudgetLayout, BudgetStore

KINDS = ("redis",)
REDIS_KEYS = ("url", "key_prefix", "timeouts", "fail_mode", "replicas", "poll_interval_s", "max_connections")
TIMEOUT_KEYS = ("connect_s", "op_s")


def _unknown(key: str, known: tuple[str, ...], where: str) -> ValueError:
    close = difflib.get_close_matches(key, known, n=1)
    hint = f"; did you mean {close[0]!r}?" if close else f"; known keys: {', '.join(known)}"
    return ValueError(f"{where}{key}: unknown key{hint}")


def _positive(value: Any, key: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
        raise ValueError(f"{key}: expected a positive number, got {value!r}")
    return float(value)


def _positive_int(value: Any, key: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{key}: expected a positive integer, got {value!r}")
    return value


def redis_options(options: Mapping[str, Any]) -> RedisOptions:
    """Validate a redis ``store:`` section (without ``kind``) into RedisOptions."""
    for key in options:
        if key != "kind" and key not in REDIS_KEYS:
            raise _unknown(key, REDIS_KEYS, "")
    defaults = RedisOptions()
    url = options.get("url", defaults.url)
    if not isinstance(url, str) or not url.startswith(("redis://", "rediss://", "unix://")):
        raise ValueError(f"url: expected redis://host:port/db, rediss://... or unix://..., got {url!r}")
    prefix = options.get("key_prefix", defaults.key_prefix)
    if (
        not isinstance(prefix, str)
        or not prefix
        or any(c in prefix for c in "{}")
        or not prefix.isprintable()
    ):
        raise ValueError(f"key_prefix: expected a non-empty printable string without braces, got {prefix!r}")
    timeouts = options.get("timeouts", {})
    if not isinstance(timeouts, Mapping):
        raise ValueError(f"timeouts: expected a mapping with {' and '.join(TIMEOUT_KEYS)}, got {timeouts!r}")
    for key in timeouts:
        if key not in TIMEOUT_KEYS:
            raise _unknown(str(key), TIMEOUT_KEYS, "timeouts.")
    connect_s = _positive(timeouts.get("connect_s", defaults.connect_timeout_s), "timeouts.connect_s")
    op_s = _positive(timeouts.get("op_s", defaults.op_timeout_s), "timeouts.op_s")
    fail_mode = options.get("fail_mode", defaults.fail_mode)
    if fail_mode not in ("closed", "open"):
        raise ValueError(f"fail_mode: expected 'closed' or 'open', got {fail_mode!r}")
    return RedisOptions(
        url=url,
        key_prefix=prefix,
        connect_timeout_s=connect_s,
        op_timeout_s=op_s,
        fail_mode=fail_mode,
        replicas=_positive_int(options.get("replicas", defaults.replicas), "replicas"),
        poll_interval_s=_positive(
            options.get("poll_interval_s", defaults.poll_interval_s), "poll_interval_s"
        ),
        max_connections=_positive_int(
            options.get("max_connections", defaults.max_connections), "max_connections"
        ),
    )


def check_options(kind: str, options: Mapping[str, Any]) -> None:
    if kind not in KINDS:
        raise ValueError(f"kind: unknown store kind {kind!r}; expected one of: memory, {', '.join(KINDS)}")
    redis_options(options)


def build_store(kind: str, layout: BudgetLayout, options: Mapping[str, Any]) -> BudgetStore:
    check_options(kind, options)
    return RedisStore(layout, redis_options(options))

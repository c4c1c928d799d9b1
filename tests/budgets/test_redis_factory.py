"""The redis ``store:`` section: validation messages name the key; the factory builds a RedisStore."""

from __future__ import annotations

from typing import Any

import pytest

from budgets.factory import build_store, check_options, redis_options
from budgets.redis_store import RedisStore
from tests.budgets.support import layout, shared


def test_defaults_and_full_section() -> None:
    assert redis_options({}).fail_mode == "closed"
    opts = redis_options(
        {
            "kind": "redis",
            "url": "redis://10.0.0.5:6380/2",
            "key_prefix": "prod",
            "timeouts": {"connect_s": 0.2, "op_s": 0.1},
            "fail_mode": "open",
            "replicas": 3,
            "poll_interval_s": 0.5,
            "max_connections": 8,
        }
    )
    assert (opts.url, opts.key_prefix, opts.fail_mode, opts.replicas) == (
        "redis://10.0.0.5:6380/2",
        "prod",
        "open",
        3,
    )
    assert (opts.connect_timeout_s, opts.op_timeout_s, opts.poll_interval_s, opts.max_connections) == (
        0.2,
        0.1,
        0.5,
        8,
    )


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"urll": "redis://x"}, "urll: unknown key; did you mean 'url'?"),
        ({"url": "http://x"}, "url: expected redis://"),
        ({"key_prefix": "a{b}"}, "key_prefix: expected a non-empty printable string without braces"),
        ({"timeouts": {"op": 1}}, "timeouts.op: unknown key; did you mean 'op_s'?"),
        ({"timeouts": {"op_s": -1}}, "timeouts.op_s: expected a positive number, got -1"),
        ({"timeouts": 3}, "timeouts: expected a mapping"),
        ({"fail_mode": "maybe"}, "fail_mode: expected 'closed' or 'open', got 'maybe'"),
        ({"replicas": 0}, "replicas: expected a positive integer, got 0"),
        ({"replicas": True}, "replicas: expected a positive integer, got True"),
        ({"poll_interval_s": "fast"}, "poll_interval_s: expected a positive number, got 'fast'"),
    ],
)
def test_invalid_sections_name_the_key(options: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError) as info:
        check_options("redis", options)
    assert str(info.value).startswith(message)


def test_unknown_kind() -> None:
    with pytest.raises(ValueError, match="kind: unknown store kind 'etcd'"):
        check_options("etcd", {})


def test_build_store_returns_an_unstarted_redis_store() -> None:
    store = build_store("redis", layout([shared("backend:p", 10)], ["a"]), {"key_prefix": "x", "replicas": 2})
    assert isinstance(store, RedisStore)
    assert store.keys.tag == "{tg:x}"

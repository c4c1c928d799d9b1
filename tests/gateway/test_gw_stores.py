"""The ``store:`` section: validation messages name the field; the one factory builds each store."""

from __future__ import annotations

from typing import Any

import pytest

from budgets.domains import DomainStore
from budgets.memory import MemoryStore
from budgets.redis import RedisStore
from gateway.config.fields import ConfigError
from gateway.config.loader import parse_config
from gateway.config.stores import build_store, parse_store
from tests.budgets.support import layout, private, shared


def test_defaults_and_full_section() -> None:
    assert parse_store(None).kind == "memory"
    redis = parse_store({"kind": "redis"}).redis
    assert redis is not None and redis.fail_mode == "closed" and redis.lua == "functions"
    opts = parse_store(
        {
            "kind": "redis",
            "url": "redis://10.0.0.5:6380/2",
            "key_prefix": "prod",
            "timeouts": {"connect_s": 0.2, "op_s": 0.1},
            "fail_mode": "open",
            "replicas": 3,
            "poll_interval_s": 0.5,
            "max_connections": 8,
            "lua": "scripts",
        }
    ).redis
    assert opts is not None
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
    assert opts.lua == "scripts"


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"urll": "redis://x"}, "store.urll: unknown key (did you mean 'url'?)"),
        ({"url": "http://x"}, "store.url: expected redis://"),
        ({"url": "redis+sentinel://s1:26379"}, "store.url: expected the master's name after the sentinels"),
        ({"url": "redis+sentinel://s1/m"}, "store.url: sentinel 's1': expected host:port"),
        ({"url": "redis+cluster://n1/"}, "store.url: node 'n1': expected host:port of a cluster node"),
        ({"url": "redis+cluster://n1:7000/3"}, "store.url: a cluster has only database 0"),
        ({"key_prefix": "a{b}"}, "store.key_prefix: expected a non-empty printable string without braces"),
        ({"timeouts": {"op": 1}}, "store.timeouts.op: unknown key (did you mean 'op_s'?)"),
        ({"timeouts": {"op_s": -1}}, "store.timeouts.op_s: expected a positive number, got -1"),
        ({"timeouts": 3}, "store.timeouts: expected a mapping"),
        ({"fail_mode": "maybe"}, "store.fail_mode: expected one of 'closed', 'open', got 'maybe'"),
        ({"replicas": 0}, "store.replicas: expected a positive integer, got 0"),
        ({"replicas": True}, "store.replicas: expected a positive integer, got true"),
        ({"poll_interval_s": "fast"}, "store.poll_interval_s: expected a number, got 'fast'"),
        ({"lua": "eval"}, "store.lua: expected one of 'functions', 'scripts', got 'eval'"),
    ],
)
def test_invalid_sections_name_the_field(options: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_store({"kind": "redis", **options})
    assert str(info.value).startswith(message)


def test_a_refused_url_is_quoted_without_its_passwords() -> None:
    for url in (
        "http://user:s3cret@host:6379/0",
        "http://s3cret@host:6379",
        "https://h:1/?sentinel_password=s3cret&x=1",
    ):
        with pytest.raises(ConfigError, match=r"store\.url: expected redis://") as info:
            parse_store({"kind": "redis", "url": url})
        assert "s3cret" not in str(info.value) and "***" in str(info.value), str(info.value)


def test_unknown_kind_and_memory_options_are_refused() -> None:
    with pytest.raises(ConfigError, match=r"store\.kind: expected one of 'memory', 'redis', got 'etcd'"):
        parse_store({"kind": "etcd"})
    with pytest.raises(ConfigError, match=r"store\.url: unknown key"):
        parse_store({"kind": "memory", "url": "redis://x"})


def test_one_factory_builds_every_store_unstarted() -> None:
    lay = layout([shared("backend:p", 10)], ["a"])
    assert isinstance(build_store(parse_store(None), lay), MemoryStore)
    store = build_store(parse_store({"kind": "redis", "key_prefix": "x", "replicas": 2}), lay)
    assert isinstance(store, RedisStore)
    assert store.keys.tag == "{tg:x}"


def test_a_sentinel_url_is_a_redis_store_that_asks_the_sentinels() -> None:
    config = parse_store({"kind": "redis", "url": "redis+sentinel://s1:26379,s2:26379/mymaster/1"})
    assert config.redis is not None and config.redis.url == "redis+sentinel://s1:26379,s2:26379/mymaster/1"


def test_domains_inherit_the_stores_options_with_their_own_prefix_and_url() -> None:
    config = parse_store(
        {
            "kind": "redis",
            "url": "redis+cluster://n1:7000,n2:7000",
            "key_prefix": "prod",
            "fail_mode": "open",
            "domains": {
                "eu": {"pools": ["eu-chat", "eu-long"]},
                "us": {"pools": "us-chat", "key_prefix": "tg-us", "url": "redis://us:6379/0"},
            },
        }
    )
    eu, us = config.domains
    assert (eu.name, eu.pools, us.name, us.pools) == ("eu", ("eu-chat", "eu-long"), "us", ("us-chat",))
    assert eu.redis is not None and us.redis is not None
    assert (eu.redis.url, eu.redis.key_prefix, eu.redis.fail_mode) == (
        "redis+cluster://n1:7000,n2:7000",
        "prod-eu",
        "open",
    )
    assert (us.redis.url, us.redis.key_prefix) == ("redis://us:6379/0", "tg-us")
    memory = parse_store({"domains": {"eu": {"pools": ["eu-chat"]}}})
    assert memory.domains[0].pools == ("eu-chat",) and memory.domains[0].redis is None


@pytest.mark.parametrize(
    ("domains", "message"),
    [
        ({"default": {"pools": ["a"]}}, "store.domains.default: 'default' is the domain of store.key_prefix"),
        ({"eu": {"pools": []}}, "store.domains.eu.pools: list the backend pools this domain owns"),
        ({"eu": {}}, "store.domains.eu.pools: list the backend pools"),
        (
            {"eu": {"pools": ["a"]}, "us": {"pools": ["a"]}},
            "store.domains.us.pools: pool 'a' is already in domain 'eu'",
        ),
        (
            {"eu": {"pools": ["a"], "prefix": "x"}},
            "store.domains.eu.prefix: unknown key (did you mean 'key_prefix'?)",
        ),
        (
            {"eu": {"pools": ["a"], "key_prefix": "tokengate"}},
            "store.domains.eu.key_prefix: 'tokengate' on redis://127.0.0.1:6379/0 is already used by domain 'default'",
        ),
        ({"e/u": {"pools": ["a"]}}, "store.domains.e/u: name 'e/u' may only use"),
        ({"eu": {"pools": ["a"], "url": "http://x"}}, "store.domains.eu.url: expected redis://"),
        ({"eu": ["a"]}, "store.domains.eu: expected a mapping"),
    ],
)
def test_invalid_domains_name_the_field(domains: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_store({"kind": "redis", "domains": domains})
    assert str(info.value).startswith(message)


def test_memory_domains_take_pools_only() -> None:
    with pytest.raises(ConfigError, match=r"store\.domains\.eu\.key_prefix: unknown key"):
        parse_store({"domains": {"eu": {"pools": ["a"], "key_prefix": "x"}}})


def test_a_domain_naming_a_pool_the_config_lacks_is_refused() -> None:
    pools = {
        n: {"backends": [{"url": f"http://127.0.0.1:{port}", "capacity_tokens": 100}]}
        for n, port in (("chat", 9), ("long", 10))
    }
    with pytest.raises(
        ConfigError,
        match=r"store\.domains\.eu\.pools: no pool 'chatt' \(did you mean 'chat'\?\); configured pools: chat, long",
    ):
        parse_config({"pools": pools, "store": {"domains": {"eu": {"pools": ["chatt"]}}}})
    # Without pools, the embedded backends' pools are the ones a domain may name.
    assert parse_config({"store": {"domains": {"eu": {"pools": ["long"]}}}}).store.domains[0].pools == (
        "long",
    )


def test_the_factory_builds_one_store_per_domain_over_its_part_of_the_layout() -> None:
    lay = layout([shared("backend:p", 10), shared("backend:eu", 20), private("tenant:a", 5)], ["a"])
    store = build_store(
        parse_store({"kind": "redis", "key_prefix": "x", "domains": {"eu": {"pools": ["eu"]}}}), lay
    )
    assert isinstance(store, DomainStore)
    default, eu = store.stores["default"], store.stores["eu"]
    assert isinstance(default, RedisStore) and isinstance(eu, RedisStore)
    assert (default.keys.tag, eu.keys.tag) == ("{tg:x}", "{tg:x-eu}")
    where = store.describe()["domains"]
    assert isinstance(where, dict) and where["eu"]["domain"] == "x-eu"

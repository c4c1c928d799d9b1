"""Config loading: defaults, the full documented shape, and error messages that name the field."""

from __future__ import annotations

from pathlib import Path

import pytest

from classifiers.images import ImageRule
from gateway.config.loader import ConfigError, check_workers, hash_key, load_config, parse_config
from gateway.config.schema import DEFAULT_TIERS, GatewayConfig, GcConfig

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"

FULL = {
    "listen": {"host": "0.0.0.0", "port": 9000},
    "workers": 1,
    "store": {"kind": "memory"},
    "tiers": {
        "critical": {"rank": 0, "ceiling": 1.0, "max_queue_wait_s": 30},
        "standard": {"rank": 1, "ceiling": 0.9, "max_queue_wait_s": 60},
        "batch": {"rank": 2, "ceiling": 0.7, "max_queue_wait_s": 600},
    },
    "fairness": {"prefill_weight": 1, "decode_weight": 2, "backfill_limit_s": 2},
    "leases": {"ttl_s": 10},
    "classes": [
        {"name": "reasoning", "when": {"min_prompt_tokens": 8000}, "pool": "long"},
        {"name": "long", "when": {"min_cost": 16000}, "pool": "long", "overflow_pool": "short"},
        {"name": "short", "pool": "short"},
    ],
    "pools": {
        "short": {
            "backends": [
                {
                    "url": "http://127.0.0.1:8001/v1/",
                    "capacity_tokens": 200000,
                    "models": ["tokengate-sim"],
                    "api_key": "backend-secret",
                    "accepts_priority": True,
                    "timeouts": {"connect_s": 2, "read_s": 600},
                }
            ]
        },
        "long": {"backends": [{"url": "http://127.0.0.1:8002", "capacity_tokens": 400000}]},
    },
    "models": {
        "gpt-4o*": {"tokenizer": "bytes", "context_length": 128000},
        "Qwen/Qwen2.5-VL-*": {"images": {"patch_pixels": 28, "max_pixels": 1003520, "extra_tokens": 2}},
        "llava-*": {"images": {"tokens": 576}, "vocab_size": 32064},
    },
    "pricing": {"per_message_tokens": 3, "image_tokens": 765, "default_max_tokens": 1024},
    "tenants": {
        "acme": {"keys": ["sk-acme-1"], "budget_tokens": 64000, "weight": 2, "tier": "critical"},
        "free": {
            "keys": [hash_key("sk-free-1")],
            "budget_tokens": 16000,
            "weight": 1,
            "tier": "batch",
            "default_max_tokens": 512,
            "max_max_tokens": 4096,
            "max_queue_len": 16,
        },
    },
    "limits": {"max_body_bytes": 4194304, "body_timeout_s": 30, "max_header_bytes": 32768},
    "passthrough": {
        "routes": [
            {"method": "GET", "path": "/v1/files/*"},
            {"method": "POST", "path": "/v1/rerank", "generates": False},
        ]
    },
    "metrics": {"top_tenants": 20},
    "embedded_backend": {"port": 8001},
    "drain_timeout_s": 30,
    "enforce_max_tokens": True,
}


def test_no_config_is_the_embedded_default() -> None:
    cfg = load_config(None)
    assert cfg == GatewayConfig()
    assert cfg.tiers == DEFAULT_TIERS
    assert cfg.open_mode and not cfg.pools and cfg.store.kind == "memory"


def test_full_documented_shape_loads() -> None:
    cfg = parse_config(FULL)
    assert cfg.listen.port == 9000
    short = cfg.pool("short")
    assert short is not None
    backend = short.backends[0]
    # A trailing /v1/ is tolerated: the gateway appends the request path itself.
    assert backend.url == "http://127.0.0.1:8001"
    assert backend.api_key == "backend-secret" and backend.accepts_priority
    assert backend.timeouts.read_s == 600
    assert cfg.pool("long") is not None and cfg.pool("long").capacity_tokens == 400000  # type: ignore[union-attr]
    assert [t.name for t in cfg.tenants] == ["acme", "free"]
    assert cfg.tenants[1].max_queue_len == 16 and cfg.tenants[1].tier == "batch"
    assert cfg.models[0].context_length == 128000 and cfg.models[0].images is None
    assert cfg.models[1].images == ImageRule(patch_pixels=28, max_pixels=1003520, extra_tokens=2)
    assert cfg.models[1].images.most == 1282 and cfg.models[2].images == ImageRule(tokens=576)
    assert (cfg.models[1].vocab_size, cfg.models[2].vocab_size) == (None, 32064)
    assert cfg.pricing.default_max_tokens == 1024
    assert (cfg.pricing.settings.per_message_tokens, cfg.pricing.settings.image_tokens) == (3, 765)
    assert cfg.pricing.settings.encode_idle  # the default
    assert len(cfg.classes) == 3


def test_example_configs_load() -> None:
    files = sorted(EXAMPLES.glob("*.yaml"))
    assert files, "examples/ should ship config files"
    for f in files:
        load_config(f)


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (
            {"tenants": {"acme": {"budget_tokens": -5}}},
            "tenants.acme.budget_tokens: expected a positive integer, got -5",
        ),
        (
            {"tenants": {"acme": {"budget_tokens": "lots"}}},
            "tenants.acme.budget_tokens: expected a positive integer, got 'lots'",
        ),
        ({"tenants": {"acme": {"weight": True}}}, "tenants.acme.weight: expected a number, got true"),
        ({"tenants": {"acme": {"tier": "gold"}}}, "tenants.acme.tier: unknown tier 'gold'"),
        ({"tenants": {"acme": {"tier": "critcal"}}}, "did you mean 'critical'?"),
        (
            {"tenants": {"acme": {"budget_token": 5}}},
            "tenants.acme.budget_token: unknown key (did you mean 'budget_tokens'?)",
        ),
        ({"tenats": {}}, "tenats: unknown key (did you mean 'tenants'?)"),
        ({"listen": {"port": 70000}}, "listen.port: expected at most 65535, got 70000"),
        ({"pools": {"a": {"backends": []}}}, "pools.a.backends: expected a non-empty list of backends"),
        (
            {"pools": {"a": {"backends": [{"url": "ftp://x", "capacity_tokens": 5}]}}},
            "pools.a.backends[0].url: expected an http(s) URL",
        ),
        (
            {"pools": {"a": {"backends": [{"url": "http://x"}]}}},
            "pools.a.backends[0].capacity_tokens: required",
        ),
        (
            {
                "pools": {
                    "a": {"backends": [{"url": "http://x", "capacity_tokens": 1, "timeouts": {"read_s": 0}}]}
                }
            },
            "pools.a.backends[0].timeouts.read_s: expected a positive number, got 0",
        ),
        (
            {"tiers": {"a": {"rank": 0, "ceiling": 1.5}}},
            "tiers.a.ceiling: expected a number in (0, 1], got 1.5",
        ),
        ({"tiers": {"a": {"rank": 0}, "b": {"rank": 0}}}, "tiers.b.rank: 0 is already the rank of tier 'a'"),
        ({"classes": [{"name": "x", "pool": "nope"}]}, "classes[0].pool: unknown pool 'nope'"),
        (
            {"classes": [{"name": "x", "pool": "short", "when": {"min_cost": "x"}}]},
            "classes[0].when.min_cost",
        ),
        ({"store": {"kind": "etcd"}}, "store.kind: expected one of 'memory', 'redis', got 'etcd'"),
        ({"store": {"kind": "memory", "url": "x"}}, "store.url: unknown key"),
        (
            {"pricing": {"per_mesage_tokens": 3}},
            "pricing.per_mesage_tokens: unknown key (did you mean 'per_message_tokens'?)",
        ),
        ({"pricing": {"encode_idle": "yes"}}, "pricing.encode_idle: expected true or false"),
        (
            {"tenants": {"a": {"keys": ["k"]}, "b": {"keys": ["k"]}}},
            "tenants.b.keys[0]: the same key is already a key of tenant 'a'",
        ),
        (
            {"tenants": {"a": {"keys": ["sha256:abc"]}}},
            "tenants.a.keys[0]: expected sha256: followed by 64 lowercase hex digits",
        ),
        (
            {"tenants": {"a": {"default_max_tokens": 10, "max_max_tokens": 5}}},
            "tenants.a.default_max_tokens: 10 is larger than max_max_tokens (5)",
        ),
        ({"embedded_backend": {"chunked": True}}, "embedded_backend.chunked: unknown key"),
        (
            {"fairness": {"tenant_queue_order": "shortest"}},
            "fairness.tenant_queue_order: expected one of 'fifo', 'shortest_first', got 'shortest'",
        ),
        ({"fairness": {"max_defer_s": -1}}, "fairness.max_defer_s: expected a non-negative number, got -1"),
        ({"fairness": {"defer_s_per_token": "fast"}}, "fairness.defer_s_per_token: expected a number"),
        ([1, 2], "config: expected a mapping, got a list"),
        ({"gc": {"threshold0": 0}}, "gc.threshold0: expected a positive integer, got 0"),
        ({"gc": {"threshold": 5}}, "gc.threshold: unknown key (did you mean"),
        ({"models": {"m*": {"tokenizer": "hf:/nonexistent/tokenizer.json"}}}, "models.m*.tokenizer:"),
        ({"models": {"m*": {"tokenizer": "tiktoken:no_such_encoding"}}}, "models.m*.tokenizer:"),
        ({"models": {"m*": {"images": {"tokens": -1}}}}, "models.m*.images.tokens: expected a non-negative"),
        (
            {"models": {"m*": {"images": {"patch": 14}}}},
            "models.m*.images.patch: unknown key; known keys here: tokens, patch_pixels",
        ),
        (
            {"models": {"m*": {"images": {"tokens": 576, "max_pixels": 10**6}}}},
            "models.m*.images: 'tokens' prices every image the same; drop max_pixels",
        ),
        (
            {"models": {"m*": {"images": {"min_pixels": 5000, "max_pixels": 4000}}}},
            "models.m*.images.max_pixels: 4000 is less than min_pixels (5000)",
        ),
        ({"models": {"m*": {"images": 16384}}}, "models.m*.images: expected a mapping"),
        ({"models": {"m*": {"vocab_size": 0}}}, "models.m*.vocab_size: expected a positive integer, got 0"),
        (
            {"models": {"m*": {"vocab_size": "152k"}}},
            "models.m*.vocab_size: expected a positive integer, got '152k'",
        ),
        ({"pricing": {"max_stop_token_ids": -1}}, "pricing.max_stop_token_ids: expected a non-negative"),
        ({"limits": {"refused_fields": [1]}}, "limits.refused_fields[0]: expected a non-empty string, got 1"),
        ({"limits": {"refused_fields": {"a": 1}}}, "limits.refused_fields: expected a list of strings"),
        (
            {
                "pools": {
                    "p": {
                        "backends": [{"url": "http://a", "capacity_tokens": 1, "tenant_header": "x tenant"}]
                    }
                }
            },
            "pools.p.backends[0].tenant_header: 'x tenant' is not a header name",
        ),
        (
            {
                "pools": {
                    "p": {
                        "backends": [
                            {"url": "http://a", "capacity_tokens": 1, "tenant_header": "Authorization"}
                        ]
                    }
                }
            },
            "tenant_header: Authorization is a header the gateway sets itself",
        ),
        (
            {"passthrough": {"routes": [{"method": "GET", "path": "/v1/models/*"}]}},
            "passthrough.routes[0].path: the gateway answers GET /v1/models/{id} itself",
        ),
        (
            {"limits": {"private_headers": ["x smg"]}},
            "limits.private_headers[0]: 'x smg' is not a header name",
        ),
        (
            {"limits": {"private_headers": ["x-*-id"]}},
            "limits.private_headers[0]: 'x-*-id' is not a header name",
        ),
        ({"limits": {"private_headers": [""]}}, "limits.private_headers[0]: expected a non-empty string"),
        (
            {"pricing": {"media_urls": {"schemes": ["ht tp"]}}},
            "pricing.media_urls.schemes[0]: 'ht tp' is not",
        ),
        ({"pricing": {"media_urls": {"hosts": ["a/b"]}}}, "pricing.media_urls.hosts[0]: 'a/b' is not a host"),
        ({"pricing": {"media_urls": {"hosts": ["[::1]"]}}}, "pricing.media_urls.hosts[0]: '[::1]' is not"),
        (
            {"pricing": {"media_urls": {"hosts": ["a.example"], "private_hosts": True}}},
            "pricing.media_urls: set hosts or private_hosts, not both",
        ),
        ({"pricing": {"media_urls": {"private": True}}}, "pricing.media_urls.private: unknown key"),
        (
            {"pricing": {"media_urls": {"private_hosts": "yes"}}},
            "pricing.media_urls.private_hosts: expected true",
        ),
        ({"pricing": {"media_urls": ["data"]}}, "pricing.media_urls: expected a mapping"),
        ({"pricing": {"media_urls": {"fetch": "yes"}}}, "pricing.media_urls.fetch: expected true or false"),
        ({"pricing": {"media_urls": {"fetch_max_bytes": 0}}}, "pricing.media_urls.fetch_max_bytes: expected"),
        (
            {"pricing": {"media_urls": {"fetch_timeout_s": -1}}},
            "pricing.media_urls.fetch_timeout_s: expected",
        ),
        (
            {"pricing": {"media_urls": {"fetch_per_tenant": 0}}},
            "pricing.media_urls.fetch_per_tenant: expected",
        ),
        ({"limits": {"max_connections_per_tenant": -1}}, "limits.max_connections_per_tenant: expected"),
    ],
)
def test_errors_name_the_field(data: object, message: str) -> None:
    with pytest.raises(ConfigError) as err:
        parse_config(data)
    assert message in str(err.value)


def test_the_order_inside_a_tenants_queue_is_fifo_by_default_and_reaches_the_budget_layout() -> None:
    from gateway.config.layout import build_layout

    default = parse_config({})
    assert default.fairness.tenant_queue_order == "fifo"
    assert (default.fairness.max_defer_s, default.fairness.defer_s_per_token) == (10.0, 0.01)
    cfg = parse_config(
        {"fairness": {"tenant_queue_order": "shortest_first", "max_defer_s": 4, "defer_s_per_token": 0.002}}
    )
    policy = build_layout(cfg, (), cfg.tenants).policy
    assert (policy.tenant_queue_order, policy.max_defer_s, policy.defer_s_per_token) == (
        "shortest_first",
        4,
        0.002,
    )
    assert build_layout(default, (), default.tenants).policy.tenant_queue_order == "fifo"


def test_bad_yaml_and_missing_file(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("tenants: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(tmp_path / "missing.yaml")
    empty = tmp_path / "empty.yaml"
    empty.write_text("")
    assert load_config(empty) == GatewayConfig()


def test_workers_with_memory_store_refused() -> None:
    cfg = parse_config({})
    check_workers(cfg, 1)
    with pytest.raises(ConfigError) as err:
        check_workers(cfg, 4)
    assert str(err.value) == (
        "--workers 4 with store.kind=memory would give every tenant 4x its budget; use store.kind=redis"
    )


def test_tenant_without_tier_gets_standard_or_lowest() -> None:
    assert parse_config({"tenants": {"a": {}}}).tenants[0].tier == "standard"
    cfg = parse_config({"tiers": {"gold": {"rank": 0}, "bronze": {"rank": 5}}, "tenants": {"a": {}}})
    assert cfg.tenants[0].tier == "bronze"


def test_without_pools_classes_name_the_embedded_pools() -> None:
    cfg = parse_config({"classes": [{"name": "big", "when": {"min_cost": 9000}, "pool": "long"}]})
    assert cfg.embedded_backend.pool_names == ("short", "long") and cfg.classes[0].pool == "long"
    with pytest.raises(ConfigError, match="unknown pool 'default'; configured pools: long, short"):
        parse_config({"classes": [{"name": "x", "pool": "default"}]})
    one = parse_config({"embedded_backend": {"split": False}, "classes": [{"name": "x", "pool": "default"}]})
    assert one.embedded_backend.pool_names == ("default",)


def test_gc_section_defaults_and_overrides() -> None:
    assert parse_config({}).gc == GcConfig(threshold0=10_000, threshold1=10, threshold2=100)
    assert parse_config({"gc": {"threshold0": 700, "threshold2": 10}}).gc == GcConfig(700, 10, 10)


def test_the_encode_threads_can_stay_at_normal_scheduling() -> None:
    cfg = parse_config({"pricing": {"encode_idle": False, "encode_nice": 0}})
    assert not cfg.pricing.settings.encode_idle and cfg.pricing.settings.encode_nice == 0


def test_logging_section() -> None:
    assert parse_config({}).logging.trust_request_id is False
    assert parse_config({"logging": {"trust_request_id": True}}).logging.trust_request_id is True
    with pytest.raises(ConfigError, match=r"logging\.format: unknown key"):
        parse_config({"logging": {"format": "text"}})


def test_environment_variables_fill_the_file_and_a_missing_one_names_the_field(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "tokengate.yaml"
    path.write_text(
        "listen:\n  port: ${TG_PORT}\n"
        "store: {kind: redis, url: '${TG_REDIS}', fail_mode: '${TG_FAIL:-open}'}\n"
        "pools: {p: {backends: [{url: 'http://${TG_HOST}:8000', capacity_tokens: 1000, api_key: '$${literal}'}]}}\n"
    )
    monkeypatch.setenv("TG_PORT", "9000")
    monkeypatch.setenv("TG_REDIS", "redis://r:6379/0")
    monkeypatch.setenv("TG_HOST", "vllm-0")
    cfg = load_config(path)
    assert cfg.listen.port == 9000  # a whole reference takes the variable's YAML meaning
    assert cfg.store.redis is not None and cfg.store.redis.url == "redis://r:6379/0"
    assert cfg.store.redis.fail_mode == "open"  # the default after :-
    assert cfg.pools[0].backends[0].url == "http://vllm-0:8000"
    assert cfg.pools[0].backends[0].api_key == "${literal}"
    monkeypatch.delenv("TG_HOST")
    with pytest.raises(
        ConfigError, match=r"pools\.p\.backends\[0\]\.url: the environment variable TG_HOST is not set"
    ):
        load_config(path)


def test_refused_fields_default_to_the_engine_internal_ones_and_an_empty_list_refuses_none() -> None:
    from gateway.config.schema import ENGINE_INTERNAL_FIELDS

    assert parse_config({}).limits.refused_fields == ENGINE_INTERNAL_FIELDS
    assert "kv_transfer_params" in ENGINE_INTERNAL_FIELDS
    assert parse_config({"limits": {"refused_fields": []}}).limits.refused_fields == ()
    assert parse_config({"limits": {"refused_fields": "vllm_xargs"}}).limits.refused_fields == ("vllm_xargs",)


def test_the_annotated_reference_file_loads_and_names_every_section() -> None:
    """examples/reference.yaml is the documented list of every key: it must stay valid and whole."""
    from gateway.config.loader import _TOP_KEYS, load_raw

    raw = load_raw(str(Path(__file__).parents[2] / "examples" / "reference.yaml"))
    parse_config(raw)
    assert sorted(set(_TOP_KEYS) - set(raw)) == []


def test_extproc_section_defaults_and_errors_name_the_field() -> None:
    ext = parse_config({}).extproc
    assert (ext.enabled, ext.host, ext.port, ext.pool_header) == (
        False,
        "127.0.0.1",
        9002,
        "x-tokengate-pool",
    )
    ext = parse_config(
        {"extproc": {"enabled": True, "port": 9100, "fairness_header": "X-Gateway-Fair"}}
    ).extproc
    assert (ext.enabled, ext.port, ext.fairness_header) == (True, 9100, "x-gateway-fair")
    with pytest.raises(ConfigError, match=r"extproc\.pool_header: 'x pool' is not a header name"):
        parse_config({"extproc": {"pool_header": "x pool"}})
    with pytest.raises(
        ConfigError, match=r"extproc\.extend_after_s: 5 must be below extproc\.max_message_timeout_s"
    ):
        parse_config({"extproc": {"extend_after_s": 5, "max_message_timeout_s": 2}})
    with pytest.raises(ConfigError, match=r"extproc\.port"):
        parse_config({"extproc": {"port": 70000}})
    with pytest.raises(ConfigError, match=r"extproc\.listen: unknown key"):
        parse_config({"extproc": {"listen": 1}})


def test_extprocs_message_limit_lets_every_body_the_gateway_refuses_reach_it() -> None:
    """Envoy sends the body whole in one gRPC message: past the processor's limit the stream fails
    and Envoy answers 500 itself, where the gateway would have said 413."""
    assert parse_config({}).extproc.message_limit(4 << 20) == 34 << 20  # Envoy's 32 MiB buffer, and headers
    big = parse_config({"limits": {"max_body_bytes": 64 << 20}})
    assert big.extproc.message_limit(big.limits.max_body_bytes) == 65 << 20
    given = parse_config({"extproc": {"max_message_bytes": 40 << 20}}).extproc
    assert given.message_limit(4 << 20) == 40 << 20
    with pytest.raises(
        ConfigError,
        match=r"extproc\.max_message_bytes: 4718592 must exceed limits\.max_body_bytes \(4194304\)",
    ):
        parse_config({"extproc": {"max_message_bytes": 4608 << 10}})


def test_the_shipped_envoy_configs_processor_config_loads() -> None:
    config = load_config(str(Path(__file__).resolve().parents[2] / "deploy" / "envoy" / "tokengate.yaml"))
    assert [p.name for p in config.pools] == ["chat", "batch"]
    assert config.extproc.max_message_timeout_s == 60

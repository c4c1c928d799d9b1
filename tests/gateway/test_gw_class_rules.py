"""The ``classes:`` section: read into typed rules once at load, errors name the field."""

from __future__ import annotations

from typing import Any

import pytest

from gateway.config.class_rules import parse_classes
from gateway.config.fields import ConfigError

POOLS = {"p", "long", "short"}


def rule(**when: Any) -> dict[str, Any]:
    return {"name": "hit", "pool": "p", "when": when}


def test_a_rule_is_read_into_its_typed_form_and_back() -> None:
    item = {"name": "r", "pool": "long", "overflow_pool": "short", "budget_tokens": 9,
            "when": {"max_decode_tokens": 5, "tenants": ["a"], "effort": "high"}}  # fmt: skip
    [r] = parse_classes([item], POOLS)
    assert (r.max_decode_tokens, r.tenants, dict(r.fields)) == (5, ("a",), {"effort": ("high",)})
    assert r.to_config() == item
    assert parse_classes(None, POOLS) == ()
    [s] = parse_classes(
        [structured := {"name": "s", "pool": "p", "when": {"has_field": ["guided_json", "a"]}}], POOLS
    )
    assert s.has_field == ("guided_json", "a") and not s.fields and s.to_config() == structured


@pytest.mark.parametrize(
    ("item", "message"),
    [
        (rule(min_cost="x"), "classes[0].when.min_cost: expected a non-negative integer, got 'x'"),
        (
            rule(max_prompt_tokens=-1),
            "classes[0].when.max_prompt_tokens: expected a non-negative integer, got -1",
        ),
        (
            rule(min_decode_tokens=True),
            "classes[0].when.min_decode_tokens: expected a non-negative integer, got true",
        ),
        (rule(min_cost=10, max_cost=5), "classes[0].when: min_cost (10) is greater than max_cost (5)"),
        (rule(models=[1]), "classes[0].when.models: expected a name/glob"),
        (rule(tenants={"a": 1}), "classes[0].when.tenants: expected a name/glob"),
        (rule(has_field=[]), "classes[0].when.has_field: expected a body field name or a non-empty list"),
        (rule(has_field=[1]), "classes[0].when.has_field: expected a body field name or a non-empty list"),
        (rule(reasoning_effort=[]), "classes[0].when.reasoning_effort: expected a value or a non-empty list"),
        (rule(metadata={"a": 1}), "classes[0].when.metadata: expected strings, numbers, booleans or null"),
        ({"name": "a", "pool": "p", "when": [1]}, "classes[0].when: expected a mapping"),
        ({"pool": "p"}, "classes[0].name: required, expected a string"),
        ({"name": "a"}, "classes[0].pool: required, expected a string"),
        (
            {"name": "a", "pool": "p", "overflow_pool": 3},
            "classes[0].overflow_pool: expected a non-empty string",
        ),
        (
            {"name": "a", "pool": "p", "budget_tokens": 1.5},
            "classes[0].budget_tokens: expected a non-negative integer",
        ),
        ({"name": "a", "pool": "p", "min_cost": 5}, "classes[0].min_cost: unknown key"),
        ({"name": "a", "pool": "nope"}, "classes[0].pool: unknown pool 'nope'"),
        ("short", "classes[0]: expected a mapping"),
    ],
)
def test_errors_name_the_field(item: Any, message: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_classes([item], POOLS)
    assert str(info.value).startswith(message)


def test_the_section_must_be_a_list_of_uniquely_named_rules() -> None:
    with pytest.raises(ConfigError, match="classes: expected a list"):
        parse_classes({"name": "a"}, POOLS)
    with pytest.raises(ConfigError, match="'a' is defined twice"):
        parse_classes([{"name": "a", "pool": "p"}, {"name": "a", "pool": "long"}], POOLS)

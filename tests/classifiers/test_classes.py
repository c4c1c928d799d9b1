from __future__ import annotations

from typing import Any

import pytest

from classifiers import Classifier, ClassRule, Cost, RequestClass, parse_rules


def classify(rules: list[dict[str, Any]], cost: Cost = Cost(100, 100), **kw: Any) -> str:
    classifier = Classifier(parse_rules(rules), default_pool="shared")
    args: dict[str, Any] = {"model": "llama-3-8b", "tenant": "acme", "body": {}}
    args.update(kw)
    return classifier.classify(cost=cost, **args).name


def rule(**when: Any) -> dict[str, Any]:
    return {"name": "hit", "pool": "p", "when": when}


def test_rule_without_conditions_matches_everything() -> None:
    assert classify([{"name": "all", "pool": "p"}]) == "all"


def test_default_class_when_nothing_matches() -> None:
    classifier = Classifier(parse_rules([rule(min_cost=10**6)]), default_pool="shared")
    result = classifier.classify(cost=Cost(1, 1), model="m", tenant="t", body={})
    assert result == RequestClass(name="default", pool="shared", overflow_pool=None, budget_tokens=None)


@pytest.mark.parametrize(
    ("when", "cost", "expected"),
    [
        ({"min_prompt_tokens": 8000}, Cost(8000, 0), "hit"),
        ({"min_prompt_tokens": 8000}, Cost(7999, 5000), "default"),
        ({"max_prompt_tokens": 100}, Cost(100, 0), "hit"),
        ({"max_prompt_tokens": 100}, Cost(101, 0), "default"),
        ({"min_decode_tokens": 50}, Cost(0, 50), "hit"),
        ({"min_decode_tokens": 50}, Cost(1000, 49), "default"),
        ({"max_decode_tokens": 50}, Cost(0, 51), "default"),
        ({"min_cost": 16000}, Cost(8000, 8000), "hit"),
        ({"min_cost": 16000}, Cost(8000, 7999), "default"),
        ({"max_cost": 10}, Cost(5, 5), "hit"),
        ({"max_cost": 10}, Cost(5, 6), "default"),
    ],
)
def test_token_conditions(when: dict[str, Any], cost: Cost, expected: str) -> None:
    assert classify([rule(**when)], cost) == expected


def test_model_and_tenant_globs() -> None:
    rules = [rule(models=["gpt-4o*", "o1"], tenants="team-*")]
    assert classify(rules, model="gpt-4o-mini", tenant="team-a") == "hit"
    assert classify(rules, model="o1", tenant="team-b") == "hit"
    assert classify(rules, model="o1-mini", tenant="team-a") == "default"
    assert classify(rules, model="gpt-4o", tenant="acme") == "default"
    assert classify(rules, model="GPT-4O", tenant="team-a") == "default"  # case-sensitive


def test_body_fields() -> None:
    rules = [rule(reasoning_effort=["high", "medium"])]
    assert classify(rules, body={"reasoning_effort": "high"}) == "hit"
    assert classify(rules, body={"reasoning_effort": "low"}) == "default"
    assert classify(rules, body={}) == "default"
    assert classify([rule(n=1)], body={"n": True}) == "default"  # a boolean is not the number 1
    assert classify([rule(stream=True)], body={"stream": True}) == "hit"
    assert classify([rule(user=None)], body={}) == "hit"  # null matches an absent field


def test_all_conditions_must_hold() -> None:
    rules = [rule(min_prompt_tokens=10, models=["x*"], reasoning_effort="high")]
    body = {"reasoning_effort": "high"}
    assert classify(rules, Cost(10, 0), model="x1", body=body) == "hit"
    assert classify(rules, Cost(9, 0), model="x1", body=body) == "default"
    assert classify(rules, Cost(10, 0), model="y1", body=body) == "default"
    assert classify(rules, Cost(10, 0), model="x1", body={}) == "default"


def test_first_match_wins_and_carries_its_routing() -> None:
    rules = parse_rules(
        [
            {
                "name": "reasoning",
                "when": {"min_prompt_tokens": 8000, "reasoning_effort": ["high"]},
                "pool": "long",
                "overflow_pool": "short",
                "budget_tokens": 100000,
            },
            {"name": "long", "when": {"min_cost": 16000}, "pool": "long"},
            {"name": "short", "pool": "short"},
        ]
    )
    classifier = Classifier(rules, default_pool="short")
    big = Cost(9000, 9000)
    got = classifier.classify(cost=big, model="m", tenant="t", body={"reasoning_effort": "high"})
    assert got == RequestClass("reasoning", "long", "short", 100000)
    assert classifier.classify(cost=big, model="m", tenant="t", body={}).name == "long"
    assert classifier.classify(cost=Cost(10, 10), model="m", tenant="t", body={}).name == "short"


def test_duplicate_class_names_are_rejected() -> None:
    with pytest.raises(ValueError, match="'a' is defined twice"):
        Classifier(parse_rules([{"name": "a", "pool": "p"}, {"name": "a", "pool": "q"}]), default_pool="p")


def test_from_dict_builds_the_rule() -> None:
    r = ClassRule.from_dict(
        {"name": "r", "pool": "long", "when": {"max_decode_tokens": 5, "tenants": ["a"], "effort": "high"}},
        "x",
    )
    assert (r.max_decode_tokens, r.tenants, dict(r.fields)) == (5, ("a",), {"effort": ("high",)})


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
            "classes[0].when.min_decode_tokens: expected a non-negative integer, got True",
        ),
        (rule(min_cost=10, max_cost=5), "classes[0].when: min_cost (10) is greater than max_cost (5)"),
        (rule(models=[1]), "classes[0].when.models: expected a name/glob"),
        (rule(tenants={"a": 1}), "classes[0].when.tenants: expected a name/glob"),
        (rule(reasoning_effort=[]), "classes[0].when.reasoning_effort: expected a value or a non-empty list"),
        (rule(metadata={"a": 1}), "classes[0].when.metadata: expected strings, numbers, booleans or null"),
        ({"name": "a", "pool": "p", "when": [1]}, "classes[0].when: expected a mapping"),
        ({"pool": "p"}, "classes[0].name: expected a non-empty string, got None"),
        ({"name": "a"}, "classes[0].pool: expected a non-empty string, got None"),
        (
            {"name": "a", "pool": "p", "overflow_pool": 3},
            "classes[0].overflow_pool: expected a non-empty string",
        ),
        (
            {"name": "a", "pool": "p", "budget_tokens": 1.5},
            "classes[0].budget_tokens: expected a non-negative integer",
        ),
        ({"name": "a", "pool": "p", "min_cost": 5}, "classes[0]: unknown key(s) min_cost"),
        ("short", "classes[0]: expected a mapping"),
    ],
)
def test_from_dict_errors_name_the_field(item: Any, message: str) -> None:
    with pytest.raises(ValueError) as info:
        parse_rules([item])
    assert str(info.value).startswith(message)


def test_parse_rules_shapes() -> None:
    assert parse_rules(None) == []
    with pytest.raises(ValueError, match="classes: expected a list"):
        parse_rules({"name": "a"})

from __future__ import annotations

from typing import Any

import pytest

from classifiers import Classifier, Cost, RequestClass
from gateway.config.class_rules import parse_classes


def classify(rules: list[dict[str, Any]], cost: Cost = Cost(100, 100), **kw: Any) -> str:
    classifier = Classifier(
        parse_classes(rules, {"p", "shared", "long", "short", "q"}), default_pool="shared"
    )
    args: dict[str, Any] = {"model": "llama-3-8b", "tenant": "acme", "body": {}}
    args.update(kw)
    return classifier.classify(cost=cost, **args).name


def rule(**when: Any) -> dict[str, Any]:
    return {"name": "hit", "pool": "p", "when": when}


def test_rule_without_conditions_matches_everything() -> None:
    assert classify([{"name": "all", "pool": "p"}]) == "all"


def test_default_class_when_nothing_matches() -> None:
    unrouted = Classifier(parse_classes([rule(min_cost=10**6)], {"p"}))
    assert unrouted.classify(cost=Cost(1, 1), model="m", tenant="t", body={}).pool is None  # the model's pool
    classifier = Classifier(parse_classes([rule(min_cost=10**6)], {"p"}), default_pool="shared")
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


def test_a_field_present_not_null_matches_has_field() -> None:
    # Say the structured-output fields, to give such requests a pool of their own.
    rules = [rule(has_field=["guided_json", "guided_regex", "response_format"])]
    assert classify(rules, body={"guided_regex": "a+"}) == "hit"
    assert classify(rules, body={"response_format": {"type": "json_object"}, "guided_json": None}) == "hit"
    assert classify(rules, body={"guided_json": None}) == "default"  # null: not asked for
    assert classify(rules, body={"messages": []}) == "default"
    assert classify([rule(has_field="tools")], body={"tools": []}) == "hit"  # a single name


def test_all_conditions_must_hold() -> None:
    rules = [rule(min_prompt_tokens=10, models=["x*"], reasoning_effort="high")]
    body = {"reasoning_effort": "high"}
    assert classify(rules, Cost(10, 0), model="x1", body=body) == "hit"
    assert classify(rules, Cost(9, 0), model="x1", body=body) == "default"
    assert classify(rules, Cost(10, 0), model="y1", body=body) == "default"
    assert classify(rules, Cost(10, 0), model="x1", body={}) == "default"


def test_first_match_wins_and_carries_its_routing() -> None:
    rules = parse_classes(
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
        ],
        {"long", "short"},
    )
    classifier = Classifier(rules, default_pool="short")
    big = Cost(9000, 9000)
    got = classifier.classify(cost=big, model="m", tenant="t", body={"reasoning_effort": "high"})
    assert got == RequestClass("reasoning", "long", "short", 100000)
    assert classifier.classify(cost=big, model="m", tenant="t", body={}).name == "long"
    assert classifier.classify(cost=Cost(10, 10), model="m", tenant="t", body={}).name == "short"


def test_duplicate_class_names_are_rejected() -> None:
    with pytest.raises(ValueError, match="'a' is defined twice"):
        Classifier([*parse_classes([{"name": "a", "pool": "p"}], {"p"})] * 2, default_pool="p")

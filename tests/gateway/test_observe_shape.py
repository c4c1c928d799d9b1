"""Shape ratio, split advice levels and the proposed config edit."""

from __future__ import annotations

import random

import yaml

from gateway.observe.settings import ShapeSettings
from gateway.observe.shape import ShapeTracker, best_cut, split_plan

RULES = [
    {"name": "reasoning", "when": {"min_prompt_tokens": 8000}, "pool": "main"},
    {"name": "chat", "pool": "main"},
]
POOLS = {
    "main": {
        "backends": [
            {"url": "http://a:8000", "capacity_tokens": 200000},
            {"url": "http://b:8000", "capacity_tokens": 200000},
            {"url": "http://c:8000", "capacity_tokens": 200000},
            {"url": "http://d:8000", "capacity_tokens": 200000},
        ]
    },
    "other": {"backends": [{"url": "http://o:8000", "capacity_tokens": 50000}]},
}


def _mixed(n_short: int, n_long: int, seed: int = 3) -> list[tuple[int, str]]:
    rng = random.Random(seed)
    out = [(rng.randint(300, 900), "chat") for _ in range(n_short)]
    out += [(rng.randint(28_000, 32_000), "reasoning") for _ in range(n_long)]
    rng.shuffle(out)
    return out


def test_advice_levels_and_thresholds() -> None:
    s = ShapeSettings(window_requests=100, split_at=10, two_services_at=50, min_requests=10)
    t = ShapeTracker(s)
    for _ in range(60):
        t.record("p", "c", 1000)
    r = t.reading("p")
    assert (r.ratio, r.advice, r.advice_words) == (1.0, 0, "fine")
    t.record("p", "c", 20_000)
    assert t.reading("p").advice == 1
    t.record("p", "c", 60_000)
    r = t.reading("p")
    assert r.ratio == 60.0 and r.advice == 2 and r.advice_words == "two services in one pool"
    # the window slides: after 100 more small requests the big ones are gone
    for _ in range(100):
        t.record("p", "c", 1000)
    assert t.reading("p").advice == 0 and t.reading("p").requests == 100


def test_too_few_requests_never_advise() -> None:
    t = ShapeTracker(ShapeSettings(min_requests=50))
    t.record("p", "a", 10)
    t.record("p", "a", 10)
    t.record("p", "b", 100_000)
    r = t.reading("p")
    assert r.ratio is not None and r.ratio > 50 and r.advice == 0
    assert t.reading("nothing").ratio is None


def test_best_cut_separates_two_groups() -> None:
    cut = best_cut([c for c, _ in _mixed(200, 20)])
    assert cut is not None and 900 < cut <= 28_000
    assert best_cut([5, 5, 5]) is None


def test_split_moves_whole_classes_when_they_explain_the_cut() -> None:
    plan = split_plan("main", _mixed(200, 20), RULES, POOLS)
    assert plan is not None
    assert plan.moved_classes == ["reasoning"] and plan.new_pool == "main-long"
    assert 0.05 < plan.share_requests < 0.15 and plan.share_tokens > 0.5
    doc = yaml.safe_load(plan.to_yaml())
    rules = {r["name"]: r for r in doc["classes"]}
    assert rules["reasoning"]["pool"] == "main-long" and rules["chat"]["pool"] == "main"
    assert rules["reasoning"]["when"] == {"min_prompt_tokens": 8000}  # rule untouched but its pool
    assert set(doc["pools"]) == {"main", "main-long", "other"}
    urls = [b["url"] for p in ("main", "main-long") for b in doc["pools"][p]["backends"]]
    assert sorted(urls) == ["http://a:8000", "http://b:8000", "http://c:8000", "http://d:8000"]
    assert doc["pools"]["main-long"]["backends"] and doc["pools"]["main"]["backends"]
    assert doc["pools"]["other"] == POOLS["other"]


def test_split_by_cost_when_one_class_is_mixed() -> None:
    samples = [(c, "chat") for c, _ in _mixed(200, 20)]
    plan = split_plan("main", samples, [{"name": "chat", "pool": "main"}], {"main": POOLS["main"]})
    assert plan is not None and plan.moved_classes == []
    doc = yaml.safe_load(plan.to_yaml())
    first, second = doc["classes"]
    assert first == {"name": "chat-long", "pool": "main-long", "when": {"min_cost": plan.cut_cost}}
    assert second == {"name": "chat", "pool": "main"}  # first match wins: the long rule goes first


def test_split_single_backend_pool_asks_for_a_backend() -> None:
    pools = {"main": {"backends": [{"url": "http://a:8000", "capacity_tokens": 100000}]}}
    plan = split_plan("main", _mixed(100, 10), RULES, pools)
    assert plan is not None and plan.notes and "CHANGE-ME" in plan.to_yaml()
    doc = yaml.safe_load(plan.to_yaml())
    assert doc["pools"]["main"]["backends"] == pools["main"]["backends"]
    assert doc["pools"]["main-long"]["backends"][0]["capacity_tokens"] == 100000


def test_split_nothing_to_split() -> None:
    assert split_plan("main", [(100, "chat")] * 10, RULES, POOLS) is None


def test_split_without_any_class_rules_routes_the_long_requests_to_the_new_pool() -> None:
    samples = [(c, "default") for c, _ in _mixed(200, 20)]
    plan = split_plan("main", samples, [], {"main": POOLS["main"]})
    assert plan is not None and plan.moved_classes == []
    doc = yaml.safe_load(plan.to_yaml())
    assert doc["classes"] == [{"name": "long", "when": {"min_cost": plan.cut_cost}, "pool": "main-long"}]


def test_split_rule_goes_before_a_rule_that_sends_requests_to_their_models_pool() -> None:
    samples = [(c, "default") for c, _ in _mixed(200, 20)]
    pools = {"main": POOLS["main"], "other": POOLS["other"]}
    rules = [{"name": "to-other", "when": {"tenants": ["x"]}, "pool": "other"}, {"name": "any"}]
    plan = split_plan("main", samples, rules, pools)
    assert plan is not None
    names = [r["name"] for r in yaml.safe_load(plan.to_yaml())["classes"]]
    assert names == ["to-other", "long", "any"]

"""The ``classes:`` config section, read into ``classifiers.ClassRule`` objects once, at load.

YAML shape of one rule (every ``when`` key is optional; unknown ``when`` keys are body fields)::

    {name: reasoning, pool: long, overflow_pool: short, budget_tokens: 100000,
     when: {min_prompt_tokens: 8000, models: ["o*"], tenants: [acme], reasoning_effort: [high]}}
    {name: structured, pool: grammar, when: {has_field: [guided_json, guided_regex, response_format]}}

Errors name the field (``classes[1].when.min_cost: expected a non-negative integer, got -5``); pools
must exist, and class names are unique.
"""

from __future__ import annotations

from collections.abc import Sequence
from types import MappingProxyType
from typing import Any

from classifiers import BOUNDS, SCALAR, ClassRule
from gateway.config.fields import (
    ConfigError,
    did_you_mean,
    mapping,
    opt_integer,
    opt_string,
    section,
    show,
    string,
)

_RULE_KEYS = (
    "name",
    "pool",
    "overflow_pool",
    "budget_tokens",
    "when",
    "reservation",
)  # reservation: config_loader
_ORDERED = (
    ("min_prompt_tokens", "max_prompt_tokens"),
    ("min_decode_tokens", "max_decode_tokens"),
    ("min_cost", "max_cost"),
)


def parse_classes(v: Any, pool_names: set[str]) -> tuple[ClassRule, ...]:
    if v is None:
        return ()
    if not isinstance(v, list):
        raise ConfigError(f"classes: expected a list of rules, got {show(v)}")
    # The caller passes the embedded backends' pools when none are configured.
    known = pool_names or {"default"}
    names: set[str] = set()
    out = []
    for i, item in enumerate(v):
        rule = _rule(item, f"classes[{i}]", known)
        if rule.name in names:
            raise ConfigError(f"classes[{i}].name: class {rule.name!r} is defined twice")
        names.add(rule.name)
        out.append(rule)
    return tuple(out)


def _rule(v: Any, where: str, known_pools: set[str]) -> ClassRule:
    m = section(v, where, _RULE_KEYS)
    name = string(m, "name", where, None)
    pool = string(m, "pool", where, None)
    overflow = opt_string(m, "overflow_pool", where)
    for key, ref in (("pool", pool), ("overflow_pool", overflow)):
        if ref is not None and ref not in known_pools:
            raise ConfigError(
                f"{where}.{key}: unknown pool {ref!r}{did_you_mean(ref, known_pools)}; "
                f"configured pools: {', '.join(sorted(known_pools))}"
            )
    w = f"{where}.when"
    when = mapping(m["when"], w) if m.get("when") is not None else {}
    bounds = {key: opt_integer(when, key, w, minimum=0) for key in BOUNDS}
    for low, high in _ORDERED:
        lo, hi = bounds[low], bounds[high]
        if lo is not None and hi is not None and lo > hi:
            raise ConfigError(f"{w}: {low} ({lo}) is greater than {high} ({hi}); nothing could match")
    fields = {
        key: _values(value, f"{w}.{key}")
        for key, value in when.items()
        if key not in BOUNDS and key not in ("models", "tenants", "has_field")
    }
    return ClassRule(
        name=name,
        pool=pool,
        overflow_pool=overflow,
        budget_tokens=opt_integer(m, "budget_tokens", where, minimum=0),
        models=_globs(when.get("models"), f"{w}.models"),
        tenants=_globs(when.get("tenants"), f"{w}.tenants"),
        has_field=_names(when.get("has_field"), f"{w}.has_field"),
        fields=MappingProxyType(fields),
        **bounds,
    )


def _globs(value: object, where: str) -> tuple[str, ...]:
    if value is None:
        return ()
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, Sequence) or not all(isinstance(v, str) and v for v in items):
        raise ConfigError(f"{where}: expected a name/glob or a list of them, got {show(value)}")
    return tuple(items)


def _names(value: object, where: str) -> tuple[str, ...]:
    if value is None:
        return ()
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list) or not items or not all(isinstance(v, str) and v for v in items):
        raise ConfigError(
            f"{where}: expected a body field name or a non-empty list of them, got {show(value)}"
        )
    return tuple(items)


def _values(value: object, where: str) -> tuple[Any, ...]:
    items = list(value) if isinstance(value, list | tuple) else [value]
    if not items:
        raise ConfigError(f"{where}: expected a value or a non-empty list of values, got {show(value)}")
    for item in items:
        if not isinstance(item, SCALAR):
            raise ConfigError(f"{where}: expected strings, numbers, booleans or null, got {show(item)}")
    return tuple(items)

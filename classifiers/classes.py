"""Request classes: configured rules that map a priced request to a backend pool.

Rules are tried in order and the first whose conditions all hold wins; a rule without conditions
matches everything. When none matches, the request gets the class ``default`` on the default pool.

YAML shape of one rule (every ``when`` key is optional; unknown keys are body fields)::

    {name: reasoning, pool: long, overflow_pool: short, budget_tokens: 100000,
     when: {min_prompt_tokens: 8000, models: ["o*"], tenants: [acme], reasoning_effort: [high]}}

Token conditions compare against the request's `Cost`: ``*_prompt_tokens`` against prefill,
``*_decode_tokens`` against decode, ``*_cost`` against the total; bounds are inclusive. ``models``
and ``tenants`` are fnmatch globs (case-sensitive). A body field matches when its top-level value
equals one of the listed values (``null`` also matches an absent field; booleans never equal numbers).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from fnmatch import translate
from types import MappingProxyType
from typing import Any

from classifiers.pricing import Cost

__all__ = ["ClassRule", "Classifier", "RequestClass", "parse_rules"]

DEFAULT_CLASS = "default"

_BOUNDS = (
    "min_prompt_tokens",
    "max_prompt_tokens",
    "min_decode_tokens",
    "max_decode_tokens",
    "min_cost",
    "max_cost",
)
_RULE_KEYS = frozenset({"name", "pool", "overflow_pool", "budget_tokens", "when"})
_Scalar = str | int | float | bool | None


@dataclass(frozen=True, slots=True)
class RequestClass:
    name: str
    pool: str
    overflow_pool: str | None = None
    budget_tokens: int | None = None


@dataclass(frozen=True)
class ClassRule:
    name: str
    pool: str
    overflow_pool: str | None = None
    budget_tokens: int | None = None
    min_prompt_tokens: int | None = None
    max_prompt_tokens: int | None = None
    min_decode_tokens: int | None = None
    max_decode_tokens: int | None = None
    min_cost: int | None = None
    max_cost: int | None = None
    models: tuple[str, ...] = ()
    tenants: tuple[str, ...] = ()
    fields: Mapping[str, tuple[Any, ...]] = field(default_factory=lambda: MappingProxyType({}))

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], where: str) -> ClassRule:
        """Parse one YAML rule; ValueError messages name the offending field (``where.when.x``)."""
        if not isinstance(d, Mapping):
            raise ValueError(f"{where}: expected a mapping with 'name' and 'pool', got {d!r}")
        unknown = sorted(str(k) for k in d if k not in _RULE_KEYS)
        if unknown:
            raise ValueError(
                f"{where}: unknown key(s) {', '.join(unknown)}; a class rule has name, pool, overflow_pool, "
                "budget_tokens and when (conditions go under when)"
            )
        name = _name(d.get("name"), f"{where}.name", required=True)
        pool = _name(d.get("pool"), f"{where}.pool", required=True)
        overflow = _name(d.get("overflow_pool"), f"{where}.overflow_pool", required=False)
        budget = _non_negative(d.get("budget_tokens"), f"{where}.budget_tokens")
        when = d.get("when")
        if when is None:
            when = {}
        if not isinstance(when, Mapping):
            raise ValueError(f"{where}.when: expected a mapping of conditions, got {when!r}")
        bounds = {key: _non_negative(when.get(key), f"{where}.when.{key}") for key in _BOUNDS}
        for low, high in (
            ("min_prompt_tokens", "max_prompt_tokens"),
            ("min_decode_tokens", "max_decode_tokens"),
            ("min_cost", "max_cost"),
        ):
            lo, hi = bounds[low], bounds[high]
            if lo is not None and hi is not None and lo > hi:
                raise ValueError(
                    f"{where}.when: {low} ({lo}) is greater than {high} ({hi}); nothing could match"
                )
        models = _globs(when.get("models"), f"{where}.when.models")
        tenants = _globs(when.get("tenants"), f"{where}.when.tenants")
        fields: dict[str, tuple[Any, ...]] = {}
        for key, value in when.items():
            if key in _BOUNDS or key in ("models", "tenants"):
                continue
            if not isinstance(key, str) or not key:
                raise ValueError(f"{where}.when: field names must be non-empty strings, got {key!r}")
            fields[key] = _values(value, f"{where}.when.{key}")
        return cls(
            name=name,
            pool=pool,
            overflow_pool=overflow,
            budget_tokens=budget,
            models=models,
            tenants=tenants,
            fields=MappingProxyType(fields),
            **bounds,
        )

    def to_class(self) -> RequestClass:
        return RequestClass(self.name, self.pool, self.overflow_pool, self.budget_tokens)


def parse_rules(items: object, where: str = "classes") -> list[ClassRule]:
    """Parse the ``classes`` list of the config file."""
    if items is None:
        return []
    if not isinstance(items, Sequence) or isinstance(items, str | bytes):
        raise ValueError(f"{where}: expected a list of class rules, got {items!r}")
    return [ClassRule.from_dict(item, f"{where}[{i}]") for i, item in enumerate(items)]


def _name(value: object, where: str, *, required: bool) -> Any:
    if value is None and not required:
        return None
    if not isinstance(value, str) or not value:
        raise ValueError(f"{where}: expected a non-empty string, got {value!r}")
    return value


def _non_negative(value: object, where: str) -> int | None:
    if value is None:
        return None
    if type(value) is not int or value < 0:
        raise ValueError(f"{where}: expected a non-negative integer, got {value!r}")
    return value


def _globs(value: object, where: str) -> tuple[str, ...]:
    if value is None:
        return ()
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list | tuple) or not all(isinstance(v, str) and v for v in items):
        raise ValueError(f"{where}: expected a name/glob or a list of them, got {value!r}")
    return tuple(items)


def _values(value: object, where: str) -> tuple[Any, ...]:
    items = list(value) if isinstance(value, list | tuple) else [value]
    if not items:
        raise ValueError(f"{where}: expected a value or a non-empty list of values, got {value!r}")
    for item in items:
        if not isinstance(item, _Scalar):
            raise ValueError(f"{where}: expected strings, numbers, booleans or null, got {item!r}")
    return tuple(items)


def _same(expected: object, actual: object) -> bool:
    # Type-aware equality: in Python True == 1, but a rule for `n: 1` must not match `n: true`.
    if isinstance(expected, bool) or isinstance(actual, bool):
        return type(expected) is type(actual) and expected == actual
    return expected == actual


def _compile(globs: tuple[str, ...]) -> re.Pattern[str] | None:
    if not globs:
        return None
    return re.compile("|".join(f"(?:{translate(g)})" for g in globs))


@dataclass(frozen=True, slots=True)
class _Compiled:
    rule: ClassRule
    result: RequestClass
    models: re.Pattern[str] | None
    tenants: re.Pattern[str] | None
    fields: tuple[tuple[str, tuple[Any, ...]], ...]


class Classifier:
    """First-match classification of priced requests; runs per request, so globs are precompiled."""

    def __init__(self, rules: Sequence[ClassRule], default_pool: str) -> None:
        seen: set[str] = set()
        for rule in rules:
            if rule.name in seen:
                raise ValueError(f"class {rule.name!r} is defined twice; class names must be unique")
            seen.add(rule.name)
        self._rules = tuple(
            _Compiled(
                rule=r,
                result=r.to_class(),
                models=_compile(r.models),
                tenants=_compile(r.tenants),
                fields=tuple(r.fields.items()),
            )
            for r in rules
        )
        self._default = RequestClass(DEFAULT_CLASS, default_pool)

    @property
    def rules(self) -> tuple[ClassRule, ...]:
        return tuple(c.rule for c in self._rules)

    @property
    def default(self) -> RequestClass:
        return self._default

    def classify(self, *, cost: Cost, model: str, tenant: str, body: Mapping[str, Any]) -> RequestClass:
        prefill, decode, total = cost.prefill, cost.decode, cost.total
        for c in self._rules:
            r = c.rule
            if (
                (r.min_prompt_tokens is not None and prefill < r.min_prompt_tokens)
                or (r.max_prompt_tokens is not None and prefill > r.max_prompt_tokens)
                or (r.min_decode_tokens is not None and decode < r.min_decode_tokens)
                or (r.max_decode_tokens is not None and decode > r.max_decode_tokens)
                or (r.min_cost is not None and total < r.min_cost)
                or (r.max_cost is not None and total > r.max_cost)
                or (c.models is not None and c.models.match(model) is None)
                or (c.tenants is not None and c.tenants.match(tenant) is None)
            ):
                continue
            if all(any(_same(v, body.get(key)) for v in values) for key, values in c.fields):
                return c.result
        return self._default

"""Request classes: configured rules that map a priced request to a backend pool.

Rules are tried in order and the first whose conditions all hold wins; a rule without conditions
matches everything. When none matches, the request gets the class ``default`` on the default pool
(``None``: the pool that serves the request's model). The rules are read from the config file by
the gateway (``gateway.config.class_rules``); this module only matches them.

YAML shape of one rule (every ``when`` key is optional; unknown keys are body fields)::

    {name: reasoning, pool: long, overflow_pool: short, budget_tokens: 100000,
     when: {min_prompt_tokens: 8000, models: ["o*"], tenants: [acme], reasoning_effort: [high]}}

Token conditions compare against the request's `Cost`: ``*_prompt_tokens`` against prefill,
``*_decode_tokens`` against decode, ``*_cost`` against the total; bounds are inclusive. ``models``
and ``tenants`` are fnmatch globs (case-sensitive). ``has_field`` names top-level body fields of
which at least one must be present and not null (say the structured-output ones: ``[guided_json,
guided_regex, guided_grammar, structured_outputs, response_format]``, to give such requests a pool
of their own). A body field matches when its top-level value equals one of the listed values
(``null`` also matches an absent field; booleans never equal numbers).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from fnmatch import translate
from types import MappingProxyType
from typing import Any

from classifiers.pricing import Cost

__all__ = ["BOUNDS", "SCALAR", "ClassRule", "Classifier", "RequestClass"]

DEFAULT_CLASS = "default"

BOUNDS = (
    "min_prompt_tokens",
    "max_prompt_tokens",
    "min_decode_tokens",
    "max_decode_tokens",
    "min_cost",
    "max_cost",
)
SCALAR = str | int | float | bool | None  # what a body-field condition may compare with


@dataclass(frozen=True, slots=True)
class RequestClass:
    name: str
    pool: str | None  # None: the pool that serves the request's model
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
    has_field: tuple[str, ...] = ()  # at least one of these top-level fields present, not null
    fields: Mapping[str, tuple[Any, ...]] = field(default_factory=lambda: MappingProxyType({}))

    def to_config(self) -> dict[str, Any]:
        """The rule in config-file shape (the inverse of the gateway's ``classes`` parser)."""
        out: dict[str, Any] = {"name": self.name, "pool": self.pool}
        if self.overflow_pool is not None:
            out["overflow_pool"] = self.overflow_pool
        if self.budget_tokens is not None:
            out["budget_tokens"] = self.budget_tokens
        when: dict[str, Any] = {k: getattr(self, k) for k in BOUNDS if getattr(self, k) is not None}
        if self.models:
            when["models"] = list(self.models)
        if self.tenants:
            when["tenants"] = list(self.tenants)
        if self.has_field:
            when["has_field"] = list(self.has_field)
        for key, values in self.fields.items():
            when[key] = list(values) if len(values) > 1 else values[0]
        if when:
            out["when"] = when
        return out

    def to_class(self) -> RequestClass:
        return RequestClass(self.name, self.pool, self.overflow_pool, self.budget_tokens)


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

    def __init__(self, rules: Sequence[ClassRule], default_pool: str | None = None) -> None:
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
        self._counts_tokens = any(
            r.min_prompt_tokens is not None
            or r.max_prompt_tokens is not None
            or r.min_cost is not None
            or r.max_cost is not None
            for r in rules
        )

    @property
    def rules(self) -> tuple[ClassRule, ...]:
        return tuple(c.rule for c in self._rules)

    @property
    def default(self) -> RequestClass:
        return self._default

    @property
    def counts_tokens(self) -> bool:
        """Whether any rule compares the prompt's tokens (``*_prompt_tokens``, ``*_cost``)."""
        return self._counts_tokens

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
                or (r.has_field and all(body.get(key) is None for key in r.has_field))
            ):
                continue
            if all(any(_same(v, body.get(key)) for v in values) for key, values in c.fields):
                return c.result
        return self._default

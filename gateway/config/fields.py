"""The configuration's field toolkit: typed getters whose errors name the field by its path.

Every section of the YAML file is read with these (``gateway.config.loader``, the observability
settings, the store and class-rule sections), so every error reads the same way:
``tenants.acme.budget_tokens: expected a positive integer, got -5``, and an unknown key gets a
did-you-mean. The sections' types are owned by the packages that use them (``classifiers``,
``budgets``, ``backends``); only the reading and checking of YAML lives here.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Mapping, Sequence
from typing import Any


class ConfigError(ValueError):
    """A configuration problem; the message starts with the field's path."""


_NAME_RE = re.compile(r"^[A-Za-z0-9_.\-]+$")


def show(v: Any) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int | float):
        return str(v)
    if isinstance(v, str):
        return repr(v)
    if isinstance(v, Mapping):
        return "a mapping"
    if isinstance(v, list):
        return "a list"
    return type(v).__name__


def join(where: str, key: str) -> str:
    return f"{where}.{key}" if where else key


def did_you_mean(key: str, known: Sequence[str] | set[str]) -> str:
    close = difflib.get_close_matches(key, list(known), n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


def mapping(v: Any, where: str, *, top: bool = False) -> Mapping[str, Any]:
    if not isinstance(v, Mapping):
        raise ConfigError(f"{where}: expected a mapping, got {show(v)}")
    for k in v:
        if not isinstance(k, str):
            raise ConfigError(f"{where}: keys must be strings, got {show(k)}")
    return v


def check_keys(m: Mapping[str, Any], allowed: Sequence[str], where: str) -> None:
    for key in m:
        if key not in allowed:
            raise ConfigError(
                f"{join(where, key)}: unknown key{did_you_mean(key, allowed)}; "
                f"known keys here: {', '.join(allowed)}"
            )


def section(v: Any, where: str, allowed: Sequence[str]) -> Mapping[str, Any]:
    if v is None:
        return {}
    m = mapping(v, where)
    check_keys(m, allowed, where)
    return m


def valid_name(name: str, where: str) -> str:
    if not _NAME_RE.match(name):
        raise ConfigError(f"{where}: name {name!r} may only use letters, digits, '_', '-' and '.'")
    return name


def integer(
    m: Mapping[str, Any],
    key: str,
    where: str,
    default: int | None,
    *,
    minimum: int | None = None,
    maximum: int | None = None,
) -> int:
    path = join(where, key)
    if key not in m or m[key] is None:
        if default is None:
            raise ConfigError(f"{path}: required, expected {_int_kind(minimum)}")
        return default
    v = m[key]
    if isinstance(v, bool) or not isinstance(v, int) or (minimum is not None and v < minimum):
        raise ConfigError(f"{path}: expected {_int_kind(minimum)}, got {show(v)}")
    if maximum is not None and v > maximum:
        raise ConfigError(f"{path}: expected at most {maximum}, got {show(v)}")
    return v


def _int_kind(minimum: int | None) -> str:
    if minimum == 1:
        return "a positive integer"
    if minimum == 0:
        return "a non-negative integer"
    return "an integer" if minimum is None else f"an integer >= {minimum}"


def opt_integer(m: Mapping[str, Any], key: str, where: str, *, minimum: int | None = None) -> int | None:
    if m.get(key) is None:
        return None
    return integer(m, key, where, None, minimum=minimum)


def number(
    m: Mapping[str, Any], key: str, where: str, default: float | None, *, minimum: float | None = None
) -> float:
    """A number; ``default`` None makes the field required."""
    path = join(where, key)
    v = m.get(key)
    if v is None:
        if default is None:
            raise ConfigError(f"{path}: required, expected a number")
        return default
    if isinstance(v, bool) or not isinstance(v, int | float):
        raise ConfigError(f"{path}: expected a number, got {show(v)}")
    if minimum is not None and v < minimum:
        raise ConfigError(f"{path}: expected a non-negative number, got {show(v)}")
    return float(v)


def positive_number(
    m: Mapping[str, Any], key: str, where: str, default: float | None, *, maximum: float | None = None
) -> float:
    v = number(m, key, where, default)
    if v <= 0 or (maximum is not None and v > maximum):
        wanted = f"a number in (0, {maximum:g}]" if maximum is not None else "a positive number"
        raise ConfigError(f"{join(where, key)}: expected {wanted}, got {show(m.get(key))}")
    return v


def opt_positive_number(m: Mapping[str, Any], key: str, where: str) -> float | None:
    if m.get(key) is None:
        return None
    return positive_number(m, key, where, 1.0)


def choice(m: Mapping[str, Any], key: str, where: str, default: str, choices: Sequence[str]) -> str:
    v = m.get(key, default)
    if v not in choices:
        raise ConfigError(
            f"{join(where, key)}: expected one of {', '.join(repr(c) for c in choices)}, got {show(v)}"
        )
    return str(v)


def string(m: Mapping[str, Any], key: str, where: str, default: str | None) -> str:
    path = join(where, key)
    v = m.get(key)
    if v is None:
        if default is None:
            raise ConfigError(f"{path}: required, expected a string")
        return default
    if not isinstance(v, str) or not v:
        raise ConfigError(f"{path}: expected a non-empty string, got {show(v)}")
    return v


def opt_string(m: Mapping[str, Any], key: str, where: str) -> str | None:
    if m.get(key) is None:
        return None
    return string(m, key, where, None)


def boolean(m: Mapping[str, Any], key: str, where: str, default: bool) -> bool:
    v = m.get(key)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise ConfigError(f"{join(where, key)}: expected true or false, got {show(v)}")
    return v


def string_list(m: Mapping[str, Any], key: str, where: str) -> tuple[str, ...]:
    v = m.get(key)
    if v is None:
        return ()
    if isinstance(v, str):
        v = [v]
    if not isinstance(v, list):
        raise ConfigError(f"{join(where, key)}: expected a list of strings, got {show(v)}")
    for i, item in enumerate(v):
        if not isinstance(item, str) or not item:
            raise ConfigError(f"{join(where, key)}[{i}]: expected a non-empty string, got {show(item)}")
    return tuple(v)

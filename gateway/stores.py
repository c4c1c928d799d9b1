"""Budget-store factory: the only place that knows which store kinds exist.

``memory`` is the embedded default (one process). ``redis`` arrives in a later issue; until
then asking for it is a clear configuration error rather than an import failure at start-up.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable, Mapping
from typing import Any

from budgets.types import BudgetLayout, BudgetStore

# kind -> (option keys it accepts, shared across processes?)
_KINDS: Mapping[str, tuple[tuple[str, ...], bool]] = {
    "memory": ((), False),
    "redis": (("url", "key_prefix", "timeouts", "fail_mode", "replicas", "poll_interval_s"), True),
}


def _available(kind: str) -> bool:
    if kind == "memory":
        return True
    # The Redis store lands in a later issue, with its own factory in budgets.factory.
    return importlib.util.find_spec("budgets.redis_store") is not None and (
        importlib.util.find_spec("budgets.factory") is not None
    )


def check_store_config(kind: str, options: Mapping[str, Any]) -> None:
    """Raise ValueError("<key>: ...") when the section is invalid (the caller adds ``store.``)."""
    if kind not in _KINDS:
        raise ValueError(f"kind: unknown store kind {kind!r}; expected one of: {', '.join(_KINDS)}")
    if not _available(kind):
        raise ValueError(
            f"kind: the {kind} store is not available in this version yet; use kind: memory "
            "(one gateway process)"
        )
    if kind != "memory":
        from budgets import factory  # type: ignore[attr-defined,unused-ignore]

        check = getattr(factory, "check_options", None)
        if check is not None:  # the store that knows its options validates them
            check(kind, options)
            return
    allowed = _KINDS[kind][0]
    for key in options:
        if key not in allowed:
            hint = (
                f"; known keys: kind, {', '.join(allowed)}"
                if allowed
                else "; a memory store takes only 'kind'"
            )
            raise ValueError(f"{key}: unknown key for store kind {kind}{hint}")


def is_shared(kind: str) -> bool:
    """Whether several gateway processes see one budget through this store."""
    return _KINDS.get(kind, ((), False))[1]


def build_store(
    kind: str,
    options: Mapping[str, Any],
    layout: BudgetLayout,
    clock: Callable[[], float] | None = None,
) -> BudgetStore:
    check_store_config(kind, options)
    if kind == "memory":
        from budgets.memory import MemoryStore

        return MemoryStore(layout, clock=clock) if clock is not None else MemoryStore(layout)
    from budgets import factory  # type: ignore[attr-defined,unused-ignore]

    store: BudgetStore = factory.build_store(kind, layout, options)
    return store

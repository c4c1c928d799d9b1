"""Budget-store factory: the only place that knows which store kinds exist.

``memory`` is the embedded default (one process) and is built here. ``redis`` is validated and
built by ``budgets.factory``, imported only when a config asks for it: redis-py costs about half
a second of start-up that a memory-store gateway does not need.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from budgets.memory import MemoryStore
from budgets.types import BudgetLayout, BudgetStore

# kind -> shared across processes?
_SHARED: Mapping[str, bool] = {"memory": False, "redis": True}


def check_store_config(kind: str, options: Mapping[str, Any]) -> None:
    """Raise ValueError("<key>: ...") when the section is invalid (the caller adds ``store.``)."""
    if kind not in _SHARED:
        raise ValueError(f"kind: unknown store kind {kind!r}; expected one of: {', '.join(_SHARED)}")
    if kind == "memory":
        if options:
            key = next(iter(options))
            raise ValueError(f"{key}: unknown key for store kind memory; a memory store takes only 'kind'")
        return
    from budgets import factory

    factory.check_options(kind, options)


def is_shared(kind: str) -> bool:
    """Whether several gateway processes see one budget through this store."""
    return _SHARED.get(kind, False)


def build_store(
    kind: str,
    options: Mapping[str, Any],
    layout: BudgetLayout,
    clock: Callable[[], float] | None = None,
) -> BudgetStore:
    check_store_config(kind, options)
    if kind == "memory":
        return MemoryStore(layout, clock=clock) if clock is not None else MemoryStore(layout)
    from budgets import factory

    return factory.build_store(kind, layout, options)

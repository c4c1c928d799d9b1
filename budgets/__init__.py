"""Token pools: the store contract, the grant policy and the in-memory store (the Redis store is
budgets.redis)."""

from budgets.memory import MemoryStore
from budgets.types import (
    AdmissionError,
    BudgetLayout,
    BudgetStore,
    Demand,
    Lease,
    NeverFits,
    PolicySpec,
    PoolSpec,
    PoolState,
    QueueFull,
    QueueTimeout,
    StoreSnapshot,
    StoreUnavailable,
    TenantSpec,
    TierSpec,
    UnknownTenantOrTier,
    backend_pool,
    class_pool,
    tenant_pool,
)

__all__ = [
    "AdmissionError",
    "BudgetLayout",
    "BudgetStore",
    "Demand",
    "Lease",
    "MemoryStore",
    "NeverFits",
    "PolicySpec",
    "PoolSpec",
    "PoolState",
    "QueueFull",
    "QueueTimeout",
    "StoreSnapshot",
    "StoreUnavailable",
    "TenantSpec",
    "TierSpec",
    "UnknownTenantOrTier",
    "backend_pool",
    "class_pool",
    "tenant_pool",
]

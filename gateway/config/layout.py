"""Config -> the budget store's layout: which pools exist and how big they are.

* ``tenant:<name>``: the tenant's own budget (private, not shared). A tenant without
  ``budget_tokens`` (and the open tenant, and one whose budget is in shadow mode) gets the total
  capacity of all backend pools, i.e. it is limited by the backends only.
* ``backend:<pool>``: the sum of the pool's backends' capacities (shared: tier ceilings apply; a
  ceiling in shadow mode is 1.0 here).
* ``class:<name>``: only for class rules with ``budget_tokens`` (shared).
"""

from __future__ import annotations

from collections.abc import Sequence

from budgets.types import (
    BudgetLayout,
    PolicySpec,
    PoolSpec,
    TenantSpec,
    TierSpec,
    backend_pool,
    class_pool,
    tenant_pool,
)
from classifiers import ClassRule
from gateway.config.schema import GatewayConfig, TenantConfig


def build_layout(
    config: GatewayConfig, rules: Sequence[ClassRule], tenants: Sequence[TenantConfig]
) -> BudgetLayout:
    total = sum(p.capacity_tokens for p in config.pools)
    pools: dict[str, PoolSpec] = {}
    for t in tenants:
        name = tenant_pool(t.name)
        budget = t.enforced_budget  # (a budget in shadow mode holds nothing back: gateway/request/shadow.py)
        pools[name] = PoolSpec(name, budget if budget is not None else total, shared=False)
    for p in config.pools:
        name = backend_pool(p.name)
        pools[name] = PoolSpec(name, p.capacity_tokens, shared=True)
    for r in rules:
        if r.budget_tokens:
            name = class_pool(r.name)
            pools[name] = PoolSpec(name, r.budget_tokens, shared=True)
    return BudgetLayout(
        pools=pools,
        tiers={
            t.name: TierSpec(t.name, t.rank, t.ceiling if t.ceiling_enforce else 1.0, t.max_queue_wait_s)
            for t in config.tiers
        },
        tenants={t.name: TenantSpec(t.name, t.weight, t.max_queue_len) for t in tenants},
        policy=PolicySpec(
            prefill_weight=config.fairness.prefill_weight,
            decode_weight=config.fairness.decode_weight,
            backfill_limit_s=config.fairness.backfill_limit_s,
            tenant_queue_order=config.fairness.tenant_queue_order,
            max_defer_s=config.fairness.max_defer_s,
            defer_s_per_token=config.fairness.defer_s_per_token,
            lease_ttl_s=config.leases.ttl_s,
        ),
    )

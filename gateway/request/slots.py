"""The sequence-slot floor, said plainly: at config load and in the 413 it causes.

With ``max_num_seqs`` on every backend of a pool, each running sequence holds at least the pool's
tokens per sequence (``capacity_tokens / max_num_seqs`` summed over its backends, rounded up;
``gateway.upstream.pools.BackendPool.sequence_tokens``), whatever its prompt and max_tokens: a
tenant's many tiny requests cannot then fill the engine's slots inside its token budget. On an
engine that runs few sequences at once (llama.cpp's server runs one) the floor is most of the pool,
and it can exceed what a tier may hold of the pool (its ceiling) or a tenant's budget: every such
request is refused, however small. That is said at load time, and the refusal names the floor
instead of advising a lower max_tokens that cannot help.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

from budgets.types import NeverFits
from gateway.config.schema import GatewayConfig, PoolConfig, TenantConfig, TierConfig


def sequence_tokens(pool: PoolConfig) -> int:
    """Tokens one running sequence holds at least on ``pool`` (0: no floor, some max_num_seqs unknown)."""
    live = [b for b in pool.backends if not b.draining] or list(pool.backends)
    seqs = [b.max_num_seqs or 0 for b in live]
    if not seqs or not all(seqs):
        return 0
    return -(-sum(b.capacity_tokens for b in live) // sum(seqs))


def _floor_text(pool: PoolConfig, per_seq: int) -> str:
    live = [b for b in pool.backends if not b.draining] or list(pool.backends)
    cap = sum(b.capacity_tokens for b in live)
    seqs = sum(b.max_num_seqs or 0 for b in live)
    return (
        f"each running sequence on pool {pool.name} holds at least {per_seq} tokens "
        f"(capacity_tokens {cap} / max_num_seqs {seqs})"
    )


def load_warnings(config: GatewayConfig, tenants: Iterable[TenantConfig] | None = None) -> list[str]:
    """What the slot floor makes impossible under ``config``: a tier whose ceiling of a pool is below
    it, a tenant whose budget is below it. One line each, naming the setting to change."""
    out = []
    tiers: tuple[TierConfig, ...] = tuple(config.tiers)
    for pool in config.pools:
        per_seq = sequence_tokens(pool)
        if not per_seq:
            continue
        capacity = pool.capacity_tokens
        for tier in tiers:
            if not tier.ceiling_enforce:
                continue
            limit = math.floor(tier.ceiling * capacity)
            if per_seq > limit:
                out.append(
                    f"{_floor_text(pool, per_seq)}, more than tier {tier.name} may hold of it ({limit}: "
                    f"ceiling {tier.ceiling:g} of {capacity}): every {tier.name} request to pool "
                    f"{pool.name} will be refused (413). Set max_num_seqs to the sequences the engine "
                    f"really runs at once, raise the tier's ceiling, or leave max_num_seqs unset."
                )
        for tenant in config.tenants if tenants is None else tenants:
            if tenant.enforced_budget is not None and per_seq > tenant.enforced_budget:
                out.append(
                    f"{_floor_text(pool, per_seq)}, more than tenant {tenant.name}'s budget_tokens "
                    f"({tenant.budget_tokens}): every request of {tenant.name} to pool {pool.name} "
                    f"will be refused (413). Raise its budget_tokens to at least {per_seq}, or set "
                    f"max_num_seqs to the sequences the engine really runs at once."
                )
    return out


def refusal(exc: NeverFits, pool: PoolConfig | None, per_seq: int, prefill: int, asked: int) -> str:
    """The 413 message of a request that only the slot floor made too big for ``exc.pool``."""
    where = (
        _floor_text(pool, per_seq) if pool is not None else f"each running sequence holds {per_seq} tokens"
    )
    return (
        f"request costs {exc.cost} tokens in pool {exc.pool}, which allows it at most {exc.limit}: its "
        f"prompt ({prefill}) and output ({asked}) are below that, but {where}, and that floor is "
        f"above the limit, so it can never be admitted. A lower max_tokens does not help: the "
        f"operator must set max_num_seqs to what the engine runs at once, or raise the tier's ceiling "
        f"or the budget of {exc.pool}."
    )


__all__ = ["load_warnings", "refusal", "sequence_tokens"]

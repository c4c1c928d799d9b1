"""The cluster-wide Redis store: the BudgetStore contract with pools, queue and leases in Redis."""

from budgets.redis.store import RedisOptions, RedisStore

__all__ = ["RedisOptions", "RedisStore"]

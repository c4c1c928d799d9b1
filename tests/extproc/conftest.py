"""Fixtures shared by the external processor's tests."""

from tests.budgets.redis_fixtures import fresh_redis  # noqa: F401  (a fixture: a private redis-server per test)

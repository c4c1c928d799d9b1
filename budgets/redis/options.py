"""The Redis store's options (the ``store:`` section of the config, typed) and the periods they imply."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

FailMode = Literal["closed", "open"]
# How the Lua code runs: one Redis 7 function library (FCALL; falls back to scripts on Redis 6),
# or EVALSHA scripts always (budgets/redis/scripts.py).
LuaMode = Literal["functions", "scripts"]


@dataclass(frozen=True, slots=True)
class RedisOptions:
    url: str = "redis://127.0.0.1:6379/0"
    key_prefix: str = "tokengate"
    connect_timeout_s: float = 0.5
    op_timeout_s: float = 0.5
    fail_mode: FailMode = "closed"
    # Gateway replicas sharing the domain: fail-open gives each 1/replicas of every pool.
    replicas: int = 1
    poll_interval_s: float = 0.25
    # How often a down store probes Redis (defaults to poll_interval_s).
    probe_interval_s: float | None = None
    max_connections: int = 32
    lua: LuaMode = "functions"
    # Reap / liveness / layout-poll period; default min(poll_interval_s, lease TTL / 4).
    maintenance_interval_s: float | None = None
    # After Redis lost its data, the longest a recovered replica holds new grants back while the
    # other replicas re-register what they run (it ends as soon as ``replicas`` replicas have).
    # Default: twice what one replica needs to notice and recover (see settle_window_s).
    settle_s: float | None = None

    @property
    def call_timeout_s(self) -> float:
        """The bound of one call to Redis: connecting, then the operation."""
        return self.op_timeout_s + self.connect_timeout_s

    @property
    def probe_s(self) -> float:
        return self.probe_interval_s or self.poll_interval_s

    def maintenance_s(self, lease_ttl_s: float) -> float:
        return self.maintenance_interval_s or min(self.poll_interval_s, max(0.05, lease_ttl_s / 4))

    def settle_window_s(self, lease_ttl_s: float) -> float:
        """The longest grants are held back after Redis lost its data.

        Every other live replica notices within one probe or maintenance period and recovers
        within its call timeouts; twice that leaves room for a slow one.
        """
        if self.settle_s is not None:
            return self.settle_s
        return 2 * (self.probe_s + self.maintenance_s(lease_ttl_s) + self.call_timeout_s)

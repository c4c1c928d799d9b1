"""Quota windows cluster-wide: budgets/quota.py's ledger in Redis (lua/quota*.lua), on the budget
store's connection and under its domain's hash tag (one slot of a Cluster, followed through a
Sentinel failover like the pools).

Redis unreachable: with ``fail_mode: closed`` a reservation raises StoreUnavailable (a 503, as
for the pools); with ``fail_mode: open`` it is made in a ledger of this process against
``limit // replicas`` of each quota (what it used before is not known here, so a window may take up
to that much more than its limit while Redis is away), and settled there. A Redis that restarts
without persistence loses the windows' use and the reservations held: settling those returns
False and charges nothing; the windows count again from zero.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from dataclasses import replace

from budgets.background import BackgroundTask
from budgets.quota import Charge, Refused, Reserved
from budgets.quotas import MemoryQuotas
from budgets.redis import replies
from budgets.redis.transport import Down, Transport
from budgets.types import StoreUnavailable

_log = logging.getLogger(__name__)

_EXPIRE_BATCH = 256


def reserve_args(rid: str, ttl_s: float, charges: Sequence[Charge]) -> list[str]:
    args = [rid, repr(float(ttl_s))]
    for c in charges:
        args += [c.key, str(c.limit), str(c.amount), str(c.bucket), str(c.oldest), "1" if c.enforce else "0"]
        args.append(str(c.keep_s))
    return args


class RedisQuotas:
    """QuotaLedger in Redis (the budget store's ``quota_ledger``)."""

    def __init__(self, transport: Transport, *, ttl_s: float, fail_open: bool, replicas: int = 1) -> None:
        self.ttl_s = ttl_s
        self._transport = transport
        self._fallback = MemoryQuotas(ttl_s) if fail_open else None
        self._replicas = max(1, replicas)
        self._local: set[str] = set()  # reservations made in the fallback
        self._expiry = BackgroundTask("quota-expiry", self._expire_forever, _log)

    async def start(self) -> None:
        if self._fallback is not None:
            await self._fallback.start()
        self._expiry.start()

    async def close(self) -> None:
        await self._expiry.stop()
        if self._fallback is not None:
            await self._fallback.close()

    async def reserve(self, rid: str, charges: Sequence[Charge]) -> Reserved | Refused:
        try:
            reply = await self._transport.eval("quota_reserve", reserve_args(rid, self.ttl_s, charges))
        except Down as err:
            if self._fallback is None:
                raise StoreUnavailable(f"quota store unreachable: {err}") from None
            local = [replace(c, limit=c.limit // self._replicas) for c in charges]
            outcome = await self._fallback.reserve(rid, local)
            if isinstance(outcome, Reserved):
                self._local.add(rid)
            return outcome
        return replies.quota_reserve(reply)

    async def settle(self, rid: str, actual: Sequence[int] | None = None) -> bool:
        if rid in self._local and self._fallback is not None:
            self._local.discard(rid)
            return await self._fallback.settle(rid, actual)
        args = [rid, *("" if actual is None else [str(int(a)) for a in actual])]
        try:
            return int(await self._transport.eval("quota_settle", args)) == 1
        except Down:
            # The reservation stays in Redis and expires there, settled at the amount reserved:
            # an over-count by what was not used, never a lost charge.
            _log.warning("quota settle of %s not sent: redis is down; it expires there", rid)
            return False

    async def heartbeat(self, rids: Sequence[str]) -> None:
        remote = [r for r in rids if r not in self._local]
        if self._fallback is not None and len(remote) != len(rids):
            await self._fallback.heartbeat([r for r in rids if r in self._local])
        if remote:
            try:
                await self._transport.eval("quota_beat", [repr(float(self.ttl_s)), *remote])
            except Down:
                pass  # a missed beat is survivable (the TTL is three beats)

    async def expire(self) -> int:
        n = 0
        if self._fallback is not None:
            n += await self._fallback.expire()
        try:
            while True:
                reply = await self._transport.eval("quota_expire", [str(_EXPIRE_BATCH)])
                settled, more = replies.quota_expire(reply)
                n += settled
                if not more:
                    return n
        except Down:
            return n

    async def usage(self, windows: Sequence[tuple[str, int]]) -> list[tuple[int, int]]:
        args = [a for key, oldest in windows for a in (key, str(oldest))]
        try:
            reply = await self._transport.eval("quota_usage", args)
        except Down as err:
            raise StoreUnavailable(f"quota store unreachable: {err}") from None
        return replies.quota_usage(reply)

    async def reset(self, keys: Sequence[str]) -> int:
        try:
            reply = await self._transport.eval("quota_reset", list(keys))
        except Down as err:
            raise StoreUnavailable(f"quota store unreachable: {err}") from None
        return int(reply)

    async def _expire_forever(self) -> None:
        while True:
            await asyncio.sleep(max(0.05, self.ttl_s / 4))
            try:
                await self.expire()
            except Exception:
                _log.exception("quota expiry failed")

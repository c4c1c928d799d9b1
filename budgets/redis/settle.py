"""After Redis lost its data: new grants wait until every replica has re-registered its leases.

A Redis that restarted empty knows none of the requests running on the replicas. Each replica
re-registers its own leases when it recovers, but a grant made before the *others* have would
over-admit. So the first replica back opens the settle (``T:rejoin``, a set that expires after the
settle window); each one adds itself once its leases are registered; until ``replicas`` replicas
are in it, or it expired, a replica that saw the data loss holds its acquire calls back (in
arrival order) instead of sending them.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Callable, Coroutine
from typing import Any

from budgets.redis.keys import KeyLayout
from budgets.redis.transport import Down, Transport
from budgets.types import StoreUnavailable

_log = logging.getLogger(__name__)

_Gate = list[tuple[list[str], "asyncio.Future[Any]"]]


class SettleGate:
    def __init__(
        self,
        transport: Transport,
        keys: KeyLayout,
        replica: str,
        *,
        replicas: int,
        poll_s: float,
        window_s: Callable[[], float],
        spawn: Callable[[Coroutine[Any, Any, None]], None],
        closed: Callable[[], bool],
    ) -> None:
        self._transport = transport
        self._keys = keys
        self._replica = replica
        self._replicas = replicas
        self._poll_s = poll_s
        self._window_s = window_s
        self._spawn = spawn
        self._closed = closed
        # While not None: acquire calls held back, in arrival order.
        self._gate: _Gate | None = None

    @property
    def active(self) -> bool:
        return self._gate is not None

    @property
    def held_back(self) -> int:
        return len(self._gate) if self._gate is not None else 0

    def submit(self, args: list[str]) -> asyncio.Future[Any]:
        """An acquire script call: sent with the next batch, or held back while settling."""
        if self._gate is None:
            return self._transport.submit("acquire", args)
        fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._gate.append((args, fut))
        return fut

    def drop(self, fut: asyncio.Future[Any]) -> bool:
        """Drop a held-back call whose caller is gone; False if it was sent (or failed) already."""
        gate = self._gate or []
        for i, (_args, held) in enumerate(gate):
            if held is fut:
                del gate[i]
                fut.cancel()
                return True
        return False

    async def join(self) -> bool:
        """Tell the other replicas this one's leases are registered again; True once all are."""
        key = self._keys.rejoin
        async with self._transport.client.pipeline(transaction=True) as pipe:
            pipe.sadd(key, self._replica)
            pipe.pexpire(key, max(1, int(self._window_s() * 1000)), nx=True)
            pipe.scard(key)
            pipe.pttl(key)
            _added, _expiry, joined, ttl_ms = await self._transport.call(pipe.execute())
        return _settled(int(joined), int(ttl_ms), self._replicas)

    def hold_back(self) -> None:
        gate: _Gate = []
        self._gate = gate
        self._spawn(self._watch(gate))
        _log.warning("redis lost its data: new grants wait until every replica re-registered its leases")

    def fail(self, err: BaseException) -> None:
        """Fail every held-back call (Redis down again: they try again; or shutting down)."""
        gate, self._gate = self._gate, None
        for _args, fut in gate or ():
            if not fut.done():
                fut.set_exception(err)

    async def _watch(self, gate: _Gate) -> None:
        key = self._keys.rejoin
        while self._gate is gate and not self._closed():
            await asyncio.sleep(self._poll_s)
            if self._gate is not gate:
                return  # failed (Redis down again) or closed meanwhile
            try:
                async with self._transport.client.pipeline(transaction=False) as pipe:
                    pipe.scard(key)
                    pipe.pttl(key)
                    joined, ttl_ms = await self._transport.call(pipe.execute())
            except Down:
                return  # the failover failed the held-back calls
            if _settled(int(joined), int(ttl_ms), self._replicas):
                self._open()

    def _open(self) -> None:
        """Send the held-back acquire calls, in the order they came."""
        gate, self._gate = self._gate, None
        for args, fut in gate or ():
            if not fut.done():
                self._transport.submit("acquire", args).add_done_callback(functools.partial(_relay, fut))


def _settled(joined: int, ttl_ms: int, replicas: int) -> bool:
    # PTTL is -2 once the settle set expired (or never existed): the window is over.
    return joined >= replicas or ttl_ms < 0


def _relay(outer: asyncio.Future[Any], inner: asyncio.Future[Any]) -> None:
    """Hand a held-back call's reply (or failure) to the future its caller awaits."""
    if outer.done():
        return
    if inner.cancelled():
        outer.set_exception(StoreUnavailable("shutting down"))
    elif (err := inner.exception()) is not None:
        outer.set_exception(err)
    else:
        outer.set_result(inner.result())

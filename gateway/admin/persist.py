"""Where the admin state lives: in the process (optionally a JSON file), or in Redis for every replica.

Both stores save with a version check (compare-and-set): a change made from a stale state is refused
(``Conflict``) so two replicas changing things at once cannot lose one of the changes; the caller
re-reads and retries. The Redis store announces each change on a channel and every replica also
polls the version, so every replica applies a change within about ``poll_interval_s`` even when a
publish is lost.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import tempfile
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Protocol

from budgets.background import BackgroundTask
from gateway.admin.state import AdminState

log = logging.getLogger("tokengate.admin")

Listener = Callable[[AdminState], Awaitable[None]]


class Conflict(Exception):
    """The state changed under the caller (another replica saved first)."""


class StateStore(Protocol):
    async def load(self) -> AdminState: ...

    async def save(self, state: AdminState, expected_version: int) -> None: ...

    async def start(self, on_change: Listener) -> None: ...

    async def close(self) -> None: ...


class MemoryStateStore:
    """The state in this process; with ``path``, also a JSON file written atomically on every change."""

    def __init__(self, path: str | None = None) -> None:
        self.path = Path(path) if path else None
        self._state = AdminState()

    async def load(self) -> AdminState:
        if self.path is not None and self.path.exists():
            try:
                self._state = AdminState.from_json(json.loads(self.path.read_text(encoding="utf-8")))
            except (OSError, ValueError, TypeError) as exc:
                raise ValueError(f"admin.state_file: cannot read {self.path}: {exc}") from None
        return self._state

    async def save(self, state: AdminState, expected_version: int) -> None:
        if self._state.version != expected_version:
            raise Conflict
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=".tokengate-state-")
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                json.dump(state.to_json(), f, indent=1)
            os.replace(tmp, self.path)
        self._state = state

    async def start(self, on_change: Listener) -> None:
        return None  # one process: nobody else changes it

    async def close(self) -> None:
        return None


_CAS = """
local cur = redis.call('GET', KEYS[1])
local v = 0
if cur then v = tonumber(cjson.decode(cur)['version']) end
if v ~= tonumber(ARGV[1]) then return 0 end
redis.call('SET', KEYS[1], ARGV[2])
redis.call('PUBLISH', KEYS[2], ARGV[3])
return 1
"""


class RedisStateStore:
    """The state in one Redis key inside the budget domain's hash tag, shared by every replica."""

    def __init__(
        self, url: str, tag: str, *, poll_interval_s: float = 0.5, connect_timeout_s: float = 1.0
    ) -> None:
        from budgets.redis.nodes import redis_client

        self._redis = redis_client(
            url, tag, socket_connect_timeout=connect_timeout_s, socket_timeout=max(connect_timeout_s, 1.0)
        )
        self.key = f"{tag}:admin:state"
        self.channel = f"{tag}:admin:changed"
        self._cas = self._redis.register_script(_CAS)
        self._poll_interval_s = poll_interval_s
        self._seen = -1
        self._known = AdminState()  # the newest state this replica has seen or saved
        self._on_change: Listener | None = None
        self._watcher = BackgroundTask("tokengate-admin-state", self._watch, log)

    async def load(self) -> AdminState:
        raw = await self._redis.get(self.key)
        state = AdminState() if raw is None else AdminState.from_json(json.loads(raw))
        self._note(state)
        return state

    def _note(self, state: AdminState) -> None:
        self._seen = max(self._seen, state.version)
        if state.version >= self._known.version:
            self._known = state

    async def save(self, state: AdminState, expected_version: int) -> None:
        ok = await self._cas(
            keys=[self.key, self.channel], args=[expected_version, json.dumps(state.to_json()), state.version]
        )
        if not ok:
            raise Conflict
        self._note(state)

    async def start(self, on_change: Listener) -> None:
        self._on_change = on_change
        self._watcher.start()

    async def close(self) -> None:
        await self._watcher.stop()
        with contextlib.suppress(Exception):
            await self._redis.aclose()

    async def _watch(self) -> None:
        """Pub/sub for speed, a version poll for certainty: a lost message costs one poll interval."""
        pubsub = self._redis.pubsub()
        subscribed = False
        failing = False
        while True:
            try:
                if not subscribed:
                    await pubsub.subscribe(self.channel)
                    subscribed = True
                with contextlib.suppress(TimeoutError):
                    await pubsub.get_message(ignore_subscribe_messages=True, timeout=self._poll_interval_s)
                await self._check()
                if failing:
                    log.info("admin state watch: redis answers again")
                    failing = False
            except asyncio.CancelledError:
                with contextlib.suppress(Exception):
                    await pubsub.aclose()
                raise
            except Exception as exc:  # Redis away: keep the running config, try again
                subscribed = False
                if not failing:  # once per outage, not once per poll
                    log.warning("admin state watch: %s; the running config stays until redis answers", exc)
                    failing = True
                await asyncio.sleep(self._poll_interval_s)

    async def _check(self) -> None:
        state = await self.load_if_newer()
        if state is not None and self._on_change is not None:
            await self._on_change(state)

    async def load_if_newer(self) -> AdminState | None:
        raw = await self._redis.get(self.key)
        if raw is None:
            if self._known.version > 0:
                # Redis lost its data (a restart without persistence): every replica that still
                # knows the state writes it back; the first wins, the others see a conflict.
                with contextlib.suppress(Conflict):
                    await self.save(self._known, 0)
                    log.warning("redis had lost the admin state; restored version %d", self._known.version)
            return None
        state = AdminState.from_json(json.loads(raw))
        if state.version <= self._seen:
            return None
        self._note(state)
        return state

"""The admin state in use: every change is validated, saved, then applied to the running gateway.

``Control`` owns the current ``AdminState`` and the config file's raw YAML. A change (from the API,
a reload, or another replica through the state store) produces the effective configuration
(``state.effective_raw``), which is parsed by the normal loader — so an invalid change is refused
with the loader's message — and applied with the gateway's ``apply`` (handed in, like the
:class:`ConfigSource` that says where the file is). Changes are serialised by one lock;
a save that lost a race with another replica (``Conflict``) re-reads the state and tries again.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import orjson

from gateway.admin.persist import Conflict, MemoryStateStore, RedisStateStore, StateStore
from gateway.admin.state import AdminState, effective_raw, key_expiries, redacted
from gateway.admin.tokens import Caller
from gateway.config.fields import ConfigError
from gateway.config.loader import load_raw, parse_config
from gateway.config.schema import GatewayConfig
from gateway.request.errors import ApiError

log = logging.getLogger("tokengate.admin")
audit = logging.getLogger("tokengate.audit")

Mutation = Callable[[AdminState], AdminState]
# Applies a config to the running gateway with the keys' expiries; returns the sections kept until a restart.
Apply = Callable[[GatewayConfig, Mapping[str, float] | None], Awaitable[list[str]]]


def _unchanged(config: GatewayConfig) -> GatewayConfig:
    return config


@dataclass
class ConfigSource:
    """Where the running config comes from: the file ``reload`` reads (None: not from a file), and
    what ``tokengate serve`` adds to each config read (the embedded backend's pool). Set by the
    server; tests that build the app from a dict leave it as is."""

    path: str | None = None
    prepare: Callable[[GatewayConfig], GatewayConfig] = field(default=_unchanged)


def state_store_for(config: GatewayConfig) -> StateStore:
    """Redis when the budgets are in Redis (every replica shares the state), else this process."""
    if config.store.kind == "redis" and config.store.redis is not None:
        opts = config.store.redis
        return RedisStateStore(
            opts.url, "{tg:" + opts.key_prefix + "}", connect_timeout_s=opts.connect_timeout_s
        )
    return MemoryStateStore(config.admin.state_file)


class Control:
    def __init__(
        self, apply: Apply, source: ConfigSource, store: StateStore, file_raw: Mapping[str, Any] | None
    ) -> None:
        self._apply = apply
        self.source = source
        self.store = store
        self.file_raw = file_raw  # None: started from a config object, not a file: nothing to overlay
        self.state = AdminState()
        self._lock = asyncio.Lock()

    async def start(self) -> None:
        try:
            state = await self.store.load()
        except Exception as exc:
            # Redis away at start-up: serve the file's config now (the budget store decides what a
            # Redis outage means for requests); the watcher applies the shared state once it answers.
            log.warning(
                "admin state not readable at start-up (%s); running on the config file until it is", exc
            )
        else:
            await self._changed_elsewhere(state)
        await self.store.start(self._changed_elsewhere)

    async def close(self) -> None:
        await self.store.close()

    def effective(self, state: AdminState, file_raw: Mapping[str, Any] | None = None) -> GatewayConfig:
        raw = self.file_raw if file_raw is None else file_raw
        assert raw is not None
        return self.source.prepare(parse_config(effective_raw(raw, state)))

    async def change(self, caller: Caller, action: str, target: str, mutate: Mutation) -> AdminState:
        """Validate, save and apply one change; audited. Raises ApiError 400/409 when refused."""
        if self.file_raw is None:
            raise ApiError(
                409,
                "This gateway was built from a config object, not a file: the admin API cannot change it",
                code="not_changeable",
            )
        async with self._lock:
            for _ in range(5):
                current = self.state
                new = mutate(current).bumped()
                try:
                    config = self.effective(new)
                except ConfigError as exc:
                    raise ApiError(
                        400, f"The change would make the configuration invalid: {exc}", code="invalid_change"
                    ) from None
                try:
                    await self.store.save(new, current.version)
                except Conflict:
                    self.state = await self.store.load()  # another replica saved first: redo on top
                    continue
                self.state = new
                await self._apply(config, key_expiries(new))
                _audit(caller, action, target, current, new)
                return new
        raise ApiError(409, "The admin state kept changing under this request; retry", code="conflict")

    async def reload(self, caller: Caller | None = None) -> list[str]:
        """Re-read the config file and apply it with the admin state over it."""
        path = self.source.path
        if path is None:
            raise ConfigError("this gateway was started without a config file: there is nothing to reload")
        async with self._lock:
            raw = load_raw(path)
            config = self.effective(self.state, raw)  # raises ConfigError: nothing changes
            kept = await self._apply(config, key_expiries(self.state))
            self.file_raw = raw
        write_audit(caller, "reload", path, None, None)
        return kept

    async def _changed_elsewhere(self, state: AdminState) -> None:
        async with self._lock:
            if state.version <= self.state.version:
                return
            self.state = state
            if self.file_raw is None:
                return
            try:
                await self._apply(self.effective(state), key_expiries(state))
            except (ConfigError, ValueError) as exc:  # valid where it was made; not with this file
                log.error("admin change version %d from another replica not applied: %s", state.version, exc)
                return
            log.info("applied admin change version %d from another replica", state.version)


def _audit(caller: Caller, action: str, target: str, before: AdminState, after: AdminState) -> None:
    write_audit(caller, action, target, _view(before, target), _view(after, target))


def _view(state: AdminState, target: str) -> Any:
    """The part of the state an action touched (never a key's digest)."""
    kind, _, name = target.partition("/")
    if kind == "keys":
        record = state.keys.get(name)
        return None if record is None else record.public()
    if name not in state.overrides.get(kind, {}):
        return "(file)"
    return redacted(state.overrides[kind][name])


def write_audit(caller: Caller | None, action: str, target: str, before: Any, after: Any) -> None:
    """One audit line: the fields are keys of the JSON line (``gateway.process.logs``), or ``key=value`` in text.

    ``before`` and ``after`` go through JSON once here, so the line shows exactly what a JSON dump of
    the state would (and a value no formatter knows cannot break the line)."""
    actor = "signal/file" if caller is None else f"{caller.role.value}:{caller.fingerprint}"
    fields = {
        "actor": actor,
        "action": action,
        "target": target,
        "before": orjson.loads(orjson.dumps(before, default=str)),
        "after": orjson.loads(orjson.dumps(after, default=str)),
    }
    audit.info("%s %s by %s", action, target, actor, extra={"fields": fields})

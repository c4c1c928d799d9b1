"""What the admin API changed, and how it combines with the config file.

The rule, per object (a tenant, a pool, a tier):

* An object changed through the admin API is an **override**: from then on the API's version wins
  over the file's, across reloads and restarts, until the override is reset
  (``DELETE /admin/v1/overrides/{kind}/{name}``). Deleting an object through the API is an override
  too (the object stays deleted even if the file still has it).
* An object never touched through the API follows the file: a reload picks up its changes.
* Keys: keys in the file stay valid unless revoked through the API; keys created through the API
  are added to their tenant. Revocations, expiries (a rotation's overlap window) and API keys
  survive reloads and restarts.

The effective configuration is the file's raw YAML with the overrides written over it, parsed and
validated by the same loader as the file (so an API change that would make the config invalid is
refused with the loader's own message, naming the field). The state is plain JSON: it is what the
state stores persist (a file, or one Redis key shared by every replica).
"""

from __future__ import annotations

import copy
import hashlib
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, replace
from typing import Any

KINDS = ("tenants", "pools", "tiers", "models")


@dataclass(frozen=True, slots=True)
class KeyRecord:
    """One API key as the admin API knows it; the key itself is never stored, only its digest."""

    id: str
    tenant: str
    digest: str  # sha256 hex of the key
    prefix: str  # the key's first characters, to recognise it in a list
    created_at: float
    source: str = "admin"  # "admin": made by the API; "config": a key of the file
    name: str | None = None
    expires_at: float | None = None  # a rotated key stays valid until then
    revoked_at: float | None = None

    def valid_at(self, now: float) -> bool:
        return self.revoked_at is None and (self.expires_at is None or now < self.expires_at)

    def public(self) -> dict[str, Any]:
        """What a list shows: everything but the digest."""
        d = asdict(self)
        del d["digest"]
        return d


@dataclass(frozen=True, slots=True)
class AdminState:
    version: int = 0
    # kind -> name -> the object's section as in the YAML file, or None for "deleted".
    overrides: Mapping[str, Mapping[str, Mapping[str, Any] | None]] = field(
        default_factory=lambda: {k: {} for k in KINDS}
    )
    keys: Mapping[str, KeyRecord] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {
            "version": self.version,
            "overrides": {k: dict(v) for k, v in self.overrides.items()},
            "keys": {i: asdict(r) for i, r in self.keys.items()},
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> AdminState:
        overrides = {k: dict(data.get("overrides", {}).get(k, {})) for k in KINDS}
        keys = {i: KeyRecord(**r) for i, r in data.get("keys", {}).items()}
        return cls(version=int(data.get("version", 0)), overrides=overrides, keys=keys)

    def with_override(self, kind: str, name: str, value: Mapping[str, Any] | None) -> AdminState:
        overrides = {k: dict(v) for k, v in self.overrides.items()}
        overrides[kind][name] = None if value is None else dict(value)
        return replace(self, overrides=overrides)

    def without_override(self, kind: str, name: str) -> AdminState:
        overrides = {k: dict(v) for k, v in self.overrides.items()}
        overrides[kind].pop(name, None)
        return replace(self, overrides=overrides)

    def with_key(self, record: KeyRecord) -> AdminState:
        return replace(self, keys={**self.keys, record.id: record})

    def bumped(self) -> AdminState:
        return replace(self, version=self.version + 1)


def redacted(value: Any) -> Any:
    """``value`` with every ``api_key`` (a backend's credential) replaced: for views and the audit log."""
    if isinstance(value, Mapping):
        return {k: ("***" if k == "api_key" and v else redacted(v)) for k, v in value.items()}
    if isinstance(value, list):
        return [redacted(v) for v in value]
    return value


def key_prefix(key: str) -> str:
    """What a list may show of a key: at most 10 characters and never more than half of it."""
    return key[: min(10, len(key) // 2)]


def digest(key: str) -> str:
    return hashlib.sha256(key.encode("utf-8")).hexdigest()


def config_key_digest(key: str) -> str:
    """A key as the file writes it (plain, or ``sha256:<hex>``), as a digest."""
    return key[len("sha256:") :] if key.startswith("sha256:") else digest(key)


def config_key_id(tenant: str, key_digest: str) -> str:
    """The stable id of a key from the file: it has no record until the API touches it."""
    return f"cfg-{tenant}-{key_digest[:12]}"


def effective_raw(file_raw: Mapping[str, Any], state: AdminState) -> dict[str, Any]:
    """The file's raw config with the admin state written over it (not yet validated)."""
    raw: dict[str, Any] = copy.deepcopy(dict(file_raw))
    for kind in KINDS:
        section = dict(raw.get(kind) or {})
        for name, value in state.overrides.get(kind, {}).items():
            if value is None:
                section.pop(name, None)
            elif kind == "tenants":
                # A tenant override never carries keys: those come from the file and the key records.
                file_keys = (
                    (section.get(name) or {}).get("keys") if isinstance(section.get(name), Mapping) else None
                )
                section[name] = {**value, **({"keys": file_keys} if file_keys else {})}
            else:
                section[name] = dict(value)
        if section or kind in raw:
            raw[kind] = section
    _apply_keys(raw, state)
    return raw


def _apply_keys(raw: dict[str, Any], state: AdminState) -> None:
    tenants = raw.get("tenants")
    if not isinstance(tenants, dict):
        return
    revoked = {r.digest for r in state.keys.values() if r.revoked_at is not None}
    for name, section in list(tenants.items()):
        if not isinstance(section, Mapping):
            continue
        keys = section.get("keys")
        listed = [keys] if isinstance(keys, str) else list(keys or [])
        kept = [k for k in listed if not (isinstance(k, str) and config_key_digest(k) in revoked)]
        added = [
            f"sha256:{r.digest}"
            for r in state.keys.values()
            if r.tenant == name and r.source == "admin" and r.revoked_at is None
        ]
        tenants[name] = {**section, "keys": kept + added}


def key_expiries(state: AdminState) -> dict[str, float]:
    """digest -> the time a key stops being valid (rotated keys in their overlap window)."""
    return {
        r.digest: r.expires_at
        for r in state.keys.values()
        if r.expires_at is not None and r.revoked_at is None
    }

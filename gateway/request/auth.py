"""API key -> tenant, and the tier a request runs at.

Keys are compared by SHA-256 digest only (plain keys in the config are hashed at start-up), so a
lookup costs one hash and never compares secrets byte by byte. With no tenants configured one
open tenant, ``default``, accepts any key or none.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Iterable, Mapping
from fnmatch import fnmatchcase

from gateway.config.schema import OPEN_TENANT, GatewayConfig, TenantConfig, TierConfig
from gateway.request.errors import ApiError, show_value


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8")).digest()


class Authenticator:
    def __init__(self, config: GatewayConfig, expiries: Mapping[str, float] | None = None) -> None:
        """``expiries``: hex digest -> wall time a key stops working (a rotated key's overlap window)."""
        self._by_digest: dict[bytes, TenantConfig] = {}
        self._expiry = {bytes.fromhex(d): t for d, t in (expiries or {}).items()}
        tiers = {t.name: t for t in config.tiers}
        self._tiers: Mapping[str, TierConfig] = tiers
        self.open_tenant: TenantConfig | None = None
        if config.open_mode:
            default_tier = "standard" if "standard" in tiers else max(config.tiers, key=lambda t: t.rank).name
            self.open_tenant = TenantConfig(name=OPEN_TENANT, tier=default_tier)
        for tenant in config.tenants:
            for key in tenant.keys:
                if key.startswith("sha256:"):
                    self._by_digest[bytes.fromhex(key[len("sha256:") :])] = tenant
                else:
                    self._by_digest[_digest(key)] = tenant

    def key_ids(self, tenant: str) -> list[str]:
        """The ids (SHA-256, hex) of the keys that name ``tenant`` now."""
        return [d.hex() for d, t in self._by_digest.items() if t.name == tenant]

    def authenticate(self, key: str | None) -> TenantConfig:
        return self.identify(key)[0]

    def identify(self, key: str | None) -> tuple[TenantConfig, str]:
        """The key's tenant and the key's id (its SHA-256, hex; "" in open mode): what per-key
        quotas count by."""
        if self.open_tenant is not None:
            return self.open_tenant, ""
        if not key:
            raise ApiError(
                401,
                "Missing API key: send it as 'Authorization: Bearer <key>' (or an 'api-key' / 'x-api-key' header).",
                code="missing_api_key",
            )
        d = _digest(key)
        tenant = self._by_digest.get(d)
        if tenant is not None and self._expiry:
            ends = self._expiry.get(d)
            if ends is not None and time.time() >= ends:
                raise ApiError(
                    401,
                    "This API key has expired (it was rotated); use its replacement.",
                    code="expired_api_key",
                )
        if tenant is None:
            # Never echo the key itself, not even partly.
            raise ApiError(401, "Incorrect API key provided.", code="invalid_api_key")
        return tenant, d.hex()

    def tier_for(self, tenant: TenantConfig, requested: str | None) -> TierConfig:
        """The tenant's own tier, or a lower one the client asked for with x-tokengate-tier."""
        own = self._tiers[tenant.tier]
        if not requested or requested == own.name:
            return own
        tier = self._tiers.get(requested)
        if tier is None:
            raise ApiError(
                400,
                f"Unknown tier {show_value(requested)} in x-tokengate-tier; configured tiers: {', '.join(self._tiers)}",
                code="unknown_tier",
                param="x-tokengate-tier",
            )
        if tier.rank < own.rank:
            raise ApiError(
                403,
                f"Tier {show_value(requested)} is above this key's highest tier {own.name!r}; ask for {own.name!r} or lower.",
                code="tier_not_allowed",
                param="x-tokengate-tier",
            )
        return tier


def bearer_key(authorization: str) -> str | None:
    """The key of an ``Authorization: Bearer <key>`` header (scheme case-insensitive)."""
    scheme, _, rest = authorization.strip().partition(" ")
    if scheme.lower() != "bearer":
        return None
    return rest.strip() or None


def may_use(tenant: TenantConfig, model: str) -> bool:
    """Whether ``tenant`` may use ``model`` (its ``models`` globs; none: every served model)."""
    return not tenant.models or any(fnmatchcase(model, g) for g in tenant.models)


def visible_models(tenant: TenantConfig, served: Iterable[str]) -> list[str]:
    """The served models ``tenant`` may use: all it is ever shown, so that one tenant's model names
    (a customer's fine-tune, its LoRA adapter) are not read by another."""
    return [m for m in served if may_use(tenant, m)]

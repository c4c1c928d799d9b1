"""The admin API, ``/admin/v1/...``: tenants, API keys, pools and backends, tiers, live state, reload.

JSON in and out, errors in OpenAI's shape. Every route needs ``Authorization: Bearer <token>``: a
``read`` token may use GET, an ``admin`` token everything (``gateway.admin.tokens``). With no admin
token configured every ``/admin`` path is a 404: the API is off, never open. Changes go through
``Control`` (validated by the config loader, saved for every replica, applied live, audited). The
routes are described by an OpenAPI 3.1 document at ``GET /admin/v1/openapi.json``.
"""

from __future__ import annotations

import secrets
import time
from collections import deque
from collections.abc import Awaitable, Callable, Collection, Mapping
from dataclasses import asdict, dataclass
from fnmatch import fnmatchcase
from typing import Any

import orjson
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Route

from budgets.quota import MICRO
from budgets.types import BudgetStore, StoreUnavailable
from gateway.admin.control import Control, write_audit
from gateway.admin.openapi import document
from gateway.admin.state import (
    KINDS,
    AdminState,
    KeyRecord,
    config_key_digest,
    config_key_id,
    digest,
    effective_raw,
    key_prefix,
    redacted,
)
from gateway.admin.tokens import AdminTokens, Caller, Role
from gateway.admin.usage_export import as_csv, export
from gateway.config.fields import ConfigError
from gateway.config.quotas import quota_section
from gateway.config.schema import DEFAULT_TIERS, TENANT_KEYS
from gateway.live import LiveParts
from gateway.observe.accesslog import Record
from gateway.request.billing import UsageRecorder
from gateway.request.errors import ApiError, show_value
from gateway.request.quotas import QuotaGate, quota_usage
from gateway.upstream.pools import Router

Handler = Callable[[Request, Caller], Awaitable[Response]]

_TENANT_FIELDS = tuple(k for k in TENANT_KEYS if k != "keys")  # keys have their own routes
_MAX_BODY = 64 * 1024


def _json(data: Any, status: int = 200) -> Response:
    return Response(orjson.dumps(data), status_code=status, media_type="application/json")


def _error(exc: ApiError) -> Response:
    return Response(
        exc.body(),
        status_code=exc.status,
        media_type="application/json",
        headers=dict((k.decode(), v.decode()) for k, v in exc.headers() if k != b"content-type"),
    )


@dataclass
class RecentErrors:
    """The last failed requests (a request hook): what the live state shows an operator."""

    size: int = 50

    def __post_init__(self) -> None:
        self.items: deque[dict[str, Any]] = deque(maxlen=self.size)
        self.served: dict[str, int] = {}  # tenant -> prompt + completion tokens reported, this process

    def __call__(self, rec: Record, end: float) -> None:
        if rec.prompt_tokens is not None or rec.completion_tokens is not None:
            self.served[rec.tenant] = (
                self.served.get(rec.tenant, 0) + (rec.prompt_tokens or 0) + (rec.completion_tokens or 0)
            )
        if rec.status >= 400 or rec.outcome not in ("ok", "backend_4xx"):
            self.items.append(
                {
                    "at": time.time(),
                    "tenant": rec.tenant,
                    "class": rec.klass,
                    "pool": rec.pool,
                    "status": rec.status,
                    "outcome": rec.outcome,
                    "error": None if rec.error is None else rec.error[:300],
                }
            )


@dataclass(frozen=True)
class AdminParts:
    """What the admin API reads and changes, and nothing else of the gateway."""

    control: Control  # every change goes through it; it knows the config file
    tokens: AdminTokens
    live: LiveParts  # the running config: tenants, tiers, pools
    router: Router  # the pools and backends as they run
    store: BudgetStore
    exchanges: Collection[object]  # the requests in the gateway now (counted in the live state)
    quotas: QuotaGate | None = None  # the tenants' quota windows (usage reads)
    billing: UsageRecorder | None = None  # usage kept for billing (exports); None: usage_log off


class AdminApi:
    """The admin routes over :class:`AdminParts`. ``recent`` is a request hook the gateway calls with
    every finished request: the live state's recent errors and served tokens."""

    def __init__(self, parts: AdminParts) -> None:
        self.parts = parts
        self.recent = RecentErrors()

    # ---- plumbing ----

    def routes(self) -> list[BaseRoute]:
        r: list[tuple[str, Handler, str, Role]] = [
            ("/admin/v1/openapi.json", self.openapi, "GET", Role.READ),
            ("/admin/v1/tenants", self.list_tenants, "GET", Role.READ),
            ("/admin/v1/tenants", self.create_tenant, "POST", Role.ADMIN),
            ("/admin/v1/tenants/{name}", self.get_tenant, "GET", Role.READ),
            ("/admin/v1/tenants/{name}", self.update_tenant, "PATCH", Role.ADMIN),
            ("/admin/v1/tenants/{name}", self.delete_tenant, "DELETE", Role.ADMIN),
            ("/admin/v1/tenants/{name}/quotas", self.tenant_quotas, "GET", Role.READ),
            ("/admin/v1/tenants/{name}/quotas/{quota}", self.put_quota, "PUT", Role.ADMIN),
            ("/admin/v1/tenants/{name}/quotas/{quota}", self.delete_quota, "DELETE", Role.ADMIN),
            ("/admin/v1/tenants/{name}/quotas/{quota}/reset", self.reset_quota, "POST", Role.ADMIN),
            ("/admin/v1/tenants/{name}/keys", self.list_keys, "GET", Role.READ),
            ("/admin/v1/tenants/{name}/keys", self.create_key, "POST", Role.ADMIN),
            ("/admin/v1/keys/{key_id}", self.revoke_key, "DELETE", Role.ADMIN),
            ("/admin/v1/keys/{key_id}/rotate", self.rotate_key, "POST", Role.ADMIN),
            ("/admin/v1/pools", self.list_pools, "GET", Role.READ),
            ("/admin/v1/pools/{name}", self.get_pool, "GET", Role.READ),
            ("/admin/v1/pools/{name}", self.update_pool, "PATCH", Role.ADMIN),
            ("/admin/v1/pools/{name}/backends", self.add_backend, "POST", Role.ADMIN),
            ("/admin/v1/pools/{name}/backends", self.update_backend, "PATCH", Role.ADMIN),
            ("/admin/v1/pools/{name}/backends", self.remove_backend, "DELETE", Role.ADMIN),
            ("/admin/v1/tiers", self.list_tiers, "GET", Role.READ),
            ("/admin/v1/tiers/{name}", self.put_tier, "PUT", Role.ADMIN),
            ("/admin/v1/tiers/{name}", self.delete_tier, "DELETE", Role.ADMIN),
            ("/admin/v1/prices", self.list_prices, "GET", Role.READ),
            ("/admin/v1/prices", self.put_price, "PUT", Role.ADMIN),
            ("/admin/v1/prices", self.delete_price, "DELETE", Role.ADMIN),
            ("/admin/v1/usage", self.usage, "GET", Role.READ),
            ("/admin/v1/state", self.live_state, "GET", Role.READ),
            ("/admin/v1/overrides", self.list_overrides, "GET", Role.READ),
            ("/admin/v1/overrides/{kind}/{name}", self.reset_override, "DELETE", Role.ADMIN),
            ("/admin/v1/reload", self.reload, "POST", Role.ADMIN),
        ]
        by_path: dict[str, dict[str, tuple[Handler, Role]]] = {}
        for path, handler, method, role in r:
            by_path.setdefault(path, {})[method] = (handler, role)
        return [
            Route(path, self._dispatch(methods), methods=list(methods)) for path, methods in by_path.items()
        ]

    def _dispatch(
        self, methods: Mapping[str, tuple[Handler, Role]]
    ) -> Callable[[Request], Awaitable[Response]]:
        async def endpoint(request: Request) -> Response:
            try:
                caller = self._caller(request)
                handler, needed = methods[request.method]
                if not caller.role.allows(needed):
                    raise ApiError(
                        403,
                        f"This token may only read; {request.method} needs an admin token",
                        code="forbidden",
                    )
                return await handler(request, caller)
            except ApiError as exc:
                return _error(exc)

        return endpoint

    def _caller(self, request: Request) -> Caller:
        tokens = self.parts.tokens
        if not tokens.enabled:
            raise ApiError(
                404,
                "The admin API is off: set TOKENGATE_ADMIN_TOKEN (or admin.tokens_file) to enable it",
                code="admin_api_off",
            )
        caller = tokens.caller(request.headers.get("authorization"))
        if caller is None or caller.role is Role.METRICS:
            raise ApiError(
                401,
                "Send an admin or read-only token: 'Authorization: Bearer <token>'",
                code="invalid_admin_token",
            )
        return caller

    async def _body(self, request: Request) -> dict[str, Any]:
        raw = await request.body()
        if len(raw) > _MAX_BODY:
            raise ApiError(
                413, f"Admin request bodies are limited to {_MAX_BODY} bytes", code="request_too_large"
            )
        try:
            data = orjson.loads(raw or b"{}")
        except orjson.JSONDecodeError as exc:
            raise ApiError(400, f"The body is not valid JSON: {exc}", code="invalid_json") from None
        if not isinstance(data, dict):
            raise ApiError(400, "The body must be a JSON object", code="invalid_json")
        return data

    def _raw(self) -> dict[str, Any]:
        """The effective config in file shape (the file with the admin state over it)."""
        control = self.parts.control
        return effective_raw(control.file_raw or {}, control.state)

    # ---- tenants ----

    def _tenant_view(self, name: str) -> dict[str, Any]:
        for t in self.parts.live.current.config.tenants:
            if t.name == name:
                d = asdict(t)
                d.pop("keys")
                d["models"] = list(t.models)
                d["server_tools"] = None if t.server_tools is None else list(t.server_tools)
                d["quotas"] = [quota_section(q) for q in t.quotas]
                d["source"] = self._source("tenants", name)
                return d
        raise ApiError(404, f"No tenant {show_value(name)}", code="tenant_not_found")

    def _source(self, kind: str, name: str) -> str:
        control = self.parts.control
        in_file = name in ((control.file_raw or {}).get(kind) or {})
        if name in control.state.overrides.get(kind, {}):
            return "admin" if not in_file else "admin (over the file)"
        return "file"

    async def list_tenants(self, request: Request, caller: Caller) -> Response:
        return _json({"tenants": [self._tenant_view(t.name) for t in self.parts.live.current.config.tenants]})

    async def get_tenant(self, request: Request, caller: Caller) -> Response:
        return _json(self._tenant_view(request.path_params["name"]))

    async def tenant_quotas(self, request: Request, caller: Caller) -> Response:
        """Each quota of the tenant: its window now, what is used and reserved in it, what is left."""
        name = request.path_params["name"]
        tenant = next((t for t in self.parts.live.current.config.tenants if t.name == name), None)
        if tenant is None:
            raise ApiError(404, f"No tenant {show_value(name)}", code="tenant_not_found")
        gate = self.parts.quotas
        if gate is None or not tenant.quotas:
            return _json({"tenant": name, "quotas": []})
        try:
            views = await quota_usage(gate.ledger, tenant.quotas, self._key_labels(name), time.time())
        except StoreUnavailable as exc:
            raise ApiError(503, exc.message, code="store_unavailable", retry_after_s=1.0) from None
        return _json({"tenant": name, "quotas": views})

    def _quota_list(self, name: str) -> list[Any]:
        current = (self._raw().get("tenants") or {}).get(name)
        if not isinstance(current, Mapping):
            raise ApiError(404, f"No tenant {show_value(name)}", code="tenant_not_found")
        return [dict(q) if isinstance(q, Mapping) else q for q in current.get("quotas") or []]

    async def _set_quotas(self, caller: Caller, action: str, name: str, quotas: list[Any]) -> None:
        current = (self._raw().get("tenants") or {}).get(name) or {}
        merged = {k: v for k, v in current.items() if k not in ("keys", "quotas")}
        if quotas:
            merged["quotas"] = quotas
        await self.parts.control.change(
            caller, action, f"tenants/{name}", lambda s: s.with_override("tenants", name, merged)
        )

    async def put_quota(self, request: Request, caller: Caller) -> Response:
        """Add the quota by this name, or replace it (its use carries over while its window is
        the same)."""
        name, quota = request.path_params["name"], request.path_params["quota"]
        body = await self._body(request)
        if body.get("name", quota) != quota:
            raise ApiError(
                400,
                f"The body names quota {show_value(body['name'])}, the path {show_value(quota)}",
                param="name",
            )
        quotas = self._quota_list(name)
        entry = {**body, "name": quota}
        at = next((i for i, q in enumerate(quotas) if _quota_name(q) == quota), None)
        if at is None:
            quotas.append(entry)
        else:
            quotas[at] = entry
        await self._set_quotas(caller, "quota.put", name, quotas)
        return _json(self._tenant_view(name))

    async def delete_quota(self, request: Request, caller: Caller) -> Response:
        name, quota = request.path_params["name"], request.path_params["quota"]
        quotas = self._quota_list(name)
        kept = [q for q in quotas if _quota_name(q) != quota]
        if len(kept) == len(quotas):
            raise ApiError(
                404, f"Tenant {show_value(name)} has no quota {show_value(quota)}", code="quota_not_found"
            )
        await self._set_quotas(caller, "quota.delete", name, kept)
        return _json(self._tenant_view(name))

    async def reset_quota(self, request: Request, caller: Caller) -> Response:
        """Forget what the quota's window used, on every replica (the windows live in the store);
        requests running keep their reservations. ``?key=<key id>``: one key's window of a ``per:
        key`` quota (default: every key's)."""
        name, quota = request.path_params["name"], request.path_params["quota"]
        tenant = next((t for t in self.parts.live.current.config.tenants if t.name == name), None)
        if tenant is None:
            raise ApiError(404, f"No tenant {show_value(name)}", code="tenant_not_found")
        spec = next((q for q in tenant.quotas if q.name == quota), None)
        if spec is None:
            raise ApiError(
                404, f"Tenant {show_value(name)} has no quota {show_value(quota)}", code="quota_not_found"
            )
        gate = self.parts.quotas
        assert gate is not None
        keys = [""]
        if spec.per_key:
            labels = self._key_labels(name)
            wanted = request.query_params.get("key")
            if wanted is not None:
                digest = wanted.removeprefix("sha256:").rstrip("…")
                keys = [
                    d
                    for d, label in labels.items()
                    if label.split(" ")[0] == wanted or (len(digest) >= 12 and d.startswith(digest))
                ]
                if not keys:
                    raise ApiError(
                        404,
                        f"Tenant {show_value(name)} has no key {show_value(wanted)}",
                        param="key",
                        code="key_not_found",
                    )
            else:
                keys = list(labels)
        try:
            cleared = await gate.ledger.reset([spec.key_for(k) for k in keys])
        except StoreUnavailable as exc:
            raise ApiError(503, exc.message, code="store_unavailable", retry_after_s=1.0) from None
        shown = cleared / MICRO if spec.unit == "cost" else cleared
        write_audit(caller, "quota.reset", f"tenants/{name}/quotas/{quota}", {"used": shown}, {"used": 0})
        return _json({"tenant": name, "reset": quota, "forgotten": shown, "unit": spec.unit})

    def _key_labels(self, name: str) -> dict[str, str]:
        """The tenant's key ids (digests) -> how the operator knows them (never the key)."""
        records = {r.digest: r for r in self.parts.control.state.keys.values()}
        keys = {}
        for d in self.parts.live.current.auth.key_ids(name):
            r = records.get(d)
            keys[d] = f"{r.id} ({r.prefix}…)" if r is not None else f"sha256:{d[:12]}…"
        return keys

    async def create_tenant(self, request: Request, caller: Caller) -> Response:
        body = await self._body(request)
        name = body.pop("name", None)
        if not isinstance(name, str) or not name:
            raise ApiError(400, "'name' must be a non-empty string", param="name", code="invalid_type")
        if name in (self._raw().get("tenants") or {}):
            raise ApiError(409, f"Tenant {show_value(name)} exists; PATCH it instead", code="tenant_exists")
        section = _tenant_section(body)
        await self.parts.control.change(
            caller, "tenant.create", f"tenants/{name}", lambda s: s.with_override("tenants", name, section)
        )
        return _json(self._tenant_view(name), 201)

    async def update_tenant(self, request: Request, caller: Caller) -> Response:
        name = request.path_params["name"]
        body = await self._body(request)
        current = (self._raw().get("tenants") or {}).get(name)
        if not isinstance(current, Mapping):
            raise ApiError(404, f"No tenant {show_value(name)}", code="tenant_not_found")
        merged = {k: v for k, v in current.items() if k != "keys"}
        merged.update(_tenant_section(body))
        merged = {k: v for k, v in merged.items() if v is not None}
        await self.parts.control.change(
            caller, "tenant.update", f"tenants/{name}", lambda s: s.with_override("tenants", name, merged)
        )
        return _json(self._tenant_view(name))

    async def delete_tenant(self, request: Request, caller: Caller) -> Response:
        name = request.path_params["name"]
        if name not in (self._raw().get("tenants") or {}):
            raise ApiError(404, f"No tenant {show_value(name)}", code="tenant_not_found")
        await self.parts.control.change(
            caller, "tenant.delete", f"tenants/{name}", lambda s: s.with_override("tenants", name, None)
        )
        return _json({"deleted": name})

    # ---- keys ----

    def _keys_of(self, tenant: str) -> list[dict[str, Any]]:
        control = self.parts.control
        out: list[dict[str, Any]] = []
        file_tenant = ((control.file_raw or {}).get("tenants") or {}).get(tenant)
        listed = file_tenant.get("keys") if isinstance(file_tenant, Mapping) else None
        for key in [listed] if isinstance(listed, str) else list(listed or []):
            if not isinstance(key, str):
                continue
            d = config_key_digest(key)
            kid = config_key_id(tenant, d)
            record = control.state.keys.get(kid)
            view = (record or KeyRecord(kid, tenant, d, "", 0.0, source="config")).public()
            view["prefix"] = None if key.startswith("sha256:") else key_prefix(key)
            out.append(view)
        out += [r.public() for r in control.state.keys.values() if r.tenant == tenant and r.source == "admin"]
        return out

    async def list_keys(self, request: Request, caller: Caller) -> Response:
        name = request.path_params["name"]
        self._tenant_view(name)  # 404 for an unknown tenant
        return _json({"keys": self._keys_of(name)})

    async def create_key(self, request: Request, caller: Caller) -> Response:
        tenant = request.path_params["name"]
        self._tenant_view(tenant)
        body = await self._body(request)
        label = body.get("name")
        if label is not None and not isinstance(label, str):
            raise ApiError(400, "'name' must be a string", param="name", code="invalid_type")
        key, record = _new_key(tenant, label)
        await self.parts.control.change(
            caller, "key.create", f"keys/{record.id}", lambda s: s.with_key(record)
        )
        return _json({**record.public(), "key": key}, 201)

    def _find_key(self, key_id: str) -> KeyRecord:
        control = self.parts.control
        record = control.state.keys.get(key_id)
        if record is not None:
            return record
        for tenant in (control.file_raw or {}).get("tenants") or {}:
            for view in self._keys_of(tenant):
                if view["id"] == key_id:
                    digest_ = next(
                        config_key_digest(k)
                        for k in _listed_keys((control.file_raw or {})["tenants"][tenant])
                        if config_key_id(tenant, config_key_digest(k)) == key_id
                    )
                    return KeyRecord(key_id, tenant, digest_, view["prefix"] or "", 0.0, source="config")
        raise ApiError(404, f"No API key with id {show_value(key_id)}", code="key_not_found")

    async def revoke_key(self, request: Request, caller: Caller) -> Response:
        record = self._find_key(request.path_params["key_id"])
        if record.revoked_at is not None:
            return _json(record.public())
        revoked = KeyRecord(**{**asdict(record), "revoked_at": time.time()})
        await self.parts.control.change(
            caller, "key.revoke", f"keys/{record.id}", lambda s: s.with_key(revoked)
        )
        return _json(revoked.public())

    async def rotate_key(self, request: Request, caller: Caller) -> Response:
        old = self._find_key(request.path_params["key_id"])
        if old.revoked_at is not None:
            raise ApiError(409, "A revoked key cannot be rotated; create a new one", code="key_revoked")
        if old.expires_at is not None and old.expires_at <= time.time():
            raise ApiError(409, "An expired key cannot be rotated; create a new one", code="key_expired")
        body = await self._body(request)
        overlap = body.get("overlap_s", 3600)
        if (
            isinstance(overlap, bool)
            or not isinstance(overlap, int | float)
            or not 0 <= overlap <= 30 * 86400
        ):
            raise ApiError(
                400,
                "'overlap_s' must be a number of seconds from 0 to 2592000",
                param="overlap_s",
                code="invalid_value",
            )
        key, new = _new_key(old.tenant, old.name)
        ending = KeyRecord(**{**asdict(old), "expires_at": time.time() + float(overlap)})

        def mutate(s: AdminState) -> AdminState:
            return s.with_key(ending).with_key(new)

        await self.parts.control.change(caller, "key.rotate", f"keys/{old.id}", mutate)
        return _json(
            {**new.public(), "key": key, "replaces": old.id, "old_key_expires_at": ending.expires_at}, 201
        )

    # ---- pools and backends ----

    def _pool_view(self, name: str) -> dict[str, Any]:
        pool = self.parts.router.pools.get(name)
        if pool is None:
            raise ApiError(404, f"No pool {show_value(name)}", code="pool_not_found")
        spec = next(p for p in self.parts.live.current.config.pools if p.name == name)
        return {
            "name": name,
            "budget_tokens": spec.budget_tokens,
            "capacity_tokens": spec.capacity_tokens,
            "source": self._source("pools", name),
            "backends": [
                {
                    "name": b.name,
                    "url": b.spec.url,
                    "capacity_tokens": b.spec.capacity_tokens,
                    "models": list(b.spec.models),
                    "draining": b.spec.draining,
                    "healthy": b.healthy,
                    "in_flight_tokens": b.in_flight_tokens,
                    "in_flight_requests": b.in_flight_requests,
                }
                for b in pool.backends
            ],
        }

    async def list_pools(self, request: Request, caller: Caller) -> Response:
        return _json({"pools": [self._pool_view(p) for p in self.parts.router.pools]})

    async def get_pool(self, request: Request, caller: Caller) -> Response:
        return _json(self._pool_view(request.path_params["name"]))

    def _pool_raw(self, name: str) -> dict[str, Any]:
        pool = (self._raw().get("pools") or {}).get(name)
        if not isinstance(pool, Mapping):
            raise ApiError(404, f"No pool {show_value(name)}", code="pool_not_found")
        return {**pool, "backends": [dict(b) for b in pool.get("backends") or []]}

    async def _change_pool(self, caller: Caller, action: str, name: str, pool: dict[str, Any]) -> Response:
        await self.parts.control.change(
            caller, action, f"pools/{name}", lambda s: s.with_override("pools", name, pool)
        )
        return _json(self._pool_view(name))

    async def update_pool(self, request: Request, caller: Caller) -> Response:
        name = request.path_params["name"]
        body = await self._body(request)
        unknown = set(body) - {"budget_tokens"}
        if unknown:
            raise ApiError(
                400,
                f"Unknown field(s) {', '.join(sorted(unknown))}; a pool takes budget_tokens",
                code="unknown_field",
            )
        pool = self._pool_raw(name)
        if body.get("budget_tokens") is None:
            pool.pop("budget_tokens", None)
        else:
            pool["budget_tokens"] = body["budget_tokens"]
        return await self._change_pool(caller, "pool.update", name, pool)

    def _backend_index(self, pool: dict[str, Any], url: object) -> int:
        if not isinstance(url, str) or not url:
            raise ApiError(400, "Name the backend by its 'url'", param="url", code="invalid_type")
        for i, b in enumerate(pool["backends"]):
            if str(b.get("url", "")).rstrip("/").removesuffix("/v1") == url.rstrip("/").removesuffix("/v1"):
                return i
        raise ApiError(404, f"No backend {show_value(url)} in this pool", code="backend_not_found")

    async def add_backend(self, request: Request, caller: Caller) -> Response:
        name = request.path_params["name"]
        body = await self._body(request)
        pool = self._pool_raw(name)
        pool["backends"].append(body)
        return await self._change_pool(caller, "backend.add", name, pool)

    async def update_backend(self, request: Request, caller: Caller) -> Response:
        name = request.path_params["name"]
        body = await self._body(request)
        pool = self._pool_raw(name)
        i = self._backend_index(pool, body.get("url"))
        pool["backends"][i] = {**pool["backends"][i], **{k: v for k, v in body.items() if k != "url"}}
        return await self._change_pool(caller, "backend.update", name, pool)

    async def remove_backend(self, request: Request, caller: Caller) -> Response:
        name = request.path_params["name"]
        pool = self._pool_raw(name)
        i = self._backend_index(pool, request.query_params.get("url"))
        del pool["backends"][i]
        if not pool["backends"]:
            raise ApiError(
                409,
                "A pool keeps at least one backend; remove the pool from the config file instead",
                code="last_backend",
            )
        return await self._change_pool(caller, "backend.remove", name, pool)

    # ---- tiers ----

    async def list_tiers(self, request: Request, caller: Caller) -> Response:
        return _json(
            {
                "tiers": [
                    {**asdict(t), "source": self._source("tiers", t.name)}
                    for t in self.parts.live.current.config.tiers
                ]
            }
        )

    def _with_default_tiers(self, s: AdminState) -> AdminState:
        """A file without a tiers section relies on the defaults: write them out before changing one,
        or the change would replace all of them."""
        if "tiers" in (self.parts.control.file_raw or {}) or s.overrides["tiers"]:
            return s
        for t in DEFAULT_TIERS:
            s = s.with_override(
                "tiers",
                t.name,
                {"rank": t.rank, "ceiling": t.ceiling, "max_queue_wait_s": t.max_queue_wait_s},
            )
        return s

    async def put_tier(self, request: Request, caller: Caller) -> Response:
        name = request.path_params["name"]
        body = await self._body(request)
        await self.parts.control.change(
            caller,
            "tier.put",
            f"tiers/{name}",
            lambda s: self._with_default_tiers(s).with_override("tiers", name, body),
        )
        return await self.list_tiers(request, caller)

    async def delete_tier(self, request: Request, caller: Caller) -> Response:
        name = request.path_params["name"]
        if all(t.name != name for t in self.parts.live.current.config.tiers):
            raise ApiError(404, f"No tier {show_value(name)}", code="tier_not_found")
        await self.parts.control.change(
            caller,
            "tier.delete",
            f"tiers/{name}",
            lambda s: self._with_default_tiers(s).with_override("tiers", name, None),
        )
        return await self.list_tiers(request, caller)

    # ---- model prices (cost quotas, the usage export) ----

    async def list_prices(self, request: Request, caller: Caller) -> Response:
        """Every model glob of the config (first match wins) and its price, null when it has none."""
        rows = []
        for m in self.parts.live.current.config.models:
            price = (
                None
                if m.price is None
                else {"input": m.price.input, "output": m.price.output, "cached_input": m.price.cached_input}
            )
            rows.append({"model": m.pattern, "price": price, "source": self._source("models", m.pattern)})
        return _json({"prices": rows})

    async def put_price(self, request: Request, caller: Caller) -> Response:
        """Price a model glob: its entry's ``price`` (currency per 1M tokens). A glob not in the
        config is added after the others, so it is refused when one of those already matches it
        (first match wins: it would never apply)."""
        body = await self._body(request)
        model = body.pop("model", None)
        if not isinstance(model, str) or not model:
            raise ApiError(
                400,
                "'model' must be a model name or glob, e.g. llama-3.1-8b*",
                param="model",
                code="invalid_type",
            )
        models = dict(self._raw().get("models") or {})
        if model not in models:
            shadowing = next((g for g in models if fnmatchcase(model, g)), None)
            if shadowing is not None:
                raise ApiError(
                    400,
                    f"Model glob {show_value(shadowing)} comes first and matches {show_value(model)}, so a price "
                    f"on {show_value(model)} would never apply: price {show_value(shadowing)}, or change the config file's order",
                    param="model",
                    code="price_never_applies",
                )
        entry = dict(models.get(model) or {})
        entry["price"] = body
        await self.parts.control.change(
            caller, "price.put", f"models/{model}", lambda s: s.with_override("models", model, entry)
        )
        return await self.list_prices(request, caller)

    async def delete_price(self, request: Request, caller: Caller) -> Response:
        model = request.query_params.get("model", "")
        entry = (self._raw().get("models") or {}).get(model)
        if not isinstance(entry, Mapping) or "price" not in entry:
            raise ApiError(
                404, f"No price on model glob {show_value(model)}", param="model", code="price_not_found"
            )
        rest: dict[str, Any] | None = {k: v for k, v in entry.items() if k != "price"}
        if not rest and model not in ((self.parts.control.file_raw or {}).get("models") or {}):
            rest = None  # a glob the admin API added for its price: gone with it
        await self.parts.control.change(
            caller, "price.delete", f"models/{model}", lambda s: s.with_override("models", model, rest)
        )
        return await self.list_prices(request, caller)

    # ---- usage for billing ----

    async def usage(self, request: Request, caller: Caller) -> Response:
        """Usage per period, tenant, key and model over ``from``..``to`` (gateway/admin/usage_export.py)."""
        billing = self.parts.billing
        if billing is None:
            raise ApiError(
                404,
                "Usage is not kept: usage_log.enabled is false in the gateway's config",
                code="usage_log_off",
            )
        labels: dict[str, dict[str, str]] = {}

        def key_label(tenant: str, key: str) -> str:
            if tenant not in labels:
                labels[tenant] = self._key_labels(tenant)
            return labels[tenant].get(key) or f"sha256:{key[:12]}…"

        try:
            await billing.flush()  # this replica's last second too
            data, fmt = await export(billing.log, request.query_params, key_label)
        except StoreUnavailable as exc:
            raise ApiError(503, exc.message, code="store_unavailable", retry_after_s=1.0) from None
        if fmt == "csv":
            return Response(as_csv(data), media_type="text/csv; charset=utf-8")
        return _json(data)

    # ---- live state, overrides, reload ----

    async def live_state(self, request: Request, caller: Caller) -> Response:
        """Pools, queues and tenants in the store: every budget domain merged, or with
        ``?domain=`` that domain's alone (budgets.domains)."""
        snap = await self.parts.store.snapshot()
        names = list(snap.domains) or ["default"]
        domain = request.query_params.get("domain")
        if domain is not None:
            if domain not in names:
                raise ApiError(
                    404,
                    f"No budget domain {show_value(domain)}; this gateway's domains: {', '.join(names)}",
                    param="domain",
                    code="domain_not_found",
                )
            snap = snap.domains.get(domain, snap)
        pools = {
            name: {"capacity": p.capacity, "in_flight": p.in_flight, "shared": p.shared}
            for name, p in snap.pools.items()
        }
        tenants = {
            t.name: {
                "in_flight": pools.get(f"tenant:{t.name}", {}).get("in_flight", 0),
                "queued": snap.tenant_queue_depth.get(t.name, 0),
                "fair_share_counter": snap.virtual_service.get(t.name),
                "served_tokens_here": self.recent.served.get(t.name, 0),
            }
            for t in self.parts.live.current.tenants
        }
        return _json(
            {
                "version": self.parts.control.state.version,
                "domain": domain,
                "domains": names,
                "pools": pools,
                "queued_by_tier": dict(snap.queue_depth),
                "tenants": tenants,
                "leases": snap.leases,
                "requests_in_gateway": len(self.parts.exchanges),
                "recent_errors": list(self.recent.items),
            }
        )

    async def list_overrides(self, request: Request, caller: Caller) -> Response:
        state = self.parts.control.state
        return _json(
            {
                "version": state.version,
                "overrides": redacted({k: dict(v) for k, v in state.overrides.items()}),
            }
        )

    async def reset_override(self, request: Request, caller: Caller) -> Response:
        kind, name = request.path_params["kind"], request.path_params["name"]
        if kind not in KINDS:
            raise ApiError(
                404, f"Overrides are kept for {', '.join(KINDS)}; not {show_value(kind)}", code="not_found"
            )
        if name not in self.parts.control.state.overrides.get(kind, {}):
            raise ApiError(
                404,
                f"No override of {kind}/{show_value(name)}: it already follows the file",
                code="not_found",
            )
        await self.parts.control.change(
            caller, "override.reset", f"{kind}/{name}", lambda s: s.without_override(kind, name)
        )
        return _json({"reset": f"{kind}/{name}"})

    async def reload(self, request: Request, caller: Caller) -> Response:
        try:
            kept = await self.parts.control.reload(caller)
        except ConfigError as exc:
            raise ApiError(
                400, f"Reload refused, the running configuration is unchanged: {exc}", code="invalid_config"
            ) from None
        return _json({"reloaded": self.parts.control.source.path, "needs_restart": kept})

    async def openapi(self, request: Request, caller: Caller) -> Response:
        return _json(document())


def _quota_name(q: object) -> object:
    """A quota entry's name as the loader gives it (``<unit>-<window>`` when it has none)."""
    if not isinstance(q, Mapping):
        return None
    if q.get("name") is not None:
        return q["name"]
    unit = next((u for u in ("tokens", "requests", "cost") if u in q), "tokens")
    return f"{unit}-{'rolling-' if q.get('rolling') else ''}{q.get('window')}"


def _tenant_section(body: Mapping[str, Any]) -> dict[str, Any]:
    unknown = set(body) - set(_TENANT_FIELDS)
    if unknown:
        hint = "keys are managed with /admin/v1/tenants/{name}/keys; " if "keys" in unknown else ""
        raise ApiError(
            400,
            f"Unknown tenant field(s) {', '.join(sorted(unknown))}; {hint}fields: {', '.join(_TENANT_FIELDS)}",
            code="unknown_field",
        )
    return dict(body)


def _listed_keys(section: object) -> list[str]:
    if not isinstance(section, Mapping):
        return []
    keys = section.get("keys")
    return [k for k in ([keys] if isinstance(keys, str) else list(keys or [])) if isinstance(k, str)]


def _new_key(tenant: str, label: str | None) -> tuple[str, KeyRecord]:
    key = "tg-" + secrets.token_urlsafe(32)
    record = KeyRecord(
        id="key-" + secrets.token_hex(6),
        tenant=tenant,
        digest=digest(key),
        prefix=key_prefix(key),
        created_at=time.time(),
        name=label,
    )
    return key, record

"""The admin API described as an OpenAPI 3.1 document (served at ``GET /admin/v1/openapi.json``).

Written by hand next to the routes (``gateway.admin.api``) and checked in the tests: it validates as
OpenAPI 3.1, and every route the app serves is in it (and nothing else).
"""

from __future__ import annotations

from typing import Any

_ERROR = {"$ref": "#/components/responses/Error"}


def _ref(name: str) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{name}"}


def _ok(schema: dict[str, Any], description: str = "OK", status: str = "200") -> dict[str, Any]:
    return {
        status: {"description": description, "content": {"application/json": {"schema": schema}}},
        "400": _ERROR,
        "401": _ERROR,
        "403": _ERROR,
        "404": _ERROR,
        "409": _ERROR,
    }


def _body(schema: dict[str, Any], required: bool = True) -> dict[str, Any]:
    return {"required": required, "content": {"application/json": {"schema": schema}}}


def _name(what: str) -> dict[str, Any]:
    return {"name": "name", "in": "path", "required": True, "schema": {"type": "string"}, "description": what}


def _list(key: str, item: str) -> dict[str, Any]:
    return {"type": "object", "properties": {key: {"type": "array", "items": _ref(item)}}, "required": [key]}


_INT = {"type": "integer", "minimum": 0}
_NULLABLE_INT = {"type": ["integer", "null"], "minimum": 0}


def document() -> dict[str, Any]:
    quota_item: dict[str, Any] = {
        "type": "object",
        "properties": {
            "name": {"type": "string"},
            "tokens": {"type": "integer", "minimum": 1},
            "requests": {"type": "integer", "minimum": 1},
            "cost": {"type": "number", "exclusiveMinimum": 0, "description": "currency units"},
            "window": {"type": "string", "description": "minute|hour|day|week|month or <n>[smhd]"},
            "rolling": {"type": "boolean"},
            "timezone": {"type": "string"},
            "reset": {"type": "string", "description": "HH:MM local time (day/week/month)"},
            "models": {"type": "array", "items": {"type": "string"}},
            "per": {"type": "string", "enum": ["tenant", "key"]},
            "enforce": {"type": "boolean", "description": "false: shadow mode, never refuses"},
        },
        "required": ["window"],
    }
    _quota = {
        "name": "quota",
        "in": "path",
        "required": True,
        "schema": {"type": "string"},
        "description": "the quota's name",
    }
    tenant_fields: dict[str, Any] = {
        "budget_tokens": {
            **_NULLABLE_INT,
            "description": "tokens in flight at once; null: bounded by the pools",
        },
        "budget_enforce": {
            "type": "boolean",
            "description": "false: shadow mode, the budget never holds a request back; what it would have is counted",
        },
        "weight": {"type": "number", "exclusiveMinimum": 0},
        "tier": {"type": "string", "description": "highest tier the tenant may use"},
        "default_max_tokens": _NULLABLE_INT,
        "max_max_tokens": _NULLABLE_INT,
        "max_queue_len": _INT,
        "models": {"type": "array", "items": {"type": "string"}, "description": "model globs; empty: all"},
        "server_tools": {
            "type": ["array", "null"],
            "items": {"type": "string"},
            "description": "server-run Responses tools it may use (code_interpreter, mcp:<label>, mcp:*); "
            "[]: none; null: any the engine runs",
        },
        "quotas": {
            "type": "array",
            "description": "token and cost quotas over time (docs/quotas.md); replaced as a whole",
            "items": quota_item,
        },
    }
    backend: dict[str, Any] = {
        "type": "object",
        "properties": {
            "url": {"type": "string"},
            "capacity_tokens": {"type": "integer", "minimum": 1},
            "models": {"type": "array", "items": {"type": "string"}},
            "name": {"type": "string"},
            "draining": {"type": "boolean"},
            "accepts_priority": {"type": "boolean"},
            "max_num_seqs": {"type": ["integer", "null"], "minimum": 1},
            "cache_salt": {
                "enum": ["client", "tenant"],
                "description": "tenant: no two tenants share the prefix cache",
            },
            "tenant_header": {
                "type": ["string", "null"],
                "description": "a header set to the tenant's name on every request (llm-d fairness id)",
            },
            "request_id_header": {
                "type": ["string", "boolean"],
                "description": "the header carrying the request id upstream (default x-request-id); none: not sent",
            },
            "probe": {
                "type": ["string", "boolean", "object", "null"],
                "properties": {"path": {"type": "string"}, "method": {"enum": ["GET", "HEAD"]}},
                "description": "the health probe: off, a path (GET), or {path, method}; "
                "default GET /health, else /v1/models",
            },
            "api_key": {"type": ["string", "null"]},
            "timeouts": {
                "type": "object",
                "properties": {"connect_s": {"type": "number"}, "read_s": {"type": "number"}},
            },
        },
        "required": ["url"],
    }
    schemas: dict[str, Any] = {
        "Error": {
            "type": "object",
            "properties": {
                "error": {
                    "type": "object",
                    "properties": {
                        "message": {"type": "string"},
                        "type": {"type": "string"},
                        "param": {"type": ["string", "null"]},
                        "code": {"type": ["string", "null"]},
                    },
                    "required": ["message", "type"],
                }
            },
            "required": ["error"],
        },
        "TenantInput": {"type": "object", "properties": tenant_fields, "additionalProperties": False},
        "NewTenant": {
            "type": "object",
            "properties": {"name": {"type": "string", "pattern": "^[A-Za-z0-9_.\\-]+$"}, **tenant_fields},
            "required": ["name"],
            "additionalProperties": False,
        },
        "Tenant": {
            "type": "object",
            "properties": {"name": {"type": "string"}, **tenant_fields, "source": {"type": "string"}},
            "required": ["name", "source"],
        },
        "Key": {
            "type": "object",
            "properties": {
                "id": {"type": "string"},
                "tenant": {"type": "string"},
                "prefix": {"type": ["string", "null"], "description": "the key's first characters"},
                "source": {"type": "string", "enum": ["admin", "config"]},
                "name": {"type": ["string", "null"]},
                "created_at": {"type": "number"},
                "expires_at": {"type": ["number", "null"]},
                "revoked_at": {"type": ["number", "null"]},
            },
            "required": ["id", "tenant", "source"],
        },
        "NewKey": {
            "allOf": [
                _ref("Key"),
                {
                    "type": "object",
                    "properties": {
                        "key": {"type": "string", "description": "shown once; stored only as a hash"}
                    },
                    "required": ["key"],
                },
            ]
        },
        "BackendInput": backend,
        "Backend": {
            "type": "object",
            "properties": {
                **backend["properties"],
                "healthy": {"type": "boolean"},
                "in_flight_tokens": {"type": "integer"},
                "in_flight_requests": {"type": "integer"},
            },
        },
        "Pool": {
            "type": "object",
            "properties": {
                "name": {"type": "string"},
                "budget_tokens": _NULLABLE_INT,
                "capacity_tokens": {"type": "integer"},
                "source": {"type": "string"},
                "backends": {"type": "array", "items": _ref("Backend")},
            },
            "required": ["name", "capacity_tokens", "backends"],
        },
        "Tier": {
            "type": "object",
            "properties": {
                "name": {"type": "string"},
                "rank": _INT,
                "ceiling": {"type": "number", "exclusiveMinimum": 0, "maximum": 1},
                "max_queue_wait_s": {"type": "number", "minimum": 0},
                "ceiling_enforce": {
                    "type": "boolean",
                    "description": "false: shadow mode, counted, never enforced",
                },
                "source": {"type": "string"},
            },
        },
        "TierInput": {
            "type": "object",
            "properties": {
                "rank": _INT,
                "ceiling": {"type": "number", "exclusiveMinimum": 0, "maximum": 1},
                "max_queue_wait_s": {"type": "number", "minimum": 0},
                "ceiling_enforce": {
                    "type": "boolean",
                    "description": "false: shadow mode, counted, never enforced",
                },
            },
            "required": ["rank"],
            "additionalProperties": False,
        },
        "State": {
            "type": "object",
            "description": "live state: per pool and tenant in flight, queued, fair-share counters, recent errors",
            "properties": {
                "version": {"type": "integer"},
                "domain": {
                    "type": ["string", "null"],
                    "description": "the budget domain shown (null: every domain merged)",
                },
                "domains": {"type": "array", "items": {"type": "string"}},
                "pools": {"type": "object", "additionalProperties": {"type": "object"}},
                "queued_by_tier": {"type": "object", "additionalProperties": {"type": "integer"}},
                "tenants": {"type": "object", "additionalProperties": {"type": "object"}},
                "leases": {"type": "integer"},
                "requests_in_gateway": {"type": "integer"},
                "recent_errors": {"type": "array", "items": {"type": "object"}},
            },
        },
    }
    paths: dict[str, Any] = {
        "/admin/v1/openapi.json": {"get": {"summary": "This document", "responses": _ok({"type": "object"})}},
        "/admin/v1/tenants": {
            "get": {"summary": "List tenants", "responses": _ok(_list("tenants", "Tenant"))},
            "post": {
                "summary": "Create a tenant",
                "requestBody": _body(_ref("NewTenant")),
                "responses": _ok(_ref("Tenant"), "Created", "201"),
            },
        },
        "/admin/v1/tenants/{name}": {
            "parameters": [_name("tenant")],
            "get": {"summary": "Read a tenant", "responses": _ok(_ref("Tenant"))},
            "patch": {
                "summary": "Change a tenant's budget, weight, tier, limits or models",
                "requestBody": _body(_ref("TenantInput")),
                "responses": _ok(_ref("Tenant")),
            },
            "delete": {
                "summary": "Delete a tenant: new requests refused at once, running ones finish",
                "responses": _ok({"type": "object"}),
            },
        },
        "/admin/v1/tenants/{name}/quotas": {
            "parameters": [_name("tenant")],
            "get": {
                "summary": "A tenant's quotas: each window now, used, reserved and remaining",
                "responses": _ok({"type": "object"}),
            },
        },
        "/admin/v1/tenants/{name}/quotas/{quota}": {
            "parameters": [_name("tenant"), _quota],
            "put": {
                "summary": "Add the quota by this name or replace it (its use carries over while its window is the same)",
                "requestBody": _body(quota_item),
                "responses": _ok(_ref("Tenant")),
            },
            "delete": {"summary": "Remove the quota", "responses": _ok(_ref("Tenant"))},
        },
        "/admin/v1/tenants/{name}/quotas/{quota}/reset": {
            "parameters": [
                _name("tenant"),
                _quota,
                {
                    "name": "key",
                    "in": "query",
                    "required": False,
                    "schema": {"type": "string"},
                    "description": "a per-key quota: the key id whose window to reset (default: every key's)",
                },
            ],
            "post": {
                "summary": "Forget what the quota's window used, on every replica (running requests keep their reservations)",
                "responses": _ok(
                    {
                        "type": "object",
                        "properties": {
                            "tenant": {"type": "string"},
                            "reset": {"type": "string"},
                            "forgotten": {"type": "number"},
                            "unit": {"type": "string"},
                        },
                    }
                ),
            },
        },
        "/admin/v1/prices": {
            "get": {
                "summary": "Every model glob of the config and its price (null: none)",
                "responses": _ok({"type": "object"}),
            },
            "put": {
                "summary": "Price a model glob (currency per 1M tokens); a new glob is added last",
                "requestBody": _body(
                    {
                        "type": "object",
                        "properties": {
                            "model": {"type": "string"},
                            "input": {"type": "number", "minimum": 0},
                            "output": {"type": "number", "minimum": 0},
                            "cached_input": {"type": "number", "minimum": 0},
                        },
                        "required": ["model", "input", "output"],
                    }
                ),
                "responses": _ok({"type": "object"}),
            },
            "delete": {
                "summary": "Remove a model glob's price",
                "parameters": [
                    {"name": "model", "in": "query", "required": True, "schema": {"type": "string"}}
                ],
                "responses": _ok({"type": "object"}),
            },
        },
        "/admin/v1/usage": {
            "get": {
                "summary": "Usage for billing over a time range: requests, prompt/cached/completion tokens and cost "
                "per period, tenant, key and model",
                "parameters": [
                    {
                        "name": "from",
                        "in": "query",
                        "required": False,
                        "schema": {"type": "string"},
                        "description": "ISO 8601 date/time or epoch seconds (default: this month's start, UTC); rounded down to the hour",
                    },
                    {
                        "name": "to",
                        "in": "query",
                        "required": False,
                        "schema": {"type": "string"},
                        "description": "exclusive end, as from (default: now)",
                    },
                    {
                        "name": "tenant",
                        "in": "query",
                        "required": False,
                        "schema": {"type": "string"},
                        "description": "one tenant's rows",
                    },
                    {
                        "name": "by",
                        "in": "query",
                        "required": False,
                        "schema": {"type": "string", "enum": ["hour", "day", "month"]},
                        "description": "period of a row (default day, UTC)",
                    },
                    {
                        "name": "format",
                        "in": "query",
                        "required": False,
                        "schema": {"type": "string", "enum": ["json", "csv"]},
                        "description": "json (default) or csv",
                    },
                ],
                "responses": {
                    "200": {
                        "description": "OK",
                        "content": {
                            "application/json": {"schema": {"type": "object"}},
                            "text/csv": {"schema": {"type": "string"}},
                        },
                    }
                },
            },
        },
        "/admin/v1/tenants/{name}/keys": {
            "parameters": [_name("tenant")],
            "get": {
                "summary": "List a tenant's API keys (prefixes and metadata, never the keys)",
                "responses": _ok(_list("keys", "Key")),
            },
            "post": {
                "summary": "Create an API key (returned once)",
                "requestBody": _body(
                    {"type": "object", "properties": {"name": {"type": "string"}}}, required=False
                ),
                "responses": _ok(_ref("NewKey"), "Created", "201"),
            },
        },
        "/admin/v1/keys/{key_id}": {
            "parameters": [{"name": "key_id", "in": "path", "required": True, "schema": {"type": "string"}}],
            "delete": {
                "summary": "Revoke a key: its new requests are refused at once",
                "responses": _ok(_ref("Key")),
            },
        },
        "/admin/v1/keys/{key_id}/rotate": {
            "parameters": [{"name": "key_id", "in": "path", "required": True, "schema": {"type": "string"}}],
            "post": {
                "summary": "Replace a key; the old one stays valid for overlap_s",
                "requestBody": _body(
                    {
                        "type": "object",
                        "properties": {"overlap_s": {"type": "number", "minimum": 0, "maximum": 2592000}},
                    },
                    required=False,
                ),
                "responses": _ok(_ref("NewKey"), "Created", "201"),
            },
        },
        "/admin/v1/pools": {
            "get": {
                "summary": "List pools with their backends' live state",
                "responses": _ok(_list("pools", "Pool")),
            }
        },
        "/admin/v1/pools/{name}": {
            "parameters": [_name("pool")],
            "get": {"summary": "Read a pool", "responses": _ok(_ref("Pool"))},
            "patch": {
                "summary": "Set the pool's budget (null: the sum of its backends' capacities)",
                "requestBody": _body(
                    {
                        "type": "object",
                        "properties": {"budget_tokens": _NULLABLE_INT},
                        "additionalProperties": False,
                    }
                ),
                "responses": _ok(_ref("Pool")),
            },
        },
        "/admin/v1/pools/{name}/backends": {
            "parameters": [_name("pool")],
            "post": {
                "summary": "Add a backend",
                "requestBody": _body(_ref("BackendInput")),
                "responses": _ok(_ref("Pool")),
            },
            "patch": {
                "summary": "Change a backend (by url): drain it, resize it",
                "requestBody": _body(_ref("BackendInput")),
                "responses": _ok(_ref("Pool")),
            },
            "delete": {
                "summary": "Remove a backend (by url); requests running on it finish",
                "parameters": [
                    {"name": "url", "in": "query", "required": True, "schema": {"type": "string"}}
                ],
                "responses": _ok(_ref("Pool")),
            },
        },
        "/admin/v1/tiers": {"get": {"summary": "List tiers", "responses": _ok(_list("tiers", "Tier"))}},
        "/admin/v1/tiers/{name}": {
            "parameters": [_name("tier")],
            "put": {
                "summary": "Create or replace a tier",
                "requestBody": _body(_ref("TierInput")),
                "responses": _ok(_list("tiers", "Tier")),
            },
            "delete": {"summary": "Delete a tier", "responses": _ok(_list("tiers", "Tier"))},
        },
        "/admin/v1/state": {
            "get": {
                "summary": "Live state of pools and tenants",
                "parameters": [
                    {
                        "name": "domain",
                        "in": "query",
                        "required": False,
                        "description": "one budget domain (store.domains); default: all merged",
                        "schema": {"type": "string"},
                    }
                ],
                "responses": _ok(_ref("State")),
            }
        },
        "/admin/v1/overrides": {
            "get": {
                "summary": "What the admin API changed over the config file",
                "responses": _ok({"type": "object"}),
            }
        },
        "/admin/v1/overrides/{kind}/{name}": {
            "parameters": [
                {
                    "name": "kind",
                    "in": "path",
                    "required": True,
                    "schema": {"type": "string", "enum": ["tenants", "pools", "tiers", "models"]},
                },
                _name("object"),
            ],
            "delete": {
                "summary": "Drop an override: the object follows the config file again",
                "responses": _ok({"type": "object"}),
            },
        },
        "/admin/v1/reload": {
            "post": {
                "summary": "Re-read the config file and apply it live (a bad file changes nothing)",
                "responses": _ok({"type": "object"}),
            }
        },
    }
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "tokengate admin API",
            "version": "1",
            "description": "Operate tokengate live: tenants, API keys, pools, tiers, state. "
            "Admin tokens: TOKENGATE_ADMIN_TOKEN (admin) and TOKENGATE_READONLY_TOKEN (read).",
        },
        "security": [{"bearer": []}],
        "paths": paths,
        "components": {
            "schemas": schemas,
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
            "responses": {
                "Error": {
                    "description": "An error in OpenAI's shape",
                    "content": {"application/json": {"schema": _ref("Error")}},
                }
            },
        },
    }

"""``tokengate admin``: the admin API (``/admin/v1``) from the command line, against a running gateway.

Tables for people, ``--json`` (the API's own answer) for scripts. The gateway's URL comes from
``--url``, else ``TOKENGATE_ADMIN_URL``, else http://127.0.0.1:8080; the token from ``--token``, else
``TOKENGATE_ADMIN_TOKEN``, else ``TOKENGATE_READONLY_TOKEN`` (enough for the read commands).

Exit status: 0 done; 1 the API refused (its message is printed); 2 a usage error; 3 the gateway
could not be reached. No key is ever printed but the one ``keys create`` / ``keys rotate`` returns.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote

import httpx
import orjson

from gateway.admin import render
from gateway.admin.tokens import ADMIN_ENV, READONLY_ENV
from gateway.admin.usage_export import as_csv

URL_ENV = "TOKENGATE_ADMIN_URL"
DEFAULT_URL = "http://127.0.0.1:9091"  # the ops listener (ops.host:ops.port)
PREFIX = "/admin/v1"

_EPILOG = f"""\
examples:
  tokengate admin tenants list
  tokengate admin tenants create newco --budget-tokens 20000 --tier batch
  tokengate admin keys create newco --name ci
  tokengate admin quotas set newco daily --tokens 5000000 --window day
  tokengate admin quotas show newco
  tokengate admin usage --from 2026-11-01 --to 2026-12-01 --by month --csv > november.csv
  tokengate admin pools drain default --url http://10.0.0.7:8000
  tokengate admin --json state | jq .pools

environment: {URL_ENV} (default {DEFAULT_URL}), {ADMIN_ENV}, {READONLY_ENV}
exit status: 0 done, 1 refused by the API, 2 usage error, 3 gateway unreachable
"""


class Failed(Exception):
    """Ends the command with a message on stderr and an exit status."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status


_CLEAR = object()  # a flag given as "none": send null (back to the default)


def _count(text: str) -> object:
    """A non-negative integer, or ``none`` to clear the setting."""
    if text.lower() in ("none", "null"):
        return _CLEAR
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number or 'none', got {text!r}") from None
    if n < 0:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 0, got {n}")
    return n


def _globs(text: str) -> list[str]:
    return [g.strip() for g in text.split(",") if g.strip()]


def _tools(text: str) -> object:
    return _CLEAR if text.strip().lower() == "any" else _globs(text)


def _segment(name: str) -> str:
    if name in (".", ".."):
        raise Failed(f"{name!r} is not a name", 2)
    return quote(name, safe="")


# ---- arguments ----


def _add_common(p: argparse.ArgumentParser, url: bool = True) -> None:
    """Accepted before or after the command (SUPPRESS: a later parser never overwrites them). The
    backend commands take a backend's --url: there the gateway's goes before the command."""
    if url:
        p.add_argument(
            "--url",
            default=argparse.SUPPRESS,
            help=f"the gateway's base URL (default: ${URL_ENV}, else {DEFAULT_URL})",
        )
    p.add_argument(
        "--token",
        default=argparse.SUPPRESS,
        help=f"admin or read-only token (default: ${ADMIN_ENV}, else ${READONLY_ENV}); "
        "the environment keeps it out of the process list",
    )
    p.add_argument(
        "--json", action="store_true", default=argparse.SUPPRESS, help="print the API's JSON answer"
    )
    p.add_argument(
        "--timeout", type=float, default=argparse.SUPPRESS, help="seconds to wait for an answer (default 10)"
    )


def _switch(text: str) -> bool:
    """``true`` or ``false``."""
    if text.lower() in ("true", "yes", "on", "1"):
        return True
    if text.lower() in ("false", "no", "off", "0"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def _tenant_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--budget-tokens", type=_count, help="tokens in flight at once ('none': pools only)")
    p.add_argument(
        "--budget-enforce",
        type=_switch,
        metavar="true|false",
        help="false: shadow mode, the budget never holds a request back; what it would have is counted",
    )
    p.add_argument("--weight", type=float, help="fair-share weight")
    p.add_argument("--tier", help="the highest tier the tenant may use")
    p.add_argument("--default-max-tokens", type=_count, help="reservation when a request names no limit")
    p.add_argument("--max-max-tokens", type=_count, help="larger max_tokens per choice is a 400")
    p.add_argument("--max-queue-len", type=_count, help="waiting requests before 429")
    p.add_argument("--models", type=_globs, help="model globs, comma-separated ('' : every model)")
    p.add_argument(
        "--server-tools",
        type=_tools,
        help="server-run Responses tools it may use, comma-separated (code_interpreter, mcp:<label>, "
        "mcp:*); '' : none; 'any': whatever the engine runs",
    )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = "Operate a running gateway through its admin API (/admin/v1)."
    parser.epilog = _EPILOG
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    _add_common(parser)
    groups = parser.add_subparsers(dest="group", metavar="GROUP", required=True)

    def group(name: str, help_text: str) -> argparse._SubParsersAction[argparse.ArgumentParser]:
        g = groups.add_parser(name, help=help_text, description=help_text)
        return g.add_subparsers(dest="action", metavar="ACTION", required=True)

    def action(
        sub: argparse._SubParsersAction[argparse.ArgumentParser],
        name: str,
        help_text: str,
        gateway_url: bool = True,
    ) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help_text, description=help_text)
        _add_common(p, url=gateway_url)
        return p

    t = group("tenants", "tenants: budgets, weights, tiers, limits, model allowlists")
    action(t, "list", "list tenants")
    action(t, "get", "show one tenant").add_argument("name")
    p = action(t, "create", "create a tenant (then give it a key: keys create)")
    p.add_argument("name")
    _tenant_flags(p)
    p = action(t, "update", "change a tenant; flags not given keep their value, 'none' clears one")
    p.add_argument("name")
    _tenant_flags(p)
    action(t, "delete", "delete a tenant: its new requests are refused at once").add_argument("name")

    k = group("keys", "API keys: list, create, revoke, rotate")
    action(k, "list", "list a tenant's keys (prefixes, never the keys)").add_argument("tenant")
    p = action(k, "create", "create a key for a tenant (printed once)")
    p.add_argument("tenant")
    p.add_argument("--name", help="a label for the key")
    action(k, "revoke", "revoke a key: its new requests are refused at once").add_argument("id")
    p = action(k, "rotate", "replace a key; the old one stays valid for --overlap-s")
    p.add_argument("id")
    p.add_argument("--overlap-s", type=float, help="seconds the old key keeps working (default 3600)")

    q = group("quotas", "a tenant's quotas over time: their use now, set, delete, reset")
    action(q, "show", "each quota's window now: used, reserved, remaining").add_argument("tenant")
    p = action(q, "set", "add a quota, or replace the one by this name (its use carries over)")
    p.add_argument("tenant")
    p.add_argument("name")
    limit = p.add_mutually_exclusive_group(required=True)
    limit.add_argument("--tokens", type=int, help="tokens per window")
    limit.add_argument("--requests", type=int, help="requests per window")
    limit.add_argument("--cost", type=float, help="currency per window (models' prices)")
    p.add_argument("--window", required=True, help="minute, hour, day, week, month, or <n>[smhd]")
    p.add_argument("--rolling", action="store_true", help="the last --window at any moment")
    p.add_argument("--timezone", help="IANA time zone of calendar windows (default UTC)")
    p.add_argument("--reset", dest="reset_at", help="HH:MM local time day/week/month windows start")
    p.add_argument("--models", type=_globs, help="model globs it counts, comma-separated (default: all)")
    p.add_argument("--per", choices=["tenant", "key"], help="key: each API key a window of its own")
    p.add_argument("--enforce", type=_switch, metavar="true|false", help="false: shadow mode")
    p = action(q, "delete", "remove a quota")
    p.add_argument("tenant")
    p.add_argument("name")
    p = action(
        q, "reset", "forget what the quota's window used (every replica; running requests keep theirs)"
    )
    p.add_argument("tenant")
    p.add_argument("name")
    p.add_argument("--key", help="one key's window of a per-key quota (its id; default every key's)")

    pr = group("prices", "model prices (currency per 1M tokens) for cost quotas and the usage export")
    action(pr, "list", "every model glob and its price")
    p = action(pr, "set", "price a model glob")
    p.add_argument("model", help="a model glob of the config, or a new one (added last)")
    p.add_argument("--input", type=float, required=True, help="per 1M prompt tokens")
    p.add_argument("--output", type=float, required=True, help="per 1M output tokens")
    p.add_argument("--cached-input", type=float, help="per 1M cached prompt tokens (default: --input)")
    action(pr, "delete", "remove a model glob's price").add_argument("model")

    p = groups.add_parser(
        "usage",
        help="usage for billing over a time range, per tenant, key and model (table, --csv or --json)",
        description="Usage for billing: requests, tokens and cost per period, tenant, key and model.",
    )
    _add_common(p)
    p.add_argument(
        "--from", dest="since", help="ISO date/time or epoch seconds (default: this month's start, UTC)"
    )
    p.add_argument("--to", dest="until", help="ISO date/time or epoch seconds, exclusive (default: now)")
    p.add_argument("--tenant", help="one tenant's usage")
    p.add_argument(
        "--by", choices=["hour", "day", "month"], default="day", help="period of a row (default day)"
    )
    p.add_argument("--csv", action="store_true", help="print CSV (a header and a line per row)")

    pl = group("pools", "backend pools and their backends")
    action(pl, "list", "list pools and backends with their live load")
    action(pl, "get", "show one pool").add_argument("name")
    p = action(pl, "set", "set a pool's budget ('none': the sum of its backends' capacities)")
    p.add_argument("name")
    p.add_argument("--budget-tokens", type=_count, required=True)
    p = action(pl, "add-backend", "add a backend to a pool", gateway_url=False)
    p.add_argument("pool")
    p.add_argument("--url", dest="backend_url", required=True, help="the backend's base URL")
    p.add_argument("--capacity-tokens", type=int, required=True)
    p.add_argument("--models", type=_globs, help="models it serves, comma-separated (default: any)")
    p.add_argument("--name", help="name in metrics and logs (default: the URL)")
    p = action(pl, "resize-backend", "change a backend's capacity", gateway_url=False)
    p.add_argument("pool")
    p.add_argument("--url", dest="backend_url", required=True)
    p.add_argument("--capacity-tokens", type=int, required=True)
    for name, help_text in (
        ("drain", "stop sending a backend new requests; those in flight finish"),
        ("undrain", "send a drained backend requests again"),
        ("remove-backend", "remove a backend (drain it first); requests on it finish"),
    ):
        p = action(pl, name, help_text, gateway_url=False)
        p.add_argument("pool")
        p.add_argument("--url", dest="backend_url", required=True, help="the backend's base URL")

    ti = group("tiers", "priority tiers")
    action(ti, "list", "list tiers")
    p = action(ti, "set", "create or replace a tier")
    p.add_argument("name")
    p.add_argument("--rank", type=int, required=True, help="lower ranks are granted first")
    p.add_argument("--ceiling", type=float, help="share of a shared pool the tier may fill (default 1.0)")
    p.add_argument("--max-queue-wait-s", type=float, help="longest wait in the queue (default 60)")
    p.add_argument(
        "--ceiling-enforce",
        type=_switch,
        metavar="true|false",
        help="false: shadow mode (counted, never enforced)",
    )
    action(ti, "delete", "delete a tier (refused while a tenant or class uses it)").add_argument("name")

    groups.add_parser("state", help="live state: pools, tenants, queues, recent errors")
    _add_common(groups.choices["state"])
    groups.choices["state"].add_argument(
        "--domain", help="one budget domain's pools, tenants and queues (store.domains; default: all merged)"
    )
    o = group("overrides", "what the admin API changed over the config file")
    action(o, "list", "list overrides (they win over the config file until reset)")
    p = action(o, "reset", "drop an override: the object follows the config file again")
    p.add_argument("kind", choices=["tenants", "pools", "tiers", "models"])
    p.add_argument("name")
    groups.add_parser("reload", help="re-read the config file (like SIGHUP)")
    _add_common(groups.choices["reload"])


# ---- talking to the gateway ----


@dataclass
class Admin:
    http: httpx.Client
    url: str

    def call(
        self,
        method: str,
        path: str,
        body: Mapping[str, Any] | None = None,
        params: Mapping[str, str] | None = None,
    ) -> Any:
        try:
            r = self.http.request(method, PREFIX + path, json=body, params=params)
        except httpx.ConnectError as exc:
            raise Failed(
                f"cannot connect to {self.url}: {_reason(exc)}\n"
                f"hint: is the gateway running there? Point the CLI at it with --url or {URL_ENV}.",
                3,
            ) from None
        except httpx.TimeoutException:
            raise Failed(f"{self.url} did not answer in time (--timeout)", 3) from None
        except httpx.TransportError as exc:
            raise Failed(f"cannot talk to {self.url}: {_reason(exc)}", 3) from None
        if r.status_code >= 400:
            raise Failed(_api_error(r, self.url), 1)
        try:
            return r.json()
        except ValueError:
            raise Failed(f"{self.url} answered {r.status_code} with something that is not JSON", 1) from None


def _reason(exc: Exception) -> str:
    text = str(exc) or type(exc).__name__
    return "connection refused" if "refused" in text.lower() else text


def _api_error(r: httpx.Response, url: str) -> str:
    try:
        error = r.json()["error"]
        message, code = str(error["message"]), error.get("code")
    except (ValueError, KeyError, TypeError):
        message, code = f"HTTP {r.status_code}: {r.text[:300] or r.reason_phrase}", None
    if code == "admin_api_off":
        message += (
            "\nhint: the token goes into the gateway's environment (or admin.tokens_file) "
            "and takes effect when the gateway starts; docs/admin.md"
        )
    elif code == "tenant_exists":
        message += "\nhint: change it with: tokengate admin tenants update NAME --budget-tokens N ..."
    elif r.status_code == 404 and code in (None, "unknown_route"):
        # Not an answer of the admin API: another server, or a gateway without it.
        message += f"\nhint: is {url} a tokengate gateway with the admin API? Set --url or {URL_ENV}."
    return message


# ---- commands ----

Out = Callable[[Any], str]


def _body(args: argparse.Namespace, fields: Mapping[str, str]) -> dict[str, Any]:
    """The flags that were given, as API fields ('none' -> null)."""
    body: dict[str, Any] = {}
    for flag, field in fields.items():
        value = getattr(args, flag, None)
        if value is not None:
            body[field] = None if value is _CLEAR else value
    return body


_TENANT_FLAGS = {
    "budget_tokens": "budget_tokens",
    "budget_enforce": "budget_enforce",
    "weight": "weight",
    "tier": "tier",
    "default_max_tokens": "default_max_tokens",
    "max_max_tokens": "max_max_tokens",
    "max_queue_len": "max_queue_len",
    "models": "models",
    "server_tools": "server_tools",
}


def _request(args: argparse.Namespace) -> tuple[str, str, dict[str, Any] | None, dict[str, str] | None, Out]:
    """The HTTP call a command makes, and how its answer is shown: (method, path, body, query, render)."""
    g, a = args.group, getattr(args, "action", None)
    if g == "tenants":
        if a == "list":
            return "GET", "/tenants", None, None, lambda d: render.tenants(d["tenants"])
        name = _segment(args.name)
        if a == "get":
            return "GET", f"/tenants/{name}", None, None, render.tenant
        if a == "create":
            body = {"name": args.name, **_body(args, _TENANT_FLAGS)}
            return "POST", "/tenants", body, None, lambda d: "Created.\n" + render.tenant(d)
        if a == "update":
            body = _body(args, _TENANT_FLAGS)
            if not body:
                raise Failed("tenants update: give at least one setting, e.g. --budget-tokens 20000", 2)
            return "PATCH", f"/tenants/{name}", body, None, lambda d: "Updated.\n" + render.tenant(d)
        return (
            "DELETE",
            f"/tenants/{name}",
            None,
            None,
            lambda d: f"Deleted tenant {d['deleted']}: its new requests are refused; running ones finish.",
        )
    if g == "keys":
        if a == "list":
            return (
                "GET",
                f"/tenants/{_segment(args.tenant)}/keys",
                None,
                None,
                lambda d: render.keys(d["keys"]),
            )
        if a == "create":
            body = {} if args.name is None else {"name": args.name}
            path = f"/tenants/{_segment(args.tenant)}/keys"
            return "POST", path, body, None, lambda d: render.new_key(d, "Created")
        kid = _segment(args.id)
        if a == "revoke":
            return (
                "DELETE",
                f"/keys/{kid}",
                None,
                None,
                lambda d: f"Revoked key {d['id']} of tenant {d['tenant']}: its new requests are refused.",
            )
        body = {} if args.overlap_s is None else {"overlap_s": args.overlap_s}
        return "POST", f"/keys/{kid}/rotate", body, None, lambda d: render.new_key(d, "Rotated: new")
    if g == "quotas":
        base = f"/tenants/{_segment(args.tenant)}/quotas"
        if a == "show":
            return "GET", base, None, None, render.quotas
        name = _segment(args.name)
        if a == "set":
            body = _body(
                args,
                {
                    "tokens": "tokens",
                    "requests": "requests",
                    "cost": "cost",
                    "window": "window",
                    "timezone": "timezone",
                    "reset_at": "reset",
                    "models": "models",
                    "per": "per",
                    "enforce": "enforce",
                },
            )
            if args.rolling:
                body["rolling"] = True
            return "PUT", f"{base}/{name}", body, None, lambda d: "Set.\n" + render.tenant(d)
        if a == "delete":
            return "DELETE", f"{base}/{name}", None, None, lambda d: "Deleted.\n" + render.tenant(d)
        query = {"key": args.key} if args.key else None
        return (
            "POST",
            f"{base}/{name}/reset",
            None,
            query,
            lambda d: (
                f"Reset quota {d['reset']} of {d['tenant']}: {d['forgotten']:,} {d['unit']} of use forgotten."
            ),
        )
    if g == "pools":
        if a == "list":
            return "GET", "/pools", None, None, lambda d: render.pools(d["pools"])
        if a == "get":
            return "GET", f"/pools/{_segment(args.name)}", None, None, render.pool
        if a == "set":
            body = _body(args, {"budget_tokens": "budget_tokens"})
            return "PATCH", f"/pools/{_segment(args.name)}", body, None, render.pool
        path = f"/pools/{_segment(args.pool)}/backends"
        url = args.backend_url
        if a == "add-backend":
            body = {"url": url, "capacity_tokens": args.capacity_tokens}
            body.update(_body(args, {"models": "models", "name": "name"}))
            return "POST", path, body, None, render.pool
        if a == "resize-backend":
            return "PATCH", path, {"url": url, "capacity_tokens": args.capacity_tokens}, None, render.pool
        if a in ("drain", "undrain"):
            return "PATCH", path, {"url": url, "draining": a == "drain"}, None, render.pool
        return "DELETE", path, None, {"url": url}, render.pool
    if g == "tiers":
        if a == "list":
            return "GET", "/tiers", None, None, lambda d: render.tiers(d["tiers"])
        name = _segment(args.name)
        if a == "set":
            body = {
                "rank": args.rank,
                **_body(
                    args,
                    {
                        "ceiling": "ceiling",
                        "max_queue_wait_s": "max_queue_wait_s",
                        "ceiling_enforce": "ceiling_enforce",
                    },
                ),
            }
            return "PUT", f"/tiers/{name}", body, None, lambda d: render.tiers(d["tiers"])
        return "DELETE", f"/tiers/{name}", None, None, lambda d: render.tiers(d["tiers"])
    if g == "prices":
        if a == "list":
            return "GET", "/prices", None, None, render.prices
        if a == "set":
            body = {"model": args.model, "input": args.input, "output": args.output}
            body.update(_body(args, {"cached_input": "cached_input"}))
            return "PUT", "/prices", body, None, render.prices
        return "DELETE", "/prices", None, {"model": args.model}, render.prices
    if g == "usage":
        query = {"by": args.by}
        for flag, name in (("since", "from"), ("until", "to"), ("tenant", "tenant")):
            if getattr(args, flag, None):
                query[name] = getattr(args, flag)
        return "GET", "/usage", None, query, (lambda d: as_csv(d).rstrip("\n")) if args.csv else render.usage
    if g == "state":
        query = {"domain": args.domain} if getattr(args, "domain", None) else None
        return "GET", "/state", None, query, render.state
    if g == "overrides":
        if a == "list":
            return "GET", "/overrides", None, None, render.overrides
        path = f"/overrides/{_segment(args.kind)}/{_segment(args.name)}"
        return "DELETE", path, None, None, lambda d: f"{d['reset']} follows the config file again."
    return "POST", "/reload", None, None, _reloaded


def _reloaded(d: Mapping[str, Any]) -> str:
    text = f"Reloaded {d.get('reloaded')}; the admin API's overrides still apply over it."
    if d.get("needs_restart"):
        text += f"\nChanged but kept until a restart: {', '.join(d['needs_restart'])}"
    return text


def run(args: argparse.Namespace) -> int:
    url = (getattr(args, "url", None) or os.environ.get(URL_ENV) or DEFAULT_URL).rstrip("/")
    url = url.removesuffix(PREFIX)
    token = getattr(args, "token", None) or os.environ.get(ADMIN_ENV) or os.environ.get(READONLY_ENV)
    try:
        if not token:
            raise Failed(f"no admin token: pass --token or set {ADMIN_ENV} (or {READONLY_ENV} to read)", 2)
        method, path, body, params, show = _request(args)
        with httpx.Client(
            base_url=url,
            headers={"authorization": f"Bearer {token}"},
            timeout=getattr(args, "timeout", 10.0),
        ) as http:
            data = Admin(http, url).call(method, path, body, params)
    except Failed as exc:
        print(f"tokengate admin: {exc}", file=sys.stderr)
        return exc.status
    if getattr(args, "json", False):
        sys.stdout.write(orjson.dumps(data, option=orjson.OPT_INDENT_2).decode() + "\n")
    else:
        sys.stdout.write(show(data) + "\n")
    return 0

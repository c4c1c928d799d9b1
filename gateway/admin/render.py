"""How ``tokengate admin`` shows the admin API's answers to a person: aligned tables and short lines.

Pure functions from the API's JSON to text, so the CLI's output is the API's data and nothing else.
A key is never shown here except the one a create or rotate returns (``new_key``); backend
``api_key`` values inside overrides are masked.
"""

from __future__ import annotations

import textwrap
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import yaml

_MASK = "***"


def cell(value: object) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, list | tuple):
        return ",".join(str(v) for v in value) if value else "-"
    return str(value)


def _numeric(values: Sequence[object]) -> bool:
    present = [v for v in values if v is not None]
    return bool(present) and all(isinstance(v, int | float) and not isinstance(v, bool) for v in present)


def table(headers: Sequence[str], rows: Iterable[Sequence[object]], empty: str = "(none)") -> str:
    """Columns aligned, numbers to the right; ``empty`` when there are no rows."""
    raw = [list(r) for r in rows]
    if not raw:
        return empty
    text = [[cell(v) for v in r] for r in raw]
    right = [_numeric([r[i] for r in raw]) for i in range(len(headers))]
    widths = [max(len(h), *(len(r[i]) for r in text)) for i, h in enumerate(headers)]

    def line(cells: Sequence[str]) -> str:
        parts = [c.rjust(w) if r else c.ljust(w) for c, w, r in zip(cells, widths, right, strict=True)]
        return "  ".join(parts).rstrip()

    return "\n".join([line(headers), line(["-" * w for w in widths]), *(line(r) for r in text)])


def when(ts: float | None) -> str:
    if ts is None:
        return "-"
    return time.strftime("%Y-%m-%d %H:%M:%SZ", time.gmtime(ts))


def _models(models: Sequence[str] | None) -> str:
    return ",".join(models) if models else "(all)"


# ---- tenants ----

_TENANT_COLUMNS = (
    "name",
    "budget_tokens",
    "weight",
    "tier",
    "default_max_tokens",
    "max_max_tokens",
    "max_queue_len",
)


def tenants(items: Sequence[Mapping[str, Any]]) -> str:
    return table(
        ["TENANT", "BUDGET", "WEIGHT", "TIER", "DEFAULT_MAX", "MAX_MAX", "MAX_QUEUE", "MODELS", "SOURCE"],
        [[t.get(k) for k in _TENANT_COLUMNS] + [_models(t.get("models")), t.get("source")] for t in items],
        empty="(no tenants: the gateway is open, one tenant 'default' takes any key)",
    )


def tenant(t: Mapping[str, Any]) -> str:
    lines = [f"{'tenant:':20} {cell(t.get('name'))}"]
    lines += [f"{k + ':':20} {cell(t.get(k))}" for k in _TENANT_COLUMNS[1:]]
    if t.get("budget_enforce") is False:
        lines.append(f"{'budget_enforce:':20} false (shadow mode: counted, never enforced)")
    lines.append(f"{'models:':20} {_models(t.get('models'))}")
    tools = t.get("server_tools")
    lines.append(f"{'server_tools:':20} {'(any)' if tools is None else ','.join(tools) or '(none)'}")
    lines.append(f"{'source:':20} {cell(t.get('source'))}")
    return "\n".join(lines)


def quotas(d: Mapping[str, Any]) -> str:
    rows = []
    for q in d.get("quotas") or []:
        window = f"{'rolling ' if q.get('rolling') else ''}{q.get('window')}"
        rows.append(
            [
                q.get("name"),
                q.get("key") or "",
                q.get("unit"),
                window,
                q.get("used"),
                q.get("reserved"),
                q.get("remaining"),
                q.get("limit"),
                "yes" if q.get("enforce", True) else "shadow",
                when(q.get("window_end")) if not q.get("rolling") else "",
            ]
        )
    head = ["QUOTA", "KEY", "UNIT", "WINDOW", "USED", "RESERVED", "REMAINING", "LIMIT", "ENFORCED", "RESETS"]
    return f"tenant {d.get('tenant')}\n" + table(head, rows, empty="(no quotas)")


def prices(d: Mapping[str, Any]) -> str:
    rows = []
    for m in d.get("prices") or []:
        price = m.get("price") or {}
        rows.append(
            [
                m.get("model"),
                price.get("input", "-"),
                price.get("cached_input", "-"),
                price.get("output", "-"),
                m.get("source"),
            ]
        )
    return table(
        ["MODEL", "INPUT/1M", "CACHED/1M", "OUTPUT/1M", "SOURCE"], rows, empty="(no models configured)"
    )


def usage(d: Mapping[str, Any]) -> str:
    rows = [
        [
            r["start"],
            r["tenant"],
            r["key"] or "-",
            r["model"] or "-",
            r["requests"],
            r["prompt_tokens"],
            r["cached_tokens"],
            r["completion_tokens"],
            f"{r['cost']:.4f}",
            r["estimated_requests"],
        ]
        for r in d.get("rows") or []
    ]
    head = [
        "START",
        "TENANT",
        "KEY",
        "MODEL",
        "REQUESTS",
        "PROMPT",
        "CACHED",
        "COMPLETION",
        "COST",
        "ESTIMATED",
    ]
    t = d.get("totals") or {}
    return (
        f"usage by {d.get('by')} from {d.get('from')} to {d.get('to')}\n"
        + table(head, rows, empty="(no usage in this range)")
        + f"\ntotal: {t.get('requests', 0):,} requests, {t.get('prompt_tokens', 0):,} prompt + "
        f"{t.get('completion_tokens', 0):,} completion tokens, cost {t.get('cost', 0):.4f}"
    )


# ---- keys ----


def key_status(k: Mapping[str, Any], now: float | None = None) -> str:
    now = time.time() if now is None else now
    if k.get("revoked_at") is not None:
        return f"revoked {when(k['revoked_at'])}"
    expires = k.get("expires_at")
    if expires is not None:
        if expires <= now:
            return f"expired {when(expires)}"
        return f"valid until {when(expires)} ({expires - now:.0f} s)"
    return "active"


def keys(items: Sequence[Mapping[str, Any]]) -> str:
    return table(
        ["ID", "NAME", "PREFIX", "SOURCE", "CREATED", "STATUS"],
        [
            [
                k.get("id"),
                k.get("name"),
                None if k.get("prefix") is None else f"{k['prefix']}…",
                k.get("source"),
                when(k.get("created_at")) if k.get("created_at") else "-",
                key_status(k),
            ]
            for k in items
        ],
        empty="(no keys)",
    )


def new_key(data: Mapping[str, Any], verb: str) -> str:
    """The one place a key is printed: right after it was made, clearly marked."""
    label = f" ({data['name']})" if data.get("name") else ""
    lines = [f"{verb} key {data['id']}{label} for tenant {data['tenant']}."]
    if data.get("replaces"):
        lines.append(
            f"The old key {data['replaces']} stays valid until {when(data.get('old_key_expires_at'))}, "
            "then it is refused."
        )
    lines += [
        "",
        "API key (shown once, never again; the gateway keeps only its hash):",
        "",
        f"    {data['key']}",
        "",
    ]
    return "\n".join(lines)


# ---- pools ----


def _backend_state(b: Mapping[str, Any]) -> str:
    states = ["draining" if b.get("draining") else "serving", "healthy" if b.get("healthy") else "down"]
    return ", ".join(states)


def pools(items: Sequence[Mapping[str, Any]]) -> str:
    summary = table(
        ["POOL", "BUDGET", "CAPACITY", "BACKENDS", "SOURCE"],
        [
            [
                p["name"],
                p.get("budget_tokens"),
                p.get("capacity_tokens"),
                len(p.get("backends") or []),
                p.get("source"),
            ]
            for p in items
        ],
        empty="(no pools)",
    )
    return summary + "\n\n" + backends([(p["name"], b) for p in items for b in p.get("backends") or []])


def backends(items: Sequence[tuple[str, Mapping[str, Any]]]) -> str:
    return table(
        ["POOL", "BACKEND", "URL", "CAPACITY", "IN_FLIGHT_TOK", "IN_FLIGHT_REQ", "MODELS", "STATE"],
        [
            [
                pool,
                b.get("name"),
                b.get("url"),
                b.get("capacity_tokens"),
                b.get("in_flight_tokens"),
                b.get("in_flight_requests"),
                _models(b.get("models")),
                _backend_state(b),
            ]
            for pool, b in items
        ],
        empty="(no backends)",
    )


def pool(p: Mapping[str, Any]) -> str:
    budget = p.get("budget_tokens")
    head = (
        f"pool {p['name']}: budget {cell(budget)}"
        f"{' (the sum of its backends)' if budget is None else ''}, "
        f"capacity {cell(p.get('capacity_tokens'))} tokens, source {cell(p.get('source'))}"
    )
    return head + "\n\n" + backends([(p["name"], b) for b in p.get("backends") or []])


# ---- tiers ----


def tiers(items: Sequence[Mapping[str, Any]]) -> str:
    return table(
        ["TIER", "RANK", "CEILING", "MAX_QUEUE_WAIT_S", "SOURCE"],
        [
            [
                t.get("name"),
                t.get("rank"),
                f"{t.get('ceiling')} (shadow)" if t.get("ceiling_enforce") is False else t.get("ceiling"),
                t.get("max_queue_wait_s"),
                t.get("source"),
            ]
            for t in sorted(items, key=lambda t: (t.get("rank", 0), t.get("name", "")))
        ],
    )


# ---- live state ----


def _domain_line(s: Mapping[str, Any]) -> list[str]:
    names = s.get("domains") or []
    if len(names) < 2:
        return []
    shown = s.get("domain")
    if shown is None:
        return [f"budget domains {', '.join(names)}, merged (--domain NAME for one)"]
    return [f"budget domain {shown} (of {', '.join(names)})"]


def state(s: Mapping[str, Any], errors_shown: int = 10) -> str:
    out = [
        f"admin state version {cell(s.get('version'))}; requests in this gateway now: "
        f"{cell(s.get('requests_in_gateway'))}; leases held: {cell(s.get('leases'))}",
        *_domain_line(s),
        "",
        "Pools (tokens in flight of capacity)",
        table(
            ["POOL", "IN_FLIGHT", "CAPACITY", "USED", "SHARED"],
            [
                [
                    name,
                    p.get("in_flight"),
                    p.get("capacity"),
                    f"{p['in_flight'] / p['capacity']:.0%}" if p.get("capacity") else "-",
                    p.get("shared"),
                ]
                for name, p in sorted((s.get("pools") or {}).items())
            ],
        ),
        "",
        "Tenants",
        table(
            ["TENANT", "IN_FLIGHT", "QUEUED", "FAIR_SHARE", "SERVED_HERE"],
            [
                [
                    name,
                    t.get("in_flight"),
                    t.get("queued"),
                    t.get("fair_share_counter"),
                    t.get("served_tokens_here"),
                ]
                for name, t in sorted((s.get("tenants") or {}).items())
            ],
        ),
    ]
    queued = s.get("queued_by_tier") or {}
    out += ["", "Queued by tier: " + (", ".join(f"{k} {v}" for k, v in queued.items()) or "nothing queued")]
    errors = list(s.get("recent_errors") or [])
    if not errors:
        out += ["", "Recent errors: none"]
        return "\n".join(out)
    out += ["", f"Recent errors ({len(errors)}, the last {min(len(errors), errors_shown)} shown)"]
    out.append(
        table(
            ["AT", "TENANT", "CLASS", "POOL", "STATUS", "OUTCOME", "ERROR"],
            [
                [
                    when(e.get("at")),
                    e.get("tenant"),
                    e.get("class"),
                    e.get("pool"),
                    e.get("status"),
                    e.get("outcome"),
                    (e.get("error") or "")[:80] or None,
                ]
                for e in errors[-errors_shown:]
            ],
        )
    )
    return "\n".join(out)


# ---- overrides ----


def masked(value: Any) -> Any:
    """``value`` with every ``api_key`` replaced: a backend's key is a secret even in an override."""
    if isinstance(value, Mapping):
        return {k: (_MASK if k == "api_key" and v else masked(v)) for k, v in value.items()}
    if isinstance(value, list):
        return [masked(v) for v in value]
    return value


def overrides(data: Mapping[str, Any]) -> str:
    out = [f"admin state version {cell(data.get('version'))}"]
    for kind, section in (data.get("overrides") or {}).items():
        for name, value in section.items():
            out += ["", f"{kind}/{name}:" + (" deleted" if value is None else "")]
            if value is not None:
                out.append(textwrap.indent(yaml.safe_dump(masked(value), sort_keys=False).rstrip(), "  "))
    if len(out) == 1:
        out.append("(no overrides: everything follows the config file)")
    else:
        out += [
            "",
            "An override wins over the config file until it is reset: tokengate admin overrides reset KIND NAME",
        ]
    return "\n".join(out)

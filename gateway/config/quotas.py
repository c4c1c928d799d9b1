"""The ``quotas`` list of a tenant and the ``price`` of a model, parsed and validated; and a quota
back in the file's shape (the admin API shows and takes that shape).

```yaml
models:
  "gpt-4o*": {price: {input: 2.50, cached_input: 1.25, output: 10.00}}   # currency per 1M tokens
tenants:
  acme:
    quotas:
      - {tokens: 5000000, window: day}                                   # fixed, UTC midnight
      - {name: monthly-spend, cost: 200, window: month, timezone: Europe/Berlin, reset: "06:00"}
      - {tokens: 100000, window: hour, rolling: true, models: ["gpt-4o*"], enforce: false}
      - {requests: 1000, window: day, per: key}                          # each API key its own
```
"""

from __future__ import annotations

import re
from typing import Any
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from budgets.quota import CALENDAR, MICRO, ModelPrice, QuotaSpec, Window, window_length
from gateway.config.fields import (
    ConfigError,
    boolean,
    choice,
    number,
    section,
    show,
    string,
    string_list,
    valid_name,
)

QUOTA_KEYS = (
    "name", "tokens", "requests", "cost", "window", "rolling", "timezone", "reset", "models", "per", "enforce",
)  # fmt: skip
_RESET_RE = re.compile(r"^([01][0-9]|2[0-3]):([0-5][0-9])$")


def model_price(v: Any, where: str) -> ModelPrice | None:
    if v is None:
        return None
    b = section(v, where, ("input", "output", "cached_input"))
    cached = b.get("cached_input")
    return ModelPrice(
        input=number(b, "input", where, None, minimum=0),
        output=number(b, "output", where, None, minimum=0),
        cached_input=None if cached is None else number(b, "cached_input", where, None, minimum=0),
    )


def tenant_quotas(v: Any, where: str, tenant: str) -> tuple[QuotaSpec, ...]:
    if v is None:
        return ()
    if not isinstance(v, list):
        raise ConfigError(f"{where}: expected a list of quotas, got {show(v)}")
    out: list[QuotaSpec] = []
    for i, item in enumerate(v):
        spec = _quota(item, f"{where}[{i}]", tenant)
        if any(q.name == spec.name for q in out):
            raise ConfigError(
                f"{where}[{i}].name: {spec.name!r} is the name of another quota of this tenant; give each a name"
            )
        out.append(spec)
    return tuple(out)


def _quota(v: Any, where: str, tenant: str) -> QuotaSpec:
    b = section(v, where, QUOTA_KEYS)
    given = [k for k in ("tokens", "requests", "cost") if k in b]
    if len(given) != 1:
        raise ConfigError(
            f"{where}: give exactly one of tokens (a token limit), requests (a request count) or cost "
            "(a limit in currency)"
        )
    unit = given[0]
    if unit != "cost":
        limit = b[unit]
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
            raise ConfigError(f"{where}.{unit}: expected a positive integer, got {show(limit)}")
    else:
        cost = number(b, "cost", where, None, minimum=0)
        if cost <= 0:
            raise ConfigError(
                f"{where}.cost: expected a positive number (currency units), got {show(b['cost'])}"
            )
        limit = round(cost * MICRO)
    period = string(b, "window", where, None)
    if window_length(period) is None:
        raise ConfigError(
            f"{where}.window: expected minute, hour, day, week, month or a length such as 90s, 15m, 6h, 7d; "
            f"got {show(period)}"
        )
    rolling = boolean(b, "rolling", where, False)
    timezone = string(b, "timezone", where, "UTC")
    try:
        ZoneInfo(timezone)
    except (ZoneInfoNotFoundError, ValueError):
        raise ConfigError(
            f"{where}.timezone: unknown time zone {show(timezone)}; use an IANA name such as Europe/Berlin"
        ) from None
    reset = string(b, "reset", where, "00:00")
    m = _RESET_RE.match(reset)
    if m is None:
        raise ConfigError(f"{where}.reset: expected a local time HH:MM, got {show(reset)}")
    reset_s = int(m.group(1)) * 3600 + int(m.group(2)) * 60
    if reset_s and (rolling or period not in CALENDAR[1:]):
        raise ConfigError(f"{where}.reset: only fixed day, week and month windows have a reset time")
    default_name = f"{unit}-{'rolling-' if rolling else ''}{period}"
    name = valid_name(string(b, "name", where, default_name), f"{where}.name")
    return QuotaSpec(
        name=name,
        tenant=tenant,
        unit=unit,  # type: ignore[arg-type]
        limit=limit,
        window=Window(period, rolling=rolling, timezone=timezone, reset_s=reset_s),
        models=string_list(b, "models", where),
        enforce=boolean(b, "enforce", where, True),
        per_key=choice(b, "per", where, "tenant", ("tenant", "key")) == "key",
    )


def quota_section(q: QuotaSpec) -> dict[str, Any]:
    """A quota in the file's shape (what the admin API shows and takes back)."""
    w = q.window
    out: dict[str, Any] = {"name": q.name}
    out[q.unit] = q.limit if q.unit != "cost" else q.limit / MICRO
    out["window"] = w.period
    if w.rolling:
        out["rolling"] = True
    if w.timezone != "UTC":
        out["timezone"] = w.timezone
    if w.reset_s:
        out["reset"] = f"{w.reset_s // 3600:02d}:{w.reset_s % 3600 // 60:02d}"
    if q.models:
        out["models"] = list(q.models)
    if q.per_key:
        out["per"] = "key"
    if not q.enforce:
        out["enforce"] = False
    return out

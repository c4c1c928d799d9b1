"""``GET /admin/v1/usage``: usage for billing over a time range, as JSON or CSV (``tokengate admin usage``).

Rows of the usage log (budgets/usage_log.py), per hour, tenant, API key and model, summed into the
period asked for (``by``: hour, day or month, UTC). ``from`` and ``to`` (ISO 8601 dates or times, or
epoch seconds) are rounded down to the hour: a range covers the hours that start in ``[from, to)``.
Keys are shown as the admin API knows them (an id and prefix, or the start of the SHA-256 of a key
from the config file), never the key.
"""

from __future__ import annotations

import csv
import io
import time
from collections.abc import Callable, Mapping, Sequence
from datetime import UTC, datetime
from typing import Any

from budgets.quota import MICRO
from budgets.usage_log import HOUR, UsageLog, UsageRow, hour_of
from gateway.request.errors import ApiError, show_value

BY = ("hour", "day", "month")
COLUMNS = (
    "start",
    "tenant",
    "key",
    "model",
    "requests",
    "prompt_tokens",
    "cached_tokens",
    "completion_tokens",
    "cost",
    "estimated_requests",
)
_MOST_HOURS = 24 * 400  # one read: a little over a year
_CHUNK = 744  # hours per store call (a 31-day month)


def instant(text: str | None, name: str, default: float) -> float:
    """Epoch seconds from ``2026-12-01``, ``2026-12-01T06:00:00Z`` (or with an offset; naive = UTC),
    or a number of epoch seconds."""
    if text is None or text == "":
        return default
    try:
        return float(text)
    except ValueError:
        pass
    try:
        t = datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        raise ApiError(
            400,
            f"'{name}' must be an ISO 8601 date or time (2026-12-01, 2026-12-01T06:00:00Z) or epoch seconds, "
            f"got {show_value(text)}",
            param=name,
            code="invalid_value",
        ) from None
    if t.tzinfo is None:
        t = t.replace(tzinfo=UTC)
    return t.timestamp()


def period_start(hour: int, by: str) -> int:
    if by == "hour":
        return hour
    d = datetime.fromtimestamp(hour, UTC)
    d = d.replace(minute=0, second=0, microsecond=0, hour=0)
    if by == "month":
        d = d.replace(day=1)
    return int(d.timestamp())


def iso(t: float) -> str:
    return datetime.fromtimestamp(t, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


async def export(
    usage_log: UsageLog,
    query: Mapping[str, str],
    key_label: Callable[[str, str], str],
    wall: Callable[[], float] = time.time,
) -> tuple[dict[str, Any], str]:
    """The rows of ``query``'s range (``from``, ``to``, ``by``, ``tenant``, ``format``) and the format."""
    now = wall()
    month = datetime.fromtimestamp(now, UTC).replace(day=1, hour=0, minute=0, second=0, microsecond=0)
    start = hour_of(instant(query.get("from"), "from", month.timestamp()))
    end = instant(query.get("to"), "to", now + HOUR)
    by = query.get("by", "day")
    fmt = query.get("format", "json")
    if by not in BY:
        raise ApiError(
            400,
            f"'by' must be one of {', '.join(BY)}, got {show_value(by)}",
            param="by",
            code="invalid_value",
        )
    if fmt not in ("json", "csv"):
        raise ApiError(
            400, f"'format' must be json or csv, got {show_value(fmt)}", param="format", code="invalid_value"
        )
    if end <= start:
        raise ApiError(400, "'to' must be after 'from'", param="to", code="invalid_value")
    hours = list(range(start, int(end), HOUR))
    if len(hours) > _MOST_HOURS:
        raise ApiError(
            400,
            f"The range holds {len(hours):,} hours; export at most {_MOST_HOURS:,} (about 400 days) at once",
            param="to",
            code="range_too_long",
        )
    tenant = query.get("tenant")
    rows: list[UsageRow] = []
    for i in range(0, len(hours), _CHUNK):
        rows += await usage_log.read(hours[i : i + _CHUNK])
    sums: dict[tuple[int, str, str, str], list[int]] = {}
    for r in rows:
        if tenant is not None and r.tenant != tenant:
            continue
        key = (period_start(r.hour, by), r.tenant, r.key, r.model)
        cell = sums.setdefault(key, [0] * len(r.counts))
        for i, n in enumerate(r.counts):
            cell[i] += n
    out = [_row(k, c, key_label) for k, c in sorted(sums.items())]
    totals: dict[str, float] = {c: sum(int(r[c]) for r in out) for c in COLUMNS[4:] if c != "cost"}
    totals["cost"] = round(sum(float(r["cost"]) for r in out), 6)
    return {"from": iso(start), "to": iso(end), "by": by, "rows": out, "totals": totals}, fmt


def _row(
    k: tuple[int, str, str, str], c: Sequence[int], key_label: Callable[[str, str], str]
) -> dict[str, Any]:
    start, tenant, key, model = k
    requests, prompt, cached, completion, cost, estimated = c
    return {
        "start": iso(start),
        "tenant": tenant,
        "key": key_label(tenant, key) if key else "",
        "model": model,
        "requests": requests,
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "completion_tokens": completion,
        "cost": cost / MICRO,
        "estimated_requests": estimated,
    }


def as_csv(data: Mapping[str, Any]) -> str:
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(COLUMNS)
    for r in data["rows"]:
        w.writerow([f"{r['cost']:.6f}" if c == "cost" else _cell(r[c]) for c in COLUMNS])
    return buf.getvalue()


def _cell(v: object) -> object:
    """A text a client chose (the model's name) opened in a spreadsheet must stay text: one that
    starts like a formula is written with a leading quote (OWASP's CSV injection advice)."""
    if isinstance(v, str) and v[:1] in ("=", "+", "-", "@", "\t", "\r"):
        return "'" + v
    return v

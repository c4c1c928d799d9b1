"""The Grafana dashboard and the Prometheus rules only query metrics the gateway really exports.

Exported names come from a real app's CollectorRegistry (families expanded with their sample
suffixes: histograms' _bucket/_sum/_count, counters' _total); recording-rule names count as
exported once every metric their own expression uses is.
"""

from __future__ import annotations

import json
import re
from typing import Any

import yaml

from gateway.app import build_app
from gateway.config.loader import parse_config
from tests.gateway.gw_support import ROOT

DASHBOARD = ROOT / "deploy" / "grafana" / "tokengate.json"
RULES = sorted((ROOT / "deploy" / "prometheus" / "rules").glob("*.yml"))

_STRINGS = re.compile(r'"(?:\\.|[^"\\])*"|\'(?:\\.|[^\'\\])*\'')
_RANGES = re.compile(r"\[[^\]]*\]")
_VARS = re.compile(r"\$\w+")
_IDENT = re.compile(r"(?<![\w:.])[A-Za-z_:][\w:]*")


def metric_refs(expr: str) -> set[str]:
    """Metric names in a PromQL expression: tokengate_* names and recording rules (level:name:op).

    Label names and functions never start with tokengate_ nor contain a colon, so after dropping
    strings, ranges and Grafana variables, those identifiers are exactly the metric references.
    """
    e = _VARS.sub("", _RANGES.sub("", _STRINGS.sub('""', expr)))
    return {t for t in _IDENT.findall(e) if t.startswith("tokengate_") or ":" in t}


def exported_names() -> set[str]:
    config = parse_config(
        {
            "pools": {"p": {"backends": [{"url": "http://127.0.0.1:9", "capacity_tokens": 1000}]}},
            "observability": {"slos": {"short": {"ttft_p99_s": 1}}},
        }
    )
    gw = build_app(config)
    names: set[str] = set()
    for fam in gw.metrics.registry.collect():
        suffixes = {
            "histogram": ("_bucket", "_sum", "_count", "_created"),
            "counter": ("_total", "_created"),
            "summary": ("_sum", "_count", "_created"),
        }.get(fam.type, ("",))
        names.update(fam.name + s for s in suffixes)
    return names


def rules() -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for path in RULES:
        for group in yaml.safe_load(path.read_text())["groups"]:
            out.extend(group["rules"])
    return out


def panel_exprs() -> list[tuple[str, str]]:
    dash = json.loads(DASHBOARD.read_text())
    out = []
    for p in dash["panels"]:
        for t in p.get("targets", []):
            out.append((p["title"], t["expr"]))
    for v in dash["templating"]["list"]:
        q = v.get("query")
        if isinstance(q, dict):
            out.append((f"variable {v['name']}", q["query"]))
    return out


def test_metric_refs_parser() -> None:
    e = 'histogram_quantile(0.99, sum by (le, class) (rate(tokengate_ttft_seconds_bucket{class=~"$class"}[$__rate_interval])))'
    assert metric_refs(e) == {"tokengate_ttft_seconds_bucket"}
    assert metric_refs('label_replace(class:tokengate_x:1m, "victim", "$1", "class", "(.+)")') == {
        "class:tokengate_x:1m"
    }
    assert metric_refs('max by (class) (tokengate_class_slo_seconds{signal="ttft"})') == {
        "tokengate_class_slo_seconds"
    }


def test_rules_only_use_exported_metrics() -> None:
    exported = exported_names()
    recorded = {r["record"] for r in rules() if "record" in r}
    for r in rules():
        name = r.get("record") or r.get("alert")
        refs = metric_refs(r["expr"])
        assert refs, f"{name}: references no metric"
        assert name not in refs, f"{name}: refers to itself"
        missing = refs - exported - recorded
        assert not missing, f"{name}: not exported: {sorted(missing)}"


def test_every_dashboard_panel_queries_exported_metrics() -> None:
    known = exported_names() | {r["record"] for r in rules() if "record" in r}
    exprs = panel_exprs()
    assert len(exprs) >= 20
    for title, expr in exprs:
        refs = metric_refs(expr)
        assert refs, f"panel {title!r}: no metric in {expr!r}"
        missing = refs - known
        assert not missing, f"panel {title!r} queries metrics the gateway does not export: {sorted(missing)}"


def test_dashboard_covers_the_issue_panels() -> None:
    used = set().union(*(metric_refs(e) for _, e in panel_exprs()))
    for name in (
        "tokengate_ttft_seconds_bucket",
        "tokengate_queue_wait_seconds_bucket",
        "tokengate_backend_seconds_bucket",
        "tokengate_pool_in_flight_tokens",
        "tokengate_pool_capacity_tokens",
        "tokengate_queue_depth",
        "tokengate_backend_kv_usage",
        "tokengate_hol_correlation",
        "tokengate_pool_shape_ratio",
    ):
        assert name in used, name

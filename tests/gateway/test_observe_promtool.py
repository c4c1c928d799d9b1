"""Prometheus rules: `promtool check rules` and the rule unit tests on synthetic series."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from tests.gateway.gw_support import ROOT

PROM = ROOT / "deploy" / "prometheus"
PROMTOOL = shutil.which("promtool") or ("/usr/bin/promtool" if Path("/usr/bin/promtool").exists() else None)

pytestmark = pytest.mark.skipif(
    PROMTOOL is None,
    reason="promtool not installed (Debian package `prometheus`; `make setup` / scripts/bootstrap.sh installs it)",
)


def _run(*args: str) -> str:
    assert PROMTOOL is not None
    r = subprocess.run([PROMTOOL, *args], cwd=PROM, capture_output=True, text=True, timeout=60)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out
    return out


def test_rules_are_valid() -> None:
    rules = sorted(str(p.relative_to(PROM)) for p in (PROM / "rules").glob("*.yml"))
    assert len(rules) == 2
    out = _run("check", "rules", *rules)
    assert "SUCCESS" in out


def test_prometheus_config_is_valid() -> None:
    assert "SUCCESS" in _run("check", "config", "prometheus.yml")


def test_rule_unit_tests_pass() -> None:
    tests = sorted(str(p.relative_to(PROM)) for p in (PROM / "tests").glob("*.test.yml"))
    assert len(tests) >= 2
    out = _run("test", "rules", *tests)
    assert "FAILED" not in out and out.count("SUCCESS") == len(tests)

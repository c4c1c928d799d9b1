"""A scenario file: a workload, optionally the stack to start for it (backends, gateway configs), checks
and a summary table (``loadtest.summary``).

``setup`` describes the targets the scenario compares when the load tester starts everything itself
(``tokengate loadtest FILE --spawn`` and ``tokengate demo``)::

    setup:
      backends: {count: 2, args: [--no-chunked-prefill, --max-num-batched-tokens, "32768"]}
      # or one backend per entry of 'variants', each with the common args plus its own:
      # backends: {args: [--max-model-len, "32768"], variants: [[], [--scheduling-policy, priority]]}
      gateway: {tiers: {...}}               # shared by every gateway target (merged under each one's)
      targets:
        - {name: direct, direct: true}      # round-robin over the backends (all, or 'backends: [0, 1]')
        - name: tokengate-split
          gateway:                          # a gateway config; backends referenced by index
            classes: [{name: reasoning, when: {min_prompt_tokens: 8000}, pool: long}, {name: short, pool: short}]
            pools: {short: {backends: [{backend: 0, capacity_tokens: 100000}]},
                    long: {backends: [{backend: 1, capacity_tokens: 100000}]}}
        # The same gateway again, with the noisy class left out of the plan and only the requests
        # planned in phase 'noisy' sent: the same short requests, without their neighbour.
        - {name: tokengate-split-without-noisy, same_as: tokengate-split, without: [reasoning], phase: noisy}
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import yaml

from loadtest.checks import CheckSpec, parse_checks
from loadtest.distributions import SpecError, check_keys
from loadtest.spec import WorkloadSpec, parse_workload
from loadtest.summary import SummaryColumn, parse_summary

SCENARIOS_DIR = Path(__file__).resolve().parent / "scenarios"


@dataclass(frozen=True)
class TargetSetup:
    name: str
    direct: bool
    backends: tuple[int, ...] | None = None  # direct targets: which backends (None = all)
    gateway: Mapping[str, Any] = field(default_factory=dict)
    same_as: str | None = None  # reuse another gateway target's process
    without: tuple[str, ...] = ()  # classes left out of this target's plan
    phase: str | None = None  # send only the requests planned inside this phase's span


@dataclass(frozen=True)
class SetupSpec:
    backend_count: int
    backend_args: tuple[str, ...]
    gateway_base: Mapping[str, Any]
    targets: tuple[TargetSetup, ...]
    backend_variants: tuple[tuple[str, ...], ...] = ()  # per-backend args after the common ones

    def args_of(self, index: int) -> tuple[str, ...]:
        """Backend ``index``'s command-line arguments."""
        own = self.backend_variants[index] if self.backend_variants else ()
        return (*self.backend_args, *own)


@dataclass(frozen=True)
class Scenario:
    workload: WorkloadSpec
    setup: SetupSpec | None
    checks: tuple[CheckSpec, ...]
    path: Path | None = None
    summary: tuple[SummaryColumn, ...] = ()  # the summary table's columns (loadtest.summary)

    def with_workload(self, workload: WorkloadSpec) -> Scenario:
        return replace(self, workload=workload)


def _parse_setup(raw: Any) -> SetupSpec:
    if not isinstance(raw, Mapping):
        raise SpecError("setup: expected a mapping")
    check_keys(raw, ["backends", "gateway", "targets"], "setup")
    backends = raw.get("backends", {}) or {}
    if not isinstance(backends, Mapping):
        raise SpecError("setup.backends: expected {count, args}")
    check_keys(backends, ["count", "args", "variants"], "setup.backends")
    args = backends.get("args", []) or []
    if not isinstance(args, list):
        raise SpecError("setup.backends.args: expected a list of command-line arguments")
    variants_raw = backends.get("variants", []) or []
    if not isinstance(variants_raw, list) or not all(isinstance(v, list) for v in variants_raw):
        raise SpecError("setup.backends.variants: expected a list of argument lists, one per backend")
    variants = tuple(tuple(str(a) for a in v) for v in variants_raw)
    count = backends.get("count", len(variants) or 1)
    if not isinstance(count, int) or count < 1:
        raise SpecError(f"setup.backends.count: expected a positive integer, got {count!r}")
    if variants and count != len(variants):
        raise SpecError(f"setup.backends: count {count} but {len(variants)} variants (one per backend)")
    base = raw.get("gateway", {}) or {}
    if not isinstance(base, Mapping):
        raise SpecError("setup.gateway: expected a mapping (a partial gateway config)")
    targets_raw = raw.get("targets")
    if not isinstance(targets_raw, list) or not targets_raw:
        raise SpecError("setup.targets: expected a non-empty list")
    targets = []
    seen: set[str] = set()
    for i, t in enumerate(targets_raw):
        where = f"setup.targets[{i}]"
        if not isinstance(t, Mapping):
            raise SpecError(f"{where}: expected a mapping")
        check_keys(t, ["name", "direct", "backends", "gateway", "same_as", "without", "phase"], where)
        name = t.get("name")
        if not isinstance(name, str) or not name or name in seen:
            raise SpecError(f"{where}.name: expected a unique non-empty name, got {name!r}")
        seen.add(name)
        direct = bool(t.get("direct", False))
        same_as = t.get("same_as")
        if sum((direct, "gateway" in t, same_as is not None)) != 1:
            raise SpecError(
                f"{where}: a target has exactly one of 'direct: true', a 'gateway' config or 'same_as'"
            )
        indices = t.get("backends")
        if indices is not None and (
            not direct
            or not isinstance(indices, list)
            or not all(isinstance(x, int) and 0 <= x < count for x in indices)
        ):
            raise SpecError(f"{where}.backends: expected (for a direct target) backend indices below {count}")
        gateway = t.get("gateway", {}) or {}
        if not isinstance(gateway, Mapping):
            raise SpecError(f"{where}.gateway: expected a mapping")
        without = t.get("without", []) or []
        if not isinstance(without, list) or not all(isinstance(c, str) for c in without):
            raise SpecError(f"{where}.without: expected a list of class names")
        phase = t.get("phase")
        targets.append(
            TargetSetup(
                name,
                direct,
                tuple(indices) if indices is not None else None,
                dict(gateway),
                same_as=str(same_as) if same_as is not None else None,
                without=tuple(without),
                phase=str(phase) if phase is not None else None,
            )
        )
    by_name = {t.name: t for t in targets}
    for i, t in enumerate(targets):
        if t.same_as is not None:
            ref = by_name.get(t.same_as)
            if ref is None or ref.same_as is not None:
                raise SpecError(
                    f"setup.targets[{i}].same_as: {t.same_as!r} is not a direct or gateway target"
                )
    return SetupSpec(count, tuple(str(a) for a in args), dict(base), tuple(targets), variants)


def parse_scenario(raw: Mapping[str, Any], *, path: Path | None = None, synthetic: bool = False) -> Scenario:
    base_dir = path.parent if path is not None else None
    workload = parse_workload(raw, base_dir=base_dir, synthetic=synthetic)
    setup = _parse_setup(raw["setup"]) if "setup" in raw else None
    checks = parse_checks(raw.get("checks"), workload)
    summary = parse_summary(raw.get("summary"), workload)
    if setup is not None:
        classes = {c.name for c in workload.classes}
        phases = {p.name for p in workload.phases}
        for t in setup.targets:
            if set(t.without) - classes:
                raise SpecError(
                    f"setup.targets {t.name}.without: unknown class(es) {sorted(set(t.without) - classes)}"
                )
            if t.phase is not None and t.phase not in phases:
                raise SpecError(
                    f"setup.targets {t.name}.phase: {t.phase!r} is not a phase ({sorted(phases)})"
                )
    if setup is not None:
        names = {t.name for t in setup.targets}
        iso = workload.isolation
        if iso is not None:
            named = {*iso.solo, *iso.solo.values(), *([iso.direct] if iso.direct else [])}
            if named - names:
                raise SpecError(f"isolation: unknown target(s) {sorted(named - names)} (setup.targets)")
        for c in checks:
            for name in (c.target, c.baseline_target):
                if name is not None and name not in names:
                    raise SpecError(
                        f"checks: {c.name!r} names target {name!r}, not in setup.targets {sorted(names)}"
                    )
        for col in summary:
            if col.relative_to is not None and col.relative_to not in names:
                raise SpecError(
                    f"summary: {col.header!r} is relative to {col.relative_to!r}, not in setup.targets "
                    f"{sorted(names)}"
                )
    return Scenario(workload, setup, checks, path, summary)


def resolve_scenario_path(name: str) -> Path:
    """A path, or the name of a shipped scenario ('noisy_neighbour' → loadtest/scenarios/noisy_neighbour.yaml)."""
    candidate = Path(name)
    if candidate.is_file():
        return candidate
    shipped = SCENARIOS_DIR / (name if name.endswith((".yaml", ".yml")) else f"{name}.yaml")
    if shipped.is_file():
        return shipped
    available = sorted(p.stem for p in SCENARIOS_DIR.glob("*.yaml"))
    raise SpecError(f"scenario {name!r} not found (a file path, or one of {available})")


def load_scenario(name: str | Path, *, synthetic: bool = False) -> Scenario:
    path = resolve_scenario_path(str(name))
    try:
        raw = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
        raise SpecError(f"{path}: not valid YAML: {where}{exc.problem}") from None
    except (yaml.YAMLError, ValueError, OSError) as exc:  # ValueError: not UTF-8, or a bad date
        raise SpecError(f"{path}: not valid YAML: {exc}") from None
    if not isinstance(raw, Mapping):
        raise SpecError(f"{path}: expected a YAML mapping at the top level")
    return parse_scenario(raw, path=path, synthetic=synthetic)

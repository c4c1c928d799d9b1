"""Starts a scenario's stack — simulated reference backends and tokengate gateways — as child processes.

Talks to the rest of tokengate only through its command line (``python -m gateway.cli backend|serve``)
and over HTTP.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import yaml

from loadtest.gateway_config import gateway_config
from loadtest.processes import ProcessGroup, StartupError, free_port, wait_ready
from loadtest.runner import Target
from loadtest.scenario import Scenario, SetupSpec


def backend_command(port: int, args: Sequence[str]) -> list[str]:
    head = [sys.executable, "-m", "gateway.cli", "backend"]
    return [*head, "--executor", "sim", "--host", "127.0.0.1", "--port", str(port), *args]


def gateway_command(config_path: Path) -> list[str]:
    return [sys.executable, "-m", "gateway.cli", "serve", "--config", str(config_path)]


@dataclass(frozen=True)
class StackInfo:
    targets: list[Target]
    backend_urls: list[str]
    config_paths: dict[str, Path]
    pids: tuple[int, ...]  # of the children (backends, then gateways)


@contextmanager
def spawned_stack(
    scenario: Scenario,
    work_dir: Path,
    *,
    extra_backend_args: Sequence[str] = (),
    only_targets: Sequence[str] | None = None,
    startup_timeout_s: float = 90.0,
) -> Iterator[StackInfo]:
    """Backends first (all at once), then one gateway per gateway target; everything stopped on exit."""
    setup: SetupSpec | None = scenario.setup
    if setup is None:
        raise StartupError(f"scenario {scenario.workload.name!r} has no 'setup' section to spawn")
    wanted = [t for t in setup.targets if only_targets is None or t.name in only_targets]
    if not wanted:
        raise StartupError(f"no targets selected; the scenario has {[t.name for t in setup.targets]}")
    # The children run in the repository (cwd), so every path handed to them must be absolute.
    work_dir = work_dir.resolve()
    logs = work_dir / "logs"
    with ProcessGroup() as group:
        ports = [free_port() for _ in range(setup.backend_count)]
        urls = [f"http://127.0.0.1:{p}" for p in ports]
        backends = [
            group.start(
                f"backend{i}",
                backend_command(p, [*setup.args_of(i), *extra_backend_args]),
                logs / f"backend{i}.log",
            )
            for i, p in enumerate(ports)
        ]
        wait_ready([(b, [f"{u}/health"]) for b, u in zip(backends, urls, strict=True)], startup_timeout_s)
        targets: list[Target] = []
        configs: dict[str, Path] = {}
        gateways = []
        base_urls: dict[str, tuple[str, ...]] = {}
        needed = {t.same_as for t in wanted if t.same_as is not None}
        for t in setup.targets:
            if t.same_as is not None or (t not in wanted and t.name not in needed):
                continue
            if t.direct:
                indices = t.backends if t.backends is not None else tuple(range(setup.backend_count))
                base_urls[t.name] = tuple(urls[i] for i in indices)
                continue
            port = free_port()
            config = gateway_config(scenario.workload, setup.gateway_base, t.gateway, urls, port)
            path = work_dir / "configs" / f"{t.name}.yaml"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(yaml.safe_dump(config, sort_keys=False))
            configs[t.name] = path
            child = group.start(t.name, gateway_command(path), logs / f"{t.name}.log")
            base = f"http://127.0.0.1:{port}"
            gateways.append((child, [f"{base}/readyz"]))
            base_urls[t.name] = (base,)
        wait_ready(gateways, startup_timeout_s)
        for t in wanted:
            window = None
            if t.phase is not None:
                spans = scenario.workload.phase(t.phase).windows
                window = (min(a for a, _ in spans), max(b for _, b in spans))
            urls_of = base_urls[t.same_as if t.same_as is not None else t.name]
            targets.append(Target(t.name, urls_of, without=frozenset(t.without), window=window))
        pids = tuple(c.pid for c in group.children if c.pid is not None)
        yield StackInfo(targets, urls, configs, pids)

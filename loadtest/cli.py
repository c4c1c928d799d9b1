"""``tokengate loadtest``: run a scenario file against one target, compare several, or spawn its stack.

Examples::

    tokengate loadtest noisy_neighbour --target direct=http://127.0.0.1:8001,http://127.0.0.1:8002 \\
        --target tokengate=http://127.0.0.1:8080 --out results/nn
    tokengate loadtest loadtest/scenarios/fairness.yaml --spawn --out results/fairness
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from dataclasses import replace
from pathlib import Path

from loadtest.compare import compare, run_options, write_outputs
from loadtest.distributions import SpecError
from loadtest.processes import StartupError, sigterm_as_interrupt
from loadtest.records import RunResult
from loadtest.runner import Target
from loadtest.scenario import Scenario, load_scenario
from loadtest.spec import parse_send_max_tokens
from loadtest.stack import spawned_stack
from loadtest.traces import use_traces_dir


def parse_target(text: str, index: int) -> Target:
    """``NAME=URL[,URL...]`` or just ``URL[,URL...]``; several URLs are used round-robin."""
    name, sep, urls = text.partition("=")
    if not sep or "://" in name:
        name, urls = f"target{index + 1}", text
    parts = tuple(u.strip().rstrip("/") for u in urls.split(",") if u.strip())
    if not parts or not all(p.startswith(("http://", "https://")) for p in parts):
        raise SpecError(f"--target {text!r}: expected NAME=http://host:port[,http://...]")
    return Target(name.strip(), parts)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "scenario", help="a scenario YAML file, or the name of a shipped one (e.g. noisy_neighbour)"
    )
    parser.add_argument(
        "--target",
        action="append",
        default=[],
        metavar="NAME=URL[,URL]",
        help="an OpenAI-compatible base URL (several comma-separated: round-robin); repeat to compare targets",
    )
    parser.add_argument("--spawn", action="store_true", help="start the scenario's own backends and gateways")
    parser.add_argument(
        "--only", action="append", metavar="TARGET", help="with --spawn: run only these targets"
    )
    parser.add_argument("--out", type=Path, default=None, help="output folder (default results/<scenario>)")
    parser.add_argument(
        "--traces",
        type=Path,
        default=None,
        metavar="DIR",
        help="a folder where the scenario's trace CSV files are looked up (format: loadtest/README.md)",
    )
    parser.add_argument(
        "--synthetic", action="store_true", help="ignore trace files; use their fitted stand-ins"
    )
    parser.add_argument(
        "--duration", type=float, default=None, help="seconds of arrivals (overrides the file)"
    )
    parser.add_argument("--rate-scale", type=float, default=1.0, help="multiply every arrival rate")
    parser.add_argument("--seed", type=int, default=None, help="override the scenario's seed")
    parser.add_argument("--max-requests", type=int, default=None, help="send at most this many requests")
    parser.add_argument("--model", default=None, help="model name to request (default: the scenario's)")
    parser.add_argument(
        "--api-key", default=None, help="send this key for every request instead of the tenants'"
    )
    parser.add_argument("--no-stream", action="store_true", help="non-streaming requests (TTFT = end-to-end)")
    parser.add_argument(
        "--send-max-tokens",
        default=None,
        metavar="N|none|planned",
        help="what each request sends as max_tokens (overrides the scenario's send_max_tokens); with N or "
        "none the planned output goes as the reference backend's benchmark field tokengate_stop_after",
    )
    parser.add_argument("--pause", type=float, default=1.0, help="seconds between targets")
    parser.add_argument(
        "--backend-arg", action="append", default=[], help="with --spawn: extra backend argument"
    )
    parser.add_argument("--no-plots", action="store_true", help="skip the PNG charts")
    parser.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    parser.add_argument("--strict", action="store_true", help="exit 3 when a check is not met")


def prepare_scenario(args: argparse.Namespace) -> Scenario:
    if getattr(args, "traces", None) is not None:
        use_traces_dir(args.traces)
    scenario = load_scenario(args.scenario, synthetic=args.synthetic)
    workload = scenario.workload.scaled(rate_scale=args.rate_scale, duration_s=args.duration)
    if args.seed is not None:
        workload = replace(workload, seed=args.seed)
    if args.max_requests is not None:
        workload = replace(workload, max_requests=args.max_requests)
    if args.model is not None:
        workload = replace(workload, model=args.model)
    if getattr(args, "send_max_tokens", None) is not None:
        limit = parse_send_max_tokens(args.send_max_tokens, "--send-max-tokens")
        workload = replace(workload, send_max_tokens=limit)
    return scenario.with_workload(workload)


async def _run_targets(
    scenario: Scenario, targets: list[Target], args: argparse.Namespace, backend_urls: list[str] | None = None
) -> list[RunResult]:
    options = run_options(scenario.workload, progress=not args.quiet, stream=not args.no_stream)
    if args.api_key:
        targets = [replace(t, api_key=args.api_key) for t in targets]
    return await compare(
        scenario.workload, targets, options=options, pause_s=args.pause, backend_urls=backend_urls or ()
    )


def _variant(args: argparse.Namespace) -> str:
    """A default output folder's suffix for a run that overrides what requests send."""
    limit = getattr(args, "send_max_tokens", None)
    return f"-max-tokens-{limit}" if limit is not None else ""


def run(args: argparse.Namespace) -> int:
    try:
        with sigterm_as_interrupt():
            scenario = prepare_scenario(args)
            out_dir = args.out or Path("results") / (scenario.workload.name + _variant(args))
            if args.spawn == bool(args.target):
                raise SpecError("give either --target URL(s) or --spawn")
            if args.spawn:
                with spawned_stack(
                    scenario, out_dir, extra_backend_args=args.backend_arg, only_targets=args.only
                ) as stack:
                    runs = asyncio.run(_run_targets(scenario, stack.targets, args, stack.backend_urls))
            else:
                targets = [parse_target(t, i) for i, t in enumerate(args.target)]
                runs = asyncio.run(_run_targets(scenario, targets, args))
            outputs = write_outputs(
                out_dir,
                scenario.workload,
                runs,
                scenario.checks,
                plots=not args.no_plots,
                summary=scenario.summary,
            )
    except (SpecError, StartupError) as exc:
        print(f"tokengate loadtest: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("\ntokengate loadtest: interrupted; children stopped", file=sys.stderr)
        return 130
    print(outputs.markdown)
    print(f"wrote {outputs.json_path}, {outputs.markdown_path}" + "".join(f", {p}" for p in outputs.plots))
    if args.strict and any(c.met is False for c in outputs.checks):
        return 3
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tokengate loadtest", description=__doc__.split("\n")[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())

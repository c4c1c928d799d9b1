"""``tokengate demo``: the noisy-neighbour story end to end, on this machine, in about two minutes.

1. Starts two simulated reference backends (chunked prefill off, H100-class step times).
2. Runs the shipped ``noisy_neighbour`` scenario three times with the same seeded requests: direct to
   the backends (round-robin), through tokengate on one shared pool with tenant budgets, and through
   tokengate with short/long pools (a generated config each).
3. Runs the ``fairness`` scenario through tokengate (two backlogged tenants, weights 1 and 2).
4. Prints the tables and the checks (met / not met, with the numbers), writes results.json,
   results.md and the PNG charts under ``--out``.

Progress goes to stderr: a line redrawn in place on a terminal, a plain line every 10 s otherwise.
The background traffic replays the Azure 2023 trace files when ``--traces DIR`` holds them, else
their fitted stand-ins.

Every child process is stopped on the way out, also on Ctrl-C or a failure.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path

from loadtest.checks import CheckResult
from loadtest.compare import Outputs, compare, run_options, write_outputs
from loadtest.distributions import SpecError
from loadtest.processes import StartupError, sigterm_as_interrupt
from loadtest.scenario import Scenario, load_scenario
from loadtest.stack import spawned_stack
from loadtest.traces import use_traces_dir


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--out", type=Path, default=Path("results/demo"), help="output folder (default %(default)s)"
    )
    parser.add_argument(
        "--traces",
        type=Path,
        default=None,
        metavar="DIR",
        help="a folder with the trace CSV files to replay (azure_llm_2023_conv.csv, azure_llm_2023_code.csv; "
        "format: loadtest/README.md); default: their fitted stand-ins",
    )
    parser.add_argument(
        "--synthetic",
        action="store_true",
        help="use the traces' fitted stand-ins even when the trace files exist",
    )
    parser.add_argument("--skip-fairness", action="store_true", help="run only the noisy-neighbour scenario")
    parser.add_argument(
        "--scenario", default="noisy_neighbour", help="the noisy-neighbour scenario (name or file)"
    )
    parser.add_argument(
        "--fairness-scenario", default="fairness", help="the fairness scenario (name or file)"
    )
    parser.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    parser.add_argument("--no-plots", action="store_true", help="skip the PNG charts")
    parser.add_argument("--strict", action="store_true", help="exit 3 when a check is not met")


def _say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def _run_one(
    scenario: Scenario, out_dir: Path, args: argparse.Namespace, only: list[str] | None = None
) -> Outputs:
    spec = scenario.workload
    started = time.monotonic()
    with spawned_stack(scenario, out_dir, only_targets=only) as stack:
        _say(
            f"[demo] {spec.name}: {len(stack.backend_urls)} backend(s) and "
            f"{len(stack.config_paths)} gateway(s) up in {time.monotonic() - started:.1f} s; "
            f"running {', '.join(t.name for t in stack.targets)} ({spec.duration_s:g} s of arrivals each)"
        )
        options = run_options(spec, progress=not args.quiet)
        runs = asyncio.run(
            compare(spec, stack.targets, options=options, pause_s=0.5, backend_urls=stack.backend_urls)
        )
    return write_outputs(
        out_dir, spec, runs, scenario.checks, plots=not args.no_plots, summary=scenario.summary
    )


def _table(markdown: str) -> str:
    """The per-class table and the totals table of a report (the phases and the rest are in results.md)."""
    start = markdown.find("## Per class")
    end = markdown.find("\n## ", start + 1)
    return markdown[start : end if end != -1 else None].strip()


def _traffic_source(scenario: Scenario, args: argparse.Namespace) -> str:
    traced = [c.trace for c in scenario.workload.classes if c.trace is not None]
    if not traced:
        return "the scenario's own distributions"
    replayed = [t.name for t in traced if t.records is not None]
    if replayed and len(replayed) == len(traced):
        return f"replaying {', '.join(replayed)}"
    if args.synthetic:
        return "the traces' fitted stand-ins (--synthetic)"
    files = ", ".join(sorted({t.name for t in traced}))
    return (
        "stand-ins fitted to the published figures of the traces "
        f"(pass --traces DIR with {files} to replay the files themselves)"
    )


def run(args: argparse.Namespace) -> int:
    started = time.monotonic()
    checks: list[CheckResult] = []
    try:
        with sigterm_as_interrupt():
            if args.traces is not None:
                use_traces_dir(args.traces)
            nn = load_scenario(args.scenario, synthetic=args.synthetic)
            _say(f"[demo] background chat traffic: {_traffic_source(nn, args)}")
            nn_out = _run_one(nn, args.out / "noisy-neighbour", args)
            print(f"\n# {nn.workload.name}\n\n{_table(nn_out.markdown)}\n")
            checks.extend(nn_out.checks)
            outputs = [nn_out]
            if not args.skip_fairness:
                fair = load_scenario(args.fairness_scenario, synthetic=args.synthetic)
                only = sorted({c.target for c in fair.checks}) or None
                fair_out = _run_one(fair, args.out / "fairness", args, only)
                section = fair_out.markdown.find("## Fair shares")
                print(
                    f"# {fair.workload.name}\n\n{fair_out.markdown[section:].split('## Checks')[0].strip()}\n"
                )
                checks.extend(fair_out.checks)
                outputs.append(fair_out)
    except (SpecError, StartupError) as exc:
        print(f"tokengate demo: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("\ntokengate demo: interrupted; all child processes stopped", file=sys.stderr)
        return 130
    print("## Checks\n")
    for c in checks:
        print(f"- {c.line()}")
    print()
    for out in outputs:
        files = [out.json_path, out.markdown_path, *out.plots]
        print("wrote " + ", ".join(str(p) for p in files))
    print(f"demo finished in {time.monotonic() - started:.0f} s")
    if args.strict and any(c.met is False for c in checks):
        return 3
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tokengate demo", description=__doc__.split("\n")[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())

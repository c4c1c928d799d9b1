"""The ``tokengate`` command: ``serve`` (the gateway), ``extproc`` (the gateway as Envoy's external
processor), and lazily-imported ``backend``, ``demo``,
``loadtest``, ``doctor`` and ``admin`` subcommands from their own packages.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import os
import sys
from types import ModuleType
from typing import Any

# subcommand -> (module with add_arguments/run, help)
_DELEGATES = {
    "backend": ("backends.reference.cli", "run the reference backend (simulated or torch executor)"),
    "demo": ("loadtest.demo", "the noisy-neighbour story end to end"),
    "loadtest": ("loadtest.cli", "run a load-test scenario against targets"),
    "doctor": ("gateway.observe.doctor", "diagnose a running gateway from its /stats"),
    "admin": ("gateway.admin.cli", "operate a running gateway: tenants, keys, pools, tiers, state"),
    "trace-receiver": (
        "gateway.observe.trace_receiver",
        "an OTLP/gRPC trace receiver that prints every span it gets as a JSON line",
    ),
}


def _add_serve(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("serve", help="run the gateway", description="Run the tokengate gateway.")
    _serve_arguments(p)
    p = sub.add_parser(
        "extproc",
        help="run the gateway as Envoy's external processor (gRPC), beside its own API",
        description="Run the gateway with Envoy's ext_proc gRPC server (extproc.host/port, default "
        "127.0.0.1:9002): Envoy asks it to admit each request, and it shares budgets with proxy replicas "
        "on the same store. The API, ops and admin listeners run as with serve. See docs/envoy.md.",
    )
    _serve_arguments(p)
    p.add_argument("--grpc-host", help="ext_proc listen address (default: extproc.host, 127.0.0.1)")
    p.add_argument("--grpc-port", type=int, help="ext_proc listen port (default: extproc.port, 9002)")


def _serve_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", metavar="FILE", help="YAML config (default: embedded defaults)")
    p.add_argument("--host", help="listen address (default: listen.host, 127.0.0.1)")
    p.add_argument("--port", type=int, help="listen port (default: listen.port, 8080)")
    p.add_argument(
        "--workers", type=int, help="worker processes (default: workers, 1; >1 needs store.kind=redis)"
    )
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    p.add_argument(
        "--access-log",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="one line per request on stdout (logger tokengate.access)",
    )
    p.add_argument(
        "--log-format",
        default="json",
        choices=["json", "text"],
        help="json: every log line one JSON object (timestamp, level, logger, message, ...); "
        "text: plain lines for humans (default: %(default)s)",
    )


def _run_serve(args: argparse.Namespace) -> int:
    from gateway.config.loader import ConfigError, check_workers, load_raw, parse_config

    try:
        raw = load_raw(args.config) if args.config else {}
        config = parse_config(raw)
        workers = args.workers if args.workers is not None else config.workers
        if workers < 1:
            raise ConfigError(f"--workers: expected a positive integer, got {workers}")
        check_workers(config, workers)
        if workers > 1 and not config.pools:
            raise ConfigError(
                f"--workers {workers} needs configured pools: the embedded backend runs in one process only"
            )
        if args.command == "extproc":
            config = _with_extproc(config, args)
            if workers > 1:
                raise ConfigError(
                    f"--workers {workers}: the external processor runs in one process (its gRPC port is one "
                    "listener); run more replicas on one Redis instead"
                )
    except ConfigError as exc:
        print(f"config error: {exc}", file=sys.stderr)
        return 2
    host = args.host or config.listen.host
    port = args.port if args.port is not None else config.listen.port

    from gateway.process.serve import serve, serve_workers, setup_logging

    setup_logging(args.log_level, args.access_log, args.log_format)
    try:
        if workers > 1:
            return serve_workers(args.config, host=host, port=port, workers=workers, log_level=args.log_level)
        return serve(
            config,
            host=host,
            port=port,
            log_level=args.log_level,
            config_path=args.config,
            raw=raw,
            log_format=args.log_format,
        )
    except (OSError, ValueError) as exc:
        print(f"tokengate {args.command}: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


def _with_extproc(config: Any, args: argparse.Namespace) -> Any:
    from gateway.config.loader import ConfigError

    ext = config.extproc
    host = args.grpc_host or ext.host
    port = args.grpc_port if args.grpc_port is not None else ext.port
    if not 0 <= port <= 65535:
        raise ConfigError(f"--grpc-port: expected a port in 0..65535, got {port}")
    return dataclasses.replace(config, extproc=dataclasses.replace(ext, enabled=True, host=host, port=port))


def _load(module: str) -> ModuleType | None:
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as exc:
        # Only "the module itself is missing" is "not available"; a broken import inside it is a bug.
        if exc.name and module.startswith(exc.name):
            return None
        raise


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser_for(argv)
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    if args.command in ("serve", "extproc"):
        return _run_serve(args)
    module, _ = _DELEGATES[args.command]
    mod = _load(module)
    if mod is None:
        print(
            f"tokengate {args.command}: not available in this installation ({module} is missing)",
            file=sys.stderr,
        )
        return 2
    try:
        return int(mod.run(args))
    except BrokenPipeError:
        # `tokengate doctor | head`: the reader left; say nothing more (and not at exit either).
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


def build_parser_for(argv: list[str]) -> argparse.ArgumentParser:
    """The parser, importing only the delegate module that ``argv`` asks for (imports are lazy)."""
    parser = argparse.ArgumentParser(
        prog="tokengate", description="Token-budget admission gateway for LLM inference"
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    _add_serve(sub)
    wanted = argv[0] if argv else None
    for name, (module, help_text) in _DELEGATES.items():
        p = sub.add_parser(name, help=help_text, description=help_text, add_help=True)
        if name == wanted:
            mod = _load(module)
            if mod is not None:
                mod.add_arguments(p)
            else:
                p.add_argument("rest", nargs=argparse.REMAINDER)
    return parser


if __name__ == "__main__":
    sys.exit(main())

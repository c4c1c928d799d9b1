"""``tokengate backend``: run the reference backend with uvicorn.

The gateway's CLI wires ``add_arguments`` / ``run`` as its ``backend`` subcommand; without it,
``python -m backends.reference [options]`` does the same.
"""

from __future__ import annotations

import argparse
import sys

from backends.reference.server import BackendSettings, build_app


def add_arguments(parser: argparse.ArgumentParser) -> None:
    d = BackendSettings()
    parser.add_argument("--host", default=d.host)
    parser.add_argument("--port", type=int, default=d.port)
    parser.add_argument("--executor", choices=["sim", "torch"], default=d.executor)
    parser.add_argument("--model", default=d.model, help="served model name (default: %(default)s)")
    parser.add_argument("--max-model-len", type=int, default=d.max_model_len)
    parser.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=None,
        help="per-step token budget (default: 8192 with chunked prefill, else max(8192, max-model-len))",
    )
    parser.add_argument("--max-num-seqs", type=int, default=d.max_num_seqs)
    parser.add_argument(
        "--chunked-prefill", action=argparse.BooleanOptionalAction, default=d.enable_chunked_prefill,
        help="split long prompts across steps (default: on, like vLLM v1)",
    )  # fmt: skip
    parser.add_argument(
        "--long-prefill-token-threshold", type=int, default=d.long_prefill_token_threshold,
        help="cap on one request's prefill chunk per step, and the size above which a prompt is long "
        "(0 = no cap; 4%% of --max-model-len when --max-num-partial-prefills > 1)",
    )  # fmt: skip
    parser.add_argument(
        "--max-num-partial-prefills", type=int, default=d.max_num_partial_prefills,
        help="at most this many requests get a prefill chunk per step (1 = no limit, vLLM's default)",
    )  # fmt: skip
    parser.add_argument(
        "--max-long-partial-prefills", type=int, default=d.max_long_partial_prefills,
        help="of those, at most this many long prompts; below --max-num-partial-prefills, short prompts "
        "jump ahead of long ones",
    )  # fmt: skip
    parser.add_argument("--scheduling-policy", choices=["fcfs", "priority"], default=d.scheduling_policy)
    parser.add_argument(
        "--priority-scope", choices=["step", "queue"], default=d.priority_scope,
        help="priority policy: 'step' orders every step by priority (a low-priority long prefill gets the "
        "budget left over); 'queue' orders only the waiting queue, as vLLM v1 does",
    )  # fmt: skip
    parser.add_argument(
        "--priority-aging-s", type=float, default=d.priority_aging_s,
        help="step scope: a request gains one priority level per this many seconds since it arrived, so "
        "none starves (0 = no aging)",
    )  # fmt: skip
    parser.add_argument("--block-size", type=int, default=d.block_size)
    parser.add_argument(
        "--num-blocks",
        type=int,
        default=None,
        help="KV-cache blocks (default: sim ~450k tokens; torch: auto)",
    )
    parser.add_argument("--cost-model", metavar="FILE", default=None, help="sim cost model (JSON or YAML)")
    parser.add_argument(
        "--time-scale",
        type=float,
        default=d.time_scale,
        help="sim: multiply modelled step times (0 = no sleeping)",
    )
    parser.add_argument("--sim-eos-after", type=int, default=None, help="sim: emit EOS at this output index")
    parser.add_argument("--shape", default=d.shape, help="torch: tiny | llama-3.2-1b | llama-3.1-8b")
    parser.add_argument("--model-dir", default=None, help="torch: a Hugging Face model directory")
    parser.add_argument("--device", default=None, help="torch: cuda | cpu (default: cuda if available)")
    parser.add_argument("--dtype", default=None, help="torch: bfloat16 | float16 | float32")
    parser.add_argument("--seed", type=int, default=d.seed)
    parser.add_argument("--log-level", default="info")


def settings_from_args(args: argparse.Namespace) -> BackendSettings:
    return BackendSettings(
        host=args.host,
        port=args.port,
        executor=args.executor,
        model=args.model,
        max_model_len=args.max_model_len,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_num_seqs=args.max_num_seqs,
        enable_chunked_prefill=args.chunked_prefill,
        long_prefill_token_threshold=args.long_prefill_token_threshold,
        max_num_partial_prefills=args.max_num_partial_prefills,
        max_long_partial_prefills=args.max_long_partial_prefills,
        scheduling_policy=args.scheduling_policy,
        priority_scope=args.priority_scope,
        priority_aging_s=args.priority_aging_s,
        block_size=args.block_size,
        num_blocks=args.num_blocks,
        cost_model=args.cost_model,
        time_scale=args.time_scale,
        sim_eos_after=args.sim_eos_after,
        shape=args.shape,
        model_dir=args.model_dir,
        device=args.device,
        dtype=args.dtype,
        seed=args.seed,
    )


def run(args: argparse.Namespace) -> int:
    import uvicorn

    settings = settings_from_args(args)
    try:
        app = build_app(settings)
    except (ValueError, OSError) as exc:
        print(f"tokengate backend: {exc}", file=sys.stderr)
        return 2
    uvicorn.run(app, host=settings.host, port=settings.port, log_level=args.log_level, access_log=False)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tokengate backend", description="tokengate reference backend")
    add_arguments(parser)
    return run(parser.parse_args(argv))

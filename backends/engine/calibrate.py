"""Re-calibrate the simulated executor's cost model from a real executor's step times.

``python -m backends.engine.calibrate --executor torch --shape llama-3.1-8b --device cuda --out
cost.json`` runs a grid of synthetic steps (decode batches at several context lengths, prefill
chunks at several prefixes, a few mixed steps) through the executor, records each step's time
(median of a few repeats, after a warm-up), fits the ``CostModel`` to them and writes it as JSON
for ``tokengate backend --cost-model cost.json``.

The fit: for each candidate knee, weighted least squares (weights 1/time, i.e. relative error,
so 5 ms decode steps matter as much as 1 s prefills) of time against
[1, max(0, tokens - knee), decode KV length, prefill pairs], with any coefficient that comes out
negative pinned to zero; the knee with the smallest error wins. A feature the samples never
exercise keeps the base model's coefficient.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from backends.engine.factory import ExecutorSettings, build_executor
from backends.engine.kv_cache import BlockManager
from backends.engine.sim_executor import CostModel, StepFeatures
from backends.engine.types import Executor, SeqStep, StepPlan

DEFAULT_KNEES = (0, 16, 32, 64, 96, 128, 192, 256, 384, 512, 768, 1024)
_FIELDS = ("floor_s", "per_token_s", "decode_kv_s", "prefill_pair_s")


@dataclass(frozen=True, slots=True)
class Sample:
    features: StepFeatures
    seconds: float


@dataclass(frozen=True, slots=True)
class Fit:
    model: CostModel
    median_rel_error: float
    max_rel_error: float
    samples: int


def _solve(a: list[list[float]], b: list[float]) -> list[float] | None:
    """Gaussian elimination with partial pivoting; None if singular."""
    n = len(b)
    m = [[*row, rhs] for row, rhs in zip(a, b, strict=True)]
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(m[r][col]))
        if abs(m[pivot][col]) < 1e-12:
            return None
        m[col], m[pivot] = m[pivot], m[col]
        for r in range(col + 1, n):
            factor = m[r][col] / m[col][col]
            for c in range(col, n + 1):
                m[r][c] -= factor * m[col][c]
    x = [0.0] * n
    for r in range(n - 1, -1, -1):
        x[r] = (m[r][n] - sum(m[r][c] * x[c] for c in range(r + 1, n))) / m[r][r]
    return x


def _weighted_nonneg_lsq(rows: list[list[float]], ys: list[float], active: list[int]) -> dict[int, float]:
    """Least squares of rows -> ys over columns ``active``, relative-error weighted, coefs >= 0."""
    active = list(active)
    while active:
        scale = [max(abs(r[c]) for r in rows) or 1.0 for c in active]
        xs = [
            [r[c] / s / y for c, s in zip(active, scale, strict=True)] for r, y in zip(rows, ys, strict=True)
        ]
        ata = [[sum(x[i] * x[j] for x in xs) for j in range(len(active))] for i in range(len(active))]
        atb = [sum(x[i] for x in xs) for i in range(len(active))]  # target y/y = 1
        sol = _solve(ata, atb)
        if sol is None:
            active.pop()  # degenerate: drop the last (least essential) column and retry
            continue
        coefs = {c: v / s for c, v, s in zip(active, sol, scale, strict=True)}
        negative = [c for c, v in coefs.items() if v < 0]
        if not negative:
            return coefs
        active.remove(min(negative, key=lambda c: coefs[c]))
    return {}


def fit_cost_model(
    samples: Sequence[Sample], base: CostModel | None = None, knees: Sequence[int] = DEFAULT_KNEES
) -> Fit:
    base = base or CostModel()
    usable = [s for s in samples if s.seconds > 0 and s.features.tokens > 0]
    if len(usable) < 4:
        raise ValueError(f"need at least 4 timed steps to fit, got {len(usable)}")
    ys = [s.seconds for s in usable]
    best: Fit | None = None
    for knee in knees:
        rows = [
            [
                1.0,
                float(max(0, s.features.tokens - knee)),
                float(s.features.decode_kv),
                s.features.prefill_pairs,
            ]
            for s in usable
        ]
        present = [c for c in range(4) if any(r[c] for r in rows)]
        coefs = _weighted_nonneg_lsq(rows, ys, present)
        values = {name: getattr(base, name) for name in _FIELDS}
        for c in present:
            values[_FIELDS[c]] = coefs.get(c, 0.0)
        model = replace(base, knee_tokens=knee, **values)
        errors = [abs(model.time_for(s.features) - s.seconds) / s.seconds for s in usable]
        fit = Fit(model, statistics.median(errors), max(errors), len(usable))
        if best is None or (fit.median_rel_error, fit.max_rel_error) < (
            best.median_rel_error,
            best.max_rel_error,
        ):
            best = fit
    assert best is not None
    return best


def calibration_plans(*, block_size: int, num_blocks: int, max_len: int) -> list[StepPlan]:
    """A grid of synthetic steps that fits in the executor's KV cache and context length."""
    capacity = num_blocks * block_size
    shapes: list[list[tuple[int, int, bool]]] = []  # per plan: (start_pos, length, is_decode)
    for batch in (1, 4, 16, 64, 128, 256):
        for ctx in (128, 1024, 4096):
            shapes.append([(ctx - 1, 1, True)] * batch)
    for chunk in (16, 64, 128, 256, 512, 1024, 2048, 4096, 8192):
        for prefix in (0, 4096, 16384):
            shapes.append([(prefix, chunk, False)])
    shapes.append([(1023, 1, True)] * 32 + [(0, 512, False)])
    shapes.append([(4095, 1, True)] * 64 + [(8192, 2048, False)])
    shapes.append([(0, 28_000, False)])

    plans: list[StepPlan] = []
    for p, seqs in enumerate(shapes):
        if any(start + n > max_len for start, n, _ in seqs):
            continue
        blocks = BlockManager(num_blocks, block_size)
        steps: list[SeqStep] = []
        for i, (start, n, is_decode) in enumerate(seqs):
            rid = f"cal{p}-{i}"
            if start + n > capacity or not blocks.allocate(rid, start + n):
                break
            tokens = [100 + (start + j) * 7 % 1000 for j in range(n)]
            steps.append(SeqStep(rid, tokens, start, blocks.block_table(rid), True, 1 if is_decode else 0))
        else:
            plans.append(StepPlan(seqs=steps))
    return plans


def measure(executor: Executor, plans: Sequence[StepPlan], repeats: int = 3, warmup: int = 1) -> list[Sample]:
    samples: list[Sample] = []
    for plan in plans:
        for _ in range(warmup):
            executor.execute(plan)
        times = [executor.execute(plan).step_time_s for _ in range(repeats)]
        samples.append(Sample(StepFeatures.of(plan), statistics.median(times)))
    return samples


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m backends.engine.calibrate", description=__doc__.split("\n")[1]
    )
    parser.add_argument("--executor", choices=["sim", "torch"], default="torch")
    parser.add_argument("--shape", default="tiny")
    parser.add_argument("--model-dir", default=None)
    parser.add_argument("--device", default=None)
    parser.add_argument("--dtype", default=None)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument(
        "--num-blocks",
        type=int,
        default=None,
        help="default: as the server (sim ~450k tokens; torch from memory)",
    )
    parser.add_argument(
        "--max-model-len", type=int, default=32768, help="longest step to time (prefix + chunk)"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--cost-model", default=None, help="sim: the model to recover (a self-check)")
    parser.add_argument("--out", default=None, help="write the fitted cost model here (JSON)")
    args = parser.parse_args(argv)

    executor = build_executor(
        ExecutorSettings(
            kind=args.executor,
            block_size=args.block_size,
            num_blocks=args.num_blocks,
            max_model_len=args.max_model_len,
            cost_model=args.cost_model,
            shape=args.shape,
            model_dir=args.model_dir,
            device=args.device,
            dtype=args.dtype,
            seed=args.seed,
        )
    )
    plans = calibration_plans(
        block_size=executor.block_size, num_blocks=executor.num_blocks, max_len=args.max_model_len
    )
    samples = measure(executor, plans, repeats=args.repeats)
    fit = fit_cost_model(samples)
    print(f"{'tokens':>7} {'decode_kv':>10} {'prefill_pairs':>14} {'measured_ms':>12} {'model_ms':>9}")
    for s in samples:
        f = s.features
        print(
            f"{f.tokens:>7} {f.decode_kv:>10} {f.prefill_pairs:>14.3g} {s.seconds * 1e3:>12.3f} "
            f"{fit.model.time_for(f) * 1e3:>9.3f}"
        )
    print(
        f"fit over {fit.samples} steps: median error {fit.median_rel_error:.1%}, max {fit.max_rel_error:.1%}\n"
        + json.dumps(fit.model.to_dict(), indent=2)
    )
    if args.out:
        Path(args.out).write_text(json.dumps(fit.model.to_dict(), indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

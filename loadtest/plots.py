"""PNG charts of a comparison: the head-of-line fingerprint over time and latency CDFs.

matplotlib is a dev/optional dependency, imported only here and only when plotting, on the Agg
backend (no display needed).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from loadtest.records import RunResult
from loadtest.spec import WorkloadSpec
from loadtest.stats import fingerprint_window, p99_over_time

_PHASE_COLOURS = ("#fde2e2", "#e2f0fd", "#e8fde2", "#fdf5e2")


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _shade_phases(ax: Any, spec: WorkloadSpec) -> None:
    for i, phase in enumerate(spec.phases):
        colour = _PHASE_COLOURS[i % len(_PHASE_COLOURS)]
        for j, (a, b) in enumerate(phase.windows):
            ax.axvspan(a, b, color=colour, alpha=0.6, lw=0, label=f"phase {phase.name}" if j == 0 else None)


def _log_axis_labels(axis: Any, plt: Any) -> None:
    axis.set_major_formatter(plt.matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}"))
    axis.set_minor_formatter(plt.NullFormatter())


def fingerprint_chart(spec: WorkloadSpec, runs: Sequence[RunResult], path: Path) -> Path:
    """Per-class p99 TTFT over time, one panel per target: the short class following the long one is HOL.

    Classes with too few requests for a sliding p99 (the noisy tenant's few huge prompts) are drawn as
    one marker per request instead, so the moments they arrive are visible next to the short class.
    """
    plt = _pyplot()
    fig, axes = plt.subplots(
        len(runs), 1, figsize=(10, 2.8 * len(runs) + 0.6), sharex=True, sharey=True, squeeze=False
    )
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, run in zip(axes[:, 0], runs, strict=True):
        _shade_phases(ax, spec)
        for k, group in enumerate(spec.groups):
            colour = colours[k % len(colours)]
            series = p99_over_time(run, group)
            if len(series) >= 2:
                xs, ys = zip(*series, strict=True)
                ax.plot(xs, [y * 1000 for y in ys], marker=".", color=colour, label=f"{group} p99")
            else:
                points = [
                    (r.sent_s, r.ttft_s) for r in run.records if r.group == group and r.ttft_s is not None
                ]
                if points:
                    xs, ys = zip(*points, strict=True)
                    ax.scatter(
                        xs, [y * 1000 for y in ys], marker="v", s=40, color=colour, label=f"{group} (each)"
                    )
        ax.set_yscale("log")
        _log_axis_labels(ax.yaxis, plt)
        ax.set_ylabel("TTFT (ms)")
        ax.set_title(run.target, loc="left", fontsize=10)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(loc="upper left", fontsize=8)
    horizon = max((r.scheduled_s for run in runs for r in run.records), default=0.0)
    axes[-1, 0].set_xlabel(f"send time (s); p99 over a {fingerprint_window(horizon)[0]:.2g} s sliding window")
    fig.suptitle(f"{spec.name}: p99 time to first token per class over time")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _cdf(values: list[float]) -> tuple[list[float], list[float]]:
    ordered = sorted(values)
    n = len(ordered)
    return ordered, [(i + 1) / n for i in range(n)]


def cdf_chart(spec: WorkloadSpec, runs: Sequence[RunResult], path: Path) -> Path:
    """TTFT (top row) and end-to-end (bottom row) CDFs per class, one line per target."""
    plt = _pyplot()
    groups = spec.groups
    fig, axes = plt.subplots(2, len(groups), figsize=(4.5 * len(groups) + 0.5, 7), squeeze=False)
    for col, group in enumerate(groups):
        for row, (attr, label) in enumerate((("ttft_s", "TTFT (s)"), ("e2e_s", "end-to-end (s)"))):
            ax = axes[row, col]
            for run in runs:
                values = [getattr(r, attr) for r in run.records if r.group == group and r.ok]
                values = [v for v in values if v is not None and v > 0]
                if values:
                    xs, ys = _cdf(values)
                    ax.step(xs, ys, where="post", label=run.target)
            if ax.has_data():
                lo, hi = ax.dataLim.intervalx
                if lo > 0 and hi / lo > 10:  # log only pays off across decades
                    ax.set_xscale("log")
                    _log_axis_labels(ax.xaxis, plt)
            ax.set_xlabel(label)
            ax.set_ylim(0, 1.01)
            ax.grid(True, which="both", alpha=0.3)
            if row == 0:
                ax.set_title(group)
            if col == 0:
                ax.set_ylabel("fraction of requests")
            ax.legend(fontsize=8, loc="lower right")
    fig.suptitle(f"{spec.name}: latency CDFs")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_plots(out_dir: Path, spec: WorkloadSpec, runs: Sequence[RunResult]) -> list[Path]:
    """Both charts; returns [] with no error when matplotlib is not installed."""
    try:
        _pyplot()
    except ImportError:
        return []
    out_dir.mkdir(parents=True, exist_ok=True)
    return [
        fingerprint_chart(spec, runs, out_dir / "fingerprint_p99_ttft.png"),
        cdf_chart(spec, runs, out_dir / "latency_cdf.png"),
    ]

"""Figures over result directories: latency CDFs and per-node step timelines."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
from matplotlib.backend_bases import FigureCanvasBase

from disagg.core.metrics import read_results
from disagg.errors import ConfigError


def _cdf(ax: plt.Axes, values: pd.Series, label: str) -> None:
    v = np.sort(values.dropna().to_numpy(float))
    if len(v):
        ax.plot(v, np.arange(1, len(v) + 1) / len(v), label=label)


def _timeline(ax: plt.Axes, steps: pd.DataFrame, title: str, max_nodes: int = 4) -> None:
    """Pass time of each node over the run: decode-only runs are flat segments, passes that
    carry a prefill are dots (a spike there is the stutter decodes feel)."""
    for node in sorted(steps.node.unique())[:max_nodes]:
        s = steps[steps.node == node]
        per_pass = s.duration_s / s.steps * 1e3
        ax.scatter(s.start_s, per_pass, s=4, label=node)
    ax.set_title(title, fontsize=9)
    ax.set_xlabel("time (s)")
    ax.set_ylabel("pass time (ms)")
    ax.set_yscale("log")
    ax.legend(fontsize=7, markerscale=3)


def figure_path(out: Path, name: str = "plot.png") -> Path:
    """The file a figure asked for at `out` is written to: DIR/`name` for an existing
    directory, `out` with .png added when it has no extension (as matplotlib saves it), else
    `out`, whose extension must be a format matplotlib writes (png, pdf, svg, ...)."""
    if out.is_dir():
        return out / name
    if not out.suffix:
        return out.with_name(out.name + ".png")
    formats = FigureCanvasBase.get_supported_filetypes()
    if out.suffix[1:].lower() not in formats:
        raise ConfigError(
            f"figure {out}: {out.suffix!r} is not a format matplotlib writes "
            f"(use one of {', '.join(sorted(formats))})"
        )
    return out


def plot_runs(run_dirs: list[Path], out: Path) -> Path:
    """TTFT and TPOT CDFs of every run, and one step timeline per run, into one figure; returns
    the file written (`figure_path(out)`: DIR/plot.png for a directory)."""
    out = figure_path(out)
    runs = [(d, *read_results(d)) for d in run_dirs]
    fig = plt.figure(figsize=(11, 4 + 2.6 * len(runs)))
    grid = fig.add_gridspec(1 + len(runs), 2)
    ttft, tpot = fig.add_subplot(grid[0, 0]), fig.add_subplot(grid[0, 1])
    for d, req, _, _, _ in runs:
        done = req[req.status == "finished"]
        _cdf(ttft, done.ttft_s * 1e3, d.name)
        _cdf(tpot, done.tpot_s * 1e3, d.name)
    for ax, name in ((ttft, "TTFT (ms)"), (tpot, "TPOT (ms)")):
        ax.set_xlabel(name)
        ax.set_ylabel("fraction of requests")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    ttft.set_xscale("log")
    for i, (d, _, steps, _, _) in enumerate(runs):
        _timeline(fig.add_subplot(grid[1 + i, :]), steps, f"{d.name}: forward passes per node")
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


SWEEP_PANELS = [
    ("ttft_s_p50", "TTFT p50 (ms)"),
    ("tpot_s_p50", "TPOT p50 (ms)"),
    ("itl_s_p999", "inter-token p99.9 (ms)"),
    ("output_tps_per_gpu", "output tokens/s per GPU"),
]


def plot_sweep(df: pd.DataFrame, param: str, out: Path) -> Path:
    """One panel per metric against the swept setting, one line per experiment."""
    fig, axes = plt.subplots(1, len(SWEEP_PANELS), figsize=(4 * len(SWEEP_PANELS), 3.4))
    for ax, (key, label) in zip(axes, SWEEP_PANELS, strict=True):
        scale = 1e3 if key.endswith("_s_p50") or key.endswith("_p999") else 1
        for name, g in df.groupby("experiment", sort=False):
            ax.plot(g[param], g[key] * scale, marker="o", label=str(name))
        ax.set_xlabel(param)
        ax.set_title(label, fontsize=10)
        ax.grid(alpha=0.3)
        if key == "ttft_s_p50":
            ax.set_yscale("log")
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out

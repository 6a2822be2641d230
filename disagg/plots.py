"""Figures over result directories: latency CDFs and per-node step timelines."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
from matplotlib.backend_bases import FigureCanvasBase
from matplotlib.figure import Figure

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


SWEEP_PANELS = [  # (summary key, title, scale to the unit shown)
    ("ttft_s_p50", "TTFT p50 (ms)", 1e3),
    ("tpot_s_p50", "TPOT p50 (ms)", 1e3),
    ("itl_s_p999", "inter-token p99.9 (ms)", 1e3),
    ("output_tps_per_gpu", "output tokens/s per GPU", 1),
]


def plot_sweep(df: pd.DataFrame, params: str | list[str], out: Path) -> Path:
    """Write `sweep_figure(df, params)` to `out`; return `out`."""
    fig = sweep_figure(df, [params] if isinstance(params, str) else params)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def sweep_figure(df: pd.DataFrame, params: list[str]) -> Figure:
    """One panel per metric against the first swept setting, one line per experiment and
    combination of the other settings (in the table's order)."""
    x, others = params[0], params[1:]
    panels = [panel for panel in SWEEP_PANELS if panel[0] in df]
    fig, axes = plt.subplots(1, len(panels), figsize=(4 * len(panels), 3.4), squeeze=False)
    groups = list(df.groupby(["experiment", *others], sort=False))
    for ax, (key, title, scale) in zip(axes[0], panels, strict=True):
        for name, g in groups:
            ax.plot(g[x], g[key] * scale, marker="o", label=_line_label(name, others, df))
        ax.set_xlabel(x)
        ax.set_title(title, fontsize=10)
        ax.grid(alpha=0.3)
        if key.startswith("ttft"):
            ax.set_yscale("log")
    axes[0][0].legend(fontsize=7 if len(groups) > 6 else 8)
    fig.tight_layout()
    return fig


def _line_label(name: object, others: list[str], df: pd.DataFrame) -> str:
    """`experiment, key=value, ...` (the experiment left out when the sweep has one)."""
    values = list(name) if isinstance(name, tuple) else [name]
    parts = [
        f"{k.rsplit('.', 1)[-1]}={f'{v:g}' if isinstance(v, float) else v}"
        for k, v in zip(others, values[1:], strict=True)
    ]
    if df.experiment.nunique() > 1 or not parts:
        parts.insert(0, str(values[0]))
    return ", ".join(parts)

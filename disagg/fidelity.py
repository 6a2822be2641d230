"""How far the simulator is from the real backend: sim/hw ratios, tolerances, the report files.

A fidelity table has one row per (run, metric): the metric's value measured by the hw backend
(`hw`) and in the run's two replays, with a measured step-time profile (`sim_profile`) and with
the roofline (`sim_roofline`). Metrics are summary keys (disagg/core/metrics.py `summarize`).
A tolerance is a percentage by metric; it is judged on the profile replay (the calibrated
simulator): met when |sim_profile / hw - 1| * 100 <= tolerance. No torch here.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd

from disagg.core.metrics import ttft_parts
from disagg.errors import ConfigError

# the tolerance's name for a metric -> its summary key, in the report's order
METRICS: dict[str, str] = {
    "ttft_p50": "ttft_s_p50",
    "ttft_p90": "ttft_s_p90",
    "tpot_p50": "tpot_s_p50",
    "tpot_p90": "tpot_s_p90",
    "itl_p99": "itl_s_p99",
    "output_throughput": "output_throughput",
}
LABELS = {
    "ttft_s_p50": "TTFT p50",
    "ttft_s_p90": "TTFT p90",
    "tpot_s_p50": "TPOT p50",
    "tpot_s_p90": "TPOT p90",
    "itl_s_p99": "ITL p99",
    "output_throughput": "output tok/s",
}
SOURCES = ("sim_profile", "sim_roofline")
COLUMNS = ["run", "metric", "hw", *SOURCES]


def parse_tolerances(text: str | None) -> dict[str, float]:
    """`ttft_p50=5,tpot_p50=3%` -> {summary key: percent}, in the order given. A name is one of
    METRICS' names or its summary key; a percent is a finite number >= 0 (a trailing % is
    allowed). ConfigError naming the item for anything else."""
    out: dict[str, float] = {}
    keys = set(METRICS.values())
    for item in (text or "").split(","):
        if not item.strip():
            continue
        name, sep, value = (s.strip() for s in item.partition("="))
        if not sep:
            raise ConfigError(f"--tolerance {item.strip()!r}: expected METRIC=PERCENT")
        key = METRICS.get(name, name if name in keys else None)
        if key is None:
            known = ", ".join(METRICS)
            raise ConfigError(f"--tolerance {name!r}: unknown metric; known: {known}")
        try:
            pct = float(value.removesuffix("%"))
        except ValueError:
            pct = math.nan
        if not math.isfinite(pct) or pct < 0:
            raise ConfigError(f"--tolerance {name}={value!r}: give a percentage >= 0")
        out[key] = pct
    return out


def fidelity_table(runs: Mapping[str, Mapping[str, Mapping[str, Any]]]) -> pd.DataFrame:
    """The table of COLUMNS from each run's summaries by source ("hw", "sim_profile",
    "sim_roofline"), one row per run and metric (METRICS' order); a value a summary lacks is
    NaN."""
    rows = [
        (run, key, *(_value(by_source.get(s, {}), key) for s in ("hw", *SOURCES)))
        for run, by_source in runs.items()
        for key in METRICS.values()
    ]
    return pd.DataFrame(rows, columns=COLUMNS)


def median_summary(summaries: Sequence[Mapping[str, Any]]) -> dict[str, float]:
    """Each metric's median over the summaries of runs of one cell (NaN where none has it):
    the hw value that a cell run more than once is judged on."""
    return {key: _median(_values(summaries, key)) for key in METRICS.values()}


def _values(summaries: Sequence[Mapping[str, Any]], key: str) -> list[float]:
    return [v for s in summaries if not math.isnan(v := _value(s, key))]


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else math.nan


SPREAD_COLUMNS = ["run", "metric", "runs", "low", "high", "spread"]


def spread_table(runs: Mapping[str, Sequence[Mapping[str, Any]]]) -> pd.DataFrame:
    """How far the hw backend moves from itself: for each cell run more than once (its summaries
    in `runs`, all of one experiment and seed), each metric's lowest and highest value and the
    spread between them (high / low - 1)."""
    rows = []
    for run, summaries in runs.items():
        for key in METRICS.values():
            values = _values(summaries, key)
            if len(values) > 1:
                low, high = min(values), max(values)
                rows.append((run, key, len(values), low, high, ratio(high, low) - 1))
    return pd.DataFrame(rows, columns=SPREAD_COLUMNS)


def spread_markdown(spread: pd.DataFrame) -> str:
    """fidelity.md's section on the cells run more than once (`spread_table`)."""
    metrics = list(dict.fromkeys(spread.metric))
    wide = spread.pivot(index="run", columns="metric", values="spread")
    runs = int(spread.runs.max())
    lines = [
        "## The same run again (hw)",
        "",
        f"Each cell was run {runs} times on one workload (one seed) and is judged on the median. "
        "Each entry is the highest value over the lowest, less 1: how far the real backend "
        "moves from itself, which no simulator can get under.",
        "",
        "| run | " + " | ".join(LABELS.get(m, m) for m in metrics) + " |",
        "|---|" + "---:|" * len(metrics),
    ]
    for run in dict.fromkeys(spread.run):
        cells = [_cell(float(wide.loc[run, m])) for m in metrics]
        lines.append(f"| {run} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def widest_spreads(spread: pd.DataFrame) -> str:
    """The largest spread of `spread` (`spread_table`) by metric, in words."""
    widest = spread.spread.groupby(spread.metric, sort=False).max()
    return ", ".join(f"{LABELS.get(str(m), str(m))} {float(g):.3f}" for m, g in widest.items())


def _value(summary: Mapping[str, Any], key: str) -> float:
    v = summary.get(key)
    return float(v) if isinstance(v, int | float) else math.nan


def ratio(sim: float, hw: float) -> float:
    """sim / hw; NaN when either is NaN or hw is 0."""
    if hw == 0 or math.isnan(hw) or math.isnan(sim):
        return math.nan
    return sim / hw


def ratios(table: pd.DataFrame) -> pd.DataFrame:
    """run, metric and one column per source: sim / hw."""
    out = table[["run", "metric"]].copy()
    for s in SOURCES:
        out[s] = [ratio(a, b) for a, b in zip(table[s], table.hw, strict=True)]
    return out


@dataclass(frozen=True)
class Verdict:
    """One (run, metric) cell judged against its tolerance (percent)."""

    run: str
    metric: str
    ratio: float
    tolerance_pct: float

    @property
    def error_pct(self) -> float:
        return abs(self.ratio - 1) * 100

    @property
    def met(self) -> bool:
        """Within the tolerance; an error equal to it, up to float rounding, is within."""
        return not math.isnan(self.ratio) and self.error_pct <= self.tolerance_pct + 1e-9

    def __str__(self) -> str:
        got = "no ratio" if math.isnan(self.ratio) else f"sim/hw {self.ratio:.4g}"
        return f"{self.run} {self.metric}: {got}, tolerance {self.tolerance_pct:g}%"


def judge(table: pd.DataFrame, tolerances: Mapping[str, float]) -> list[Verdict]:
    """Every cell of a metric with a tolerance, judged on its profile replay, in table order."""
    r = ratios(table)
    return [
        Verdict(run, metric, value, tolerances[metric])
        for run, metric, value in zip(r.run, r.metric, r.sim_profile, strict=True)
        if metric in tolerances
    ]


def _cell(value: float) -> str:
    return "-" if math.isnan(value) else f"{value:.4g}"


def near_range(table: pd.DataFrame, verdict: Verdict, spread: pd.DataFrame) -> bool | None:
    """Whether the profile replay of `verdict`'s cell lies within its tolerance of the range
    its hw runs span (`spread_table`): low x (1 - tolerance) to high x (1 + tolerance); None
    for a cell run once."""
    hit = spread[(spread.run == verdict.run) & (spread.metric == verdict.metric)]
    row = table[(table.run == verdict.run) & (table.metric == verdict.metric)]
    if hit.empty or row.empty:
        return None
    t, sim = verdict.tolerance_pct / 100, float(row.sim_profile.iloc[0])
    return float(hit.low.iloc[0]) * (1 - t) <= sim <= float(hit.high.iloc[0]) * (1 + t)


def markdown(
    table: pd.DataFrame, verdicts: list[Verdict], spread: pd.DataFrame | None = None
) -> str:
    """The report: sim/hw ratios per run and metric (profile / roofline), then each judged cell
    and whether its tolerance was met (of the median of its hw runs), and, for cells run more
    than once (`spread`), whether it was within it of the range the runs span (`near_range`):
    a miss outside that range is the simulator's, not the hardware's spread."""
    r = ratios(table)
    metrics = list(dict.fromkeys(r.metric))
    lines = [
        "# Fidelity: simulated over measured",
        "",
        "Each cell is sim/hw, with the measured profile / with the roofline.",
        "",
        "| run | " + " | ".join(LABELS.get(m, m) for m in metrics) + " |",
        "|---|" + "---:|" * len(metrics),
    ]
    for run, g in r.groupby("run", sort=False):
        pairs = zip(g.sim_profile, g.sim_roofline, strict=True)
        cells = [f"{_cell(p)} / {_cell(q)}" for p, q in pairs]
        lines.append(f"| {run} | " + " | ".join(cells) + " |")
    lines += ["", "## Tolerances (on the profile replay)", ""]
    if not verdicts:
        lines.append("None given (`--tolerance METRIC=PERCENT,...`).")
    else:
        met = sum(v.met for v in verdicts)
        near = [None if spread is None else near_range(table, v, spread) for v in verdicts]
        ranged = [n for n in near if n is not None]
        said = f"{met} of {len(verdicts)} cells met."
        if ranged:
            said += (
                f" {sum(ranged)} of the {len(ranged)} cells run more than once were within "
                "their tolerance of the range their runs span (the last column): the misses "
                "outside it are the simulator's, not the hardware's spread."
            )
        lines += [
            said,
            "",
            "| run | metric | sim/hw | error % | tolerance % | met | near the hw range |",
            "|---|---|---:|---:|---:|---|---|",
        ]
        for v, n in zip(verdicts, near, strict=True):
            err = _cell(v.error_pct)
            cells = [v.run, v.metric, _cell(v.ratio), err, f"{v.tolerance_pct:g}"]
            cells += ["yes" if v.met else "**no**", "-" if n is None else ("yes" if n else "no")]
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


REPEAT_COLUMNS = ["run", "metric", "calibration", "validation", "gap"]


def repeat_table(table: pd.DataFrame, calibration: pd.DataFrame) -> pd.DataFrame:
    """The profile replay's sim/hw of each run in `calibration` (a fidelity table of runs at a
    validation run's mode and load, on seeds of their own, labelled as that run) beside the
    validation run's in `table`, by metric, and the gap between them (calibration less
    validation): how far a cell moves on another workload of the same load."""
    val = ratios(table).set_index(["run", "metric"]).sim_profile
    cal = ratios(calibration)
    rows = [
        (run, metric, c, v, c - v)
        for run, metric, c in zip(cal.run, cal.metric, cal.sim_profile, strict=True)
        if not math.isnan(v := float(val.get((run, metric), math.nan)))
    ]
    return pd.DataFrame(rows, columns=REPEAT_COLUMNS)


def repeat_markdown(repeats: pd.DataFrame) -> str:
    """fidelity.md's section on the calibration runs (`repeat_table`): their sim/hw beside the
    validation runs', and the largest gap per metric."""
    lines = [
        "## Same mode and load, another seed",
        "",
        "Each cell is sim/hw on the profile: the calibration run at that run's mode and load (a "
        "workload of its own seed) / the run. The calibration runs fitted the loop costs and "
        "the shares, so their cells are in sample. The gap between the two is how far "
        "one run's cell moves from one workload to the next.",
        "",
        *_pairs(repeats, "calibration", "validation"),
    ]
    return "\n".join([*lines, "", f"Largest gap: {widest_gaps(repeats)}."]) + "\n"


def _pairs(table: pd.DataFrame, first: str, second: str) -> list[str]:
    """A markdown table of `table`'s runs by metric, each cell its `first` / `second` ratios
    ("-" for a metric a run has no row of)."""
    metrics = list(dict.fromkeys(table.metric))
    lines = [
        "| run | " + " | ".join(LABELS.get(m, m) for m in metrics) + " |",
        "|---|" + "---:|" * len(metrics),
    ]
    for run, g in table.groupby("run", sort=False):
        by = g.set_index("metric")
        cells = [
            f"{_cell(by[first][m])} / {_cell(by[second][m])}" if m in by.index else "-"
            for m in metrics
        ]
        lines.append(f"| {run} | " + " | ".join(cells) + " |")
    return lines


def widest_gaps(repeats: pd.DataFrame) -> str:
    """The largest gap of `repeats` (`repeat_table`) by metric, in words."""
    widest = repeats.gap.abs().groupby(repeats.metric, sort=False).max()
    return ", ".join(f"{LABELS.get(str(m), str(m))} {float(g):.3f}" for m, g in widest.items())


OWN_HOST_COLUMNS = ["run", "metric", "own_host", "calibrated"]


def own_host_table(table: pd.DataFrame, own: pd.DataFrame) -> pd.DataFrame:
    """The profile replay's sim/hw of each run in `own` (a fidelity table of the same runs,
    replayed with the host time per pass fitted on each run itself) beside the calibrated
    replay's in `table`, by metric."""
    calibrated = ratios(table).set_index(["run", "metric"]).sim_profile
    o = ratios(own)
    rows = [
        (run, metric, x, float(calibrated.get((run, metric), math.nan)))
        for run, metric, x in zip(o.run, o.metric, o.sim_profile, strict=True)
    ]
    return pd.DataFrame(rows, columns=OWN_HOST_COLUMNS)


HOST_FIT_FIELDS = {  # a `[cost]` host field: its column in fidelity.md
    "profile_host_s": "decode pass",
    "profile_host_per_seq_s": "per sequence",
    "profile_host_chunk_s": "pass with a chunk",
}
OPTIONAL_FIT_FIELDS = {  # and those that only some fits have: a mixed pass's own line, and
    # a chained pass's time beyond its device time (hw.latency.chain)
    "profile_host_mixed_s": "mixed pass",
    "profile_host_mixed_per_seq_s": "mixed, per decode",
    "profile_chain_s": "chained pass",
    "profile_chain_per_seq_s": "chained, per sequence",
}


def host_fits_markdown(fits: Mapping[str, Mapping[str, float]]) -> list[str]:
    """A table of the host time per pass (ms) that each of `fits` (calibration or run: its
    `[cost]` host fields) came to: a decode pass's fixed part, the part per sequence and a
    pass with a chunk's fixed part; where a fit has them, a mixed pass's own fixed part and
    part per decode, and a chained pass's time beyond its device time, fixed and per
    sequence."""
    fields = HOST_FIT_FIELDS | {
        k: name for k, name in OPTIONAL_FIT_FIELDS.items() if any(k in fit for fit in fits.values())
    }
    head = " | ".join(fields.values())
    lines = [f"| host time per pass, ms | {head} |", "|---|" + "---:|" * len(fields)]
    for name, fit in fits.items():
        cells = " | ".join(f"{fit.get(k, math.nan) * 1e3:.3g}" for k in fields)
        lines.append(f"| {name} | {cells} |")
    return lines


def own_host_markdown(
    own: pd.DataFrame,
    tolerances: Mapping[str, float],
    fits: Mapping[str, Mapping[str, float]] | None = None,
) -> str:
    """fidelity.md's section on the replays with each run's own host time (`own_host_table`),
    how many cells meet their tolerance each way, and the host times fitted (`fits`, by
    calibration or run: `host_fits_markdown`)."""
    lines = [
        "## With each run's own host time",
        "",
        "Each cell is sim/hw on the profile with the serving loop's host time per pass fitted "
        "on that run itself (in sample) / fitted on the calibration runs (the replay judged "
        "above). A server's host time per pass moves from one process to the next, and no "
        "calibration run can say by how much: a cell met here and missed above missed on the "
        "host time, not on the device's.",
        "",
        *_pairs(own, "own_host", "calibrated"),
    ]
    judged = own[own.metric.isin(list(tolerances))]
    if len(judged):
        met = [
            sum(
                Verdict(r, m, x, tolerances[m]).met
                for r, m, x in zip(judged.run, judged.metric, col, strict=True)
            )
            for col in (judged.own_host, judged.calibrated)
        ]
        lines += [
            "",
            f"Within the tolerances: {met[0]} of {len(judged)} cells with each run's own host "
            f"time, {met[1]} calibrated.",
        ]
    if fits:
        lines += ["", *host_fits_markdown(fits)]
    return "\n".join(lines) + "\n"


def beyond_markdown(beyond: Mapping[str, tuple[int, int]]) -> str:
    """fidelity.md's section on the profile replays' passes beyond the profiled grid: per run
    that has any, (passes costed by extrapolation, passes in all)."""
    rows = [f"| {run} | {n:,} of {all_:,} | {n / all_:.1%} |" for run, (n, all_) in beyond.items()]
    return "\n".join(
        [
            "## Passes beyond the profiled grid",
            "",
            "The profile replay's passes whose shape lies beyond the grid the profile measured, "
            "costed by extrapolation, so less to be trusted (a run's summary: "
            "`profile_passes_extrapolated`).",
            "",
            "| run | passes | share |",
            "|---|---:|---:|",
            *rows,
            "",
        ]
    )


PARTS = {"queue": "queue", "prefill": "prefill", "handoff": "handoff", "first": "first token"}


def queue_growth(requests: pd.DataFrame) -> float:
    """The mean queue (`ttft_parts`) of the last quarter of a run's finished requests, by
    arrival, over the first quarter's: about 1 where the servers keep up, several where the
    queue grows through the run (past saturation); NaN with fewer than four, or no queue at
    first."""
    queue = ttft_parts(requests.sort_values("arrival_s", kind="stable")).queue.to_numpy()
    quarter = len(queue) // 4
    if not quarter or not queue[:quarter].mean() > 0:
        return math.nan
    return float(queue[-quarter:].mean() / queue[:quarter].mean())


GROWING = 3.0  # a queue growth (`queue_growth`) from which a run is told past saturation: on
# the committed validates the runs that kept up grew up to 2.2 times, Llama's disaggregated top
# load, past saturation, 4.1-5.6 (benchmarks/results/2026-12-08b-cpu)


def past_saturation(requests: Mapping[str, Mapping[str, pd.DataFrame]]) -> list[str]:
    """A line for each run whose hardware queue grew GROWING times or more through it
    (`queue_growth` of its `hw` requests; the profile replay's beside it, where there is one)."""
    lines = []
    for run, sides in requests.items():
        hw = queue_growth(sides["hw"]) if "hw" in sides else math.nan
        if not hw >= GROWING:
            continue
        sim = queue_growth(sides["sim_profile"]) if "sim_profile" in sides else math.nan
        replay = "" if math.isnan(sim) else f" (the replay's {sim:.2f})"
        lines.append(
            f"{run}: past saturation, its queue grew {hw:.2f} times from the first quarter of "
            f"its requests to the last{replay}: its TTFT says how long the run lasted"
        )
    return lines


def ttft_parts_markdown(requests: Mapping[str, Mapping[str, pd.DataFrame]]) -> str:
    """fidelity.md's section on where TTFT goes: each run's mean TTFT and its parts
    (`ttft_parts`), in ms, and its queue's growth (`queue_growth`), the hardware's (`hw`: a
    cell's first run, which its replays replay) against the profile replay's (`sim_profile`);
    a part that is 0 in both (colocated: the handoff and the first token) shows as -."""

    def cell(hw: float, sim: float) -> str:
        return "-" if hw == sim == 0 else f"{hw * 1e3:.1f} / {sim * 1e3:.1f}"

    rows = []
    for run, sides in requests.items():
        if "hw" not in sides or "sim_profile" not in sides:
            continue
        hw, sim = ttft_parts(sides["hw"]).mean(), ttft_parts(sides["sim_profile"]).mean()
        cells = [cell(hw.sum(), sim.sum()), *(cell(hw[k], sim[k]) for k in PARTS)]
        growth = (queue_growth(sides[side]) for side in ("hw", "sim_profile"))
        cells.append(" / ".join("-" if math.isnan(g) else f"{g:.2f}" for g in growth))
        rows.append(f"| {run} | {' | '.join(cells)} |")
    return "\n".join(
        [
            "## Where TTFT goes",
            "",
            "Each run's mean TTFT in its parts, ms, the hardware's (a cell's first run, the "
            "one replayed) / the profile replay's: the "
            "queue (arrival to the first prefill pass), the prefill (to the last pass's end), "
            "the handoff (to the KV ready at the decoder) and the first token (ready to the "
            "first token). The parts sum to the TTFT; the one furthest apart is where a TTFT "
            "miss comes from. Near saturation the queue moves several times the prefill's "
            "error (docs/calibration.md, 2026-12-07f). Its growth is the mean queue of the "
            "last quarter of the requests to arrive over the first quarter's: a run whose "
            "queue grows several times is past saturation, and its TTFT says as much how "
            "long the run lasted as how fast it served (benchmarks/results/2026-12-08b-cpu).",
            "",
            f"| run | TTFT | {' | '.join(PARTS.values())} | queue growth |",
            "|---|---:|---:|---:|---:|---:|---:|",
            *rows,
            "",
        ]
    )


def write_report(
    table: pd.DataFrame,
    tolerances: Mapping[str, float],
    out: Path,
    repeats: pd.DataFrame | None = None,
    spread: pd.DataFrame | None = None,
    own_host: pd.DataFrame | None = None,
    host_fits: Mapping[str, Mapping[str, float]] | None = None,
    beyond: Mapping[str, tuple[int, int]] | None = None,
    requests: Mapping[str, Mapping[str, pd.DataFrame]] | None = None,
) -> list[Verdict]:
    """Write out/fidelity.csv and out/fidelity.md, with where TTFT goes in each run of
    `requests` (`ttft_parts_markdown`) where given, `repeats` (`repeat_table`) where there
    are any, also as out/repeat.csv, `spread` (`spread_table`) where there is any, also as
    out/hw_spread.csv, `own_host` (`own_host_table`) where there is any, also as
    out/own_host.csv, beside the host times fitted (`host_fits`), and the passes beyond the
    profiled grid (`beyond_markdown`: the runs that have any); return the verdicts (judge)."""
    verdicts = judge(table, tolerances)
    out.mkdir(parents=True, exist_ok=True)
    table.to_csv(out / "fidelity.csv", index=False)
    text = markdown(table, verdicts, spread)
    if requests:
        text += "\n" + ttft_parts_markdown(requests)
    (out / "repeat.csv").unlink(missing_ok=True)  # an earlier report's
    if repeats is not None and len(repeats):
        repeats.to_csv(out / "repeat.csv", index=False)
        text += "\n" + repeat_markdown(repeats)
    (out / "hw_spread.csv").unlink(missing_ok=True)
    if spread is not None and len(spread):
        spread.to_csv(out / "hw_spread.csv", index=False)
        text += "\n" + spread_markdown(spread)
    (out / "own_host.csv").unlink(missing_ok=True)
    if own_host is not None and len(own_host):
        own_host.to_csv(out / "own_host.csv", index=False)
        text += "\n" + own_host_markdown(own_host, tolerances, host_fits)
    if beyond:
        text += "\n" + beyond_markdown(beyond)
    (out / "fidelity.md").write_text(text)
    return verdicts


def plot_ratios(table: pd.DataFrame, path: Path) -> Path:
    """One panel per metric: each run's sim/hw ratio with the profile and with the roofline
    (log scale, 1 marked); returns `path`."""
    import matplotlib.pyplot as plt
    import numpy as np

    r = ratios(table)
    metrics, runs = list(dict.fromkeys(r.metric)), list(dict.fromkeys(r.run))
    cols = min(3, len(metrics))
    rows = -(-len(metrics) // cols)
    width = max(3.0, 0.5 * len(runs) + 1.5)
    fig, axes = plt.subplots(
        rows, cols, figsize=(width * cols, 3.8 * rows), squeeze=False, sharey=True
    )
    x = np.arange(len(runs))
    for ax in axes.flat[len(metrics) :]:
        ax.set_visible(False)
    for ax, metric in zip(axes.flat, metrics, strict=False):
        g = r[r.metric == metric].set_index("run").reindex(runs)
        for i, source in enumerate(SOURCES):
            ax.bar(x + (i - 0.5) * 0.4, g[source], 0.4, label=source.removeprefix("sim_"))
        ax.axhline(1.0, color="black", lw=0.8)
        ax.set_xticks(x, runs, rotation=60, ha="right", fontsize=7)
        ax.set_title(LABELS.get(metric, metric), fontsize=9)
        ax.set_yscale("log")
        ax.grid(alpha=0.3, axis="y")
    for row in axes:
        row[0].set_ylabel("sim / hw")
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def plot_cdfs(requests: Mapping[str, Mapping[str, pd.DataFrame]], path: Path) -> Path:
    """TTFT (top) and TPOT (bottom) CDFs of each run (a column), hw and the replays overlaid:
    `requests[run][source]` is a requests table; returns `path`."""
    import matplotlib.pyplot as plt

    from disagg.plots import _cdf

    runs = list(requests)
    fig, axes = plt.subplots(2, len(runs), figsize=(3.4 * len(runs), 6.2), squeeze=False)
    for j, run in enumerate(runs):
        for i, (column, name) in enumerate((("ttft_s", "TTFT (ms)"), ("tpot_s", "TPOT (ms)"))):
            ax = axes[i][j]
            for source, req in requests[run].items():
                _cdf(ax, req[req.status == "finished"][column] * 1e3, source)
            ax.set_title(run, fontsize=9)
            ax.set_xlabel(name)
            ax.grid(alpha=0.3)
        axes[0][j].legend(fontsize=7)
    axes[0][0].set_ylabel("fraction of requests")
    axes[1][0].set_ylabel("fraction of requests")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


RATIO_TICKS = (0.25, 0.5, 0.67, 0.8, 0.9, 1.0, 1.1, 1.25, 1.5, 2.0, 4.0)


def plot_passes(steps: Mapping[str, pd.DataFrame], path: Path) -> Path | None:
    """One panel per run: each pass's measured device time over the profile's for a pass of
    its own shape alone (`shape_device_s`, disagg.validate_passes.shape_device), against the latter,
    decode-only passes and passes with a prompt chunk apart (log scale; 1 and +-5% marked);
    `steps[run]` is its steps table. Returns `path`, or None where no run has both times (the
    CPU, or steps tables from before the shape columns)."""
    import matplotlib.pyplot as plt
    from matplotlib.ticker import NullFormatter, ScalarFormatter

    both = {
        run: t[t.device_s.notna() & t.shape_device_s.notna() & (t.shape_device_s > 0)]
        for run, t in steps.items()
        if "device_s" in t and "shape_device_s" in t
    }
    both = {run: t for run, t in both.items() if len(t)}
    if not both:
        return None
    cols = min(3, len(both))
    rows = -(-len(both) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.4 * rows), squeeze=False)
    for ax in axes.flat[len(both) :]:
        ax.set_visible(False)
    for ax, (run, t) in zip(axes.flat, both.items(), strict=False):
        for kind, rows_of in (("decode", t.prefill_tokens == 0), ("chunk", t.prefill_tokens > 0)):
            g = t[rows_of]
            model = g.shape_device_s * 1e3
            ax.scatter(model, g.device_s * 1e3 / model, s=4, alpha=0.4, label=kind)
        for y, style in ((1.0, "-"), (1.05, ":"), (0.95, ":")):
            ax.axhline(y, color="black", lw=0.8, ls=style)
        ax.set_xscale("log")
        ax.set_yscale("log")
        lo, hi = ax.get_ylim()
        ax.set_yticks([y for y in RATIO_TICKS if lo <= y <= hi])
        for axis in (ax.xaxis, ax.yaxis):  # plain numbers, not powers of ten
            axis.set_major_formatter(ScalarFormatter())
            axis.set_minor_formatter(NullFormatter())
        ax.set_title(run, fontsize=9)
        ax.set_xlabel("profile at its shape (ms)")
        ax.grid(alpha=0.3)
    for row in axes:
        row[0].set_ylabel("measured / profile")
    axes[0][0].legend(fontsize=7, markerscale=3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path

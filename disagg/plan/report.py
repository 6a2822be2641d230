"""The planner's answer: a table of every configuration, the Pareto front of GPUs against
goodput, the cheapest configuration per unit of goodput, a figure and the winning experiment."""

from __future__ import annotations

import json
import math
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import pandas as pd

from disagg.core.slo import Slo
from disagg.plan.search import Outcome, offered

COLUMNS = [
    "label", "mode", "gpus", "status", "goodput_per_s", "gpus_per_goodput", "rate_per_s",
    "attainment", "ttft_ms_p50", "ttft_ms_p90", "tpot_ms_p50", "tpot_ms_p90", "probes",
    "bound_per_s", "on_front", "winner", "reason",
]  # fmt: skip


def front(outcomes: list[Outcome]) -> list[Outcome]:
    """The configurations that kept up and that no other beats: none with at most as many
    GPUs has at least as much goodput (and more of one), sorted by GPUs."""
    ok = [o for o in outcomes if o.status == "ok"]

    def beaten(o: Outcome) -> bool:
        return any(
            p.candidate.gpus <= o.candidate.gpus
            and p.goodput_per_s >= o.goodput_per_s
            and (p.candidate.gpus, -p.goodput_per_s) < (o.candidate.gpus, -o.goodput_per_s)
            for p in ok
        )

    return sorted((o for o in ok if not beaten(o)), key=lambda o: o.candidate.gpus)


def cheapest(outcomes: list[Outcome]) -> Outcome | None:
    """Fewest GPUs per goodput req/s (ties: fewer GPUs, then the first); None if none kept up."""
    ok = [o for o in outcomes if o.status == "ok"]
    if not ok:
        return None
    return min(ok, key=lambda o: (o.candidate.gpus / o.goodput_per_s, o.candidate.gpus))


def table(outcomes: list[Outcome], skipped: list[tuple[str, str]]) -> pd.DataFrame:
    """One row per configuration (the skipped ones last), columns `COLUMNS`."""
    on_front, win = {id(o) for o in front(outcomes)}, cheapest(outcomes)
    rows = []
    for o in outcomes:
        b = o.best
        good = o.goodput_per_s
        rows.append(
            {
                "label": o.candidate.label,
                "mode": o.candidate.mode,
                "gpus": o.candidate.gpus,
                "status": o.status,
                "goodput_per_s": good,
                "gpus_per_goodput": o.candidate.gpus / good if good > 0 else math.inf,
                "rate_per_s": b.rate_per_s if b else math.nan,
                "attainment": b.attainment if b else math.nan,
                "ttft_ms_p50": b.ttft_ms_p50 if b else math.nan,
                "ttft_ms_p90": b.ttft_ms_p90 if b else math.nan,
                "tpot_ms_p50": b.tpot_ms_p50 if b else math.nan,
                "tpot_ms_p90": b.tpot_ms_p90 if b else math.nan,
                "probes": o.probes,
                "bound_per_s": o.bound_per_s,
                "on_front": id(o) in on_front,
                "winner": o is win,
                "reason": o.reason or _reason(o),
            }
        )
    rows += [{"label": label, "status": "skipped", "reason": why} for label, why in skipped]
    return pd.DataFrame(rows, columns=COLUMNS)


def _reason(o: Outcome) -> str:
    if o.status == "pruned":
        return f"cannot keep up at {o.bound_per_s:.3g} req/s, what cheaper ones reach"
    if o.status == "none":
        return "kept up at no rate probed"
    return ""


def write_winner(o: Outcome, path: Path, window_s: float | None) -> Path:
    """`o`'s experiment at its maximum goodput rate for `window_s` of arrivals (the probe that
    found it: simulating the file gives the goodput reported), as a JSON experiment file that
    `disagg sim run` reads."""
    assert o.best is not None  # a winner kept up
    exp = offered(o.candidate.exp, o.best.rate_per_s, window_s)
    data = json.loads(exp.model_dump_json(exclude_none=True))
    data["description"] = f"disagg plan: {o.candidate.label} at {o.best.rate_per_s:.4g} req/s"
    for name in {"colocated", "prefill", "decode"} - set(exp.cluster.groups):
        data["cluster"].pop(name, None)
    path.write_text(json.dumps(data, indent=2) + "\n")
    return path


def plot(df: pd.DataFrame, slo: Slo, path: Path) -> Path:
    """Goodput, TTFT p90 and TPOT p90 (at the maximum goodput rate) against GPUs: every
    configuration that kept up, the Pareto front joined, the winner starred."""
    ok = df[df.status == "ok"]
    fr, win = ok[ok.on_front].sort_values("gpus"), ok[ok.winner]
    fig, axes = plt.subplots(1, 3, figsize=(14, 4.2))
    panels = [
        ("goodput_per_s", "goodput (req/s)", None),
        ("ttft_ms_p90", "TTFT p90 (ms)", slo.ttft_ms),
        ("tpot_ms_p90", "TPOT p90 (ms)", slo.tpot_ms),
    ]
    for ax, (col, label, bound) in zip(axes, panels, strict=True):
        for mode, marker in (("colocated", "s"), ("disagg", "o")):
            part = ok[ok["mode"] == mode]
            ax.scatter(part.gpus, part[col], marker=marker, alpha=0.5, label=mode)
        ax.plot(fr.gpus, fr[col], "k-", lw=1, label="Pareto front")
        ax.scatter(win.gpus, win[col], marker="*", s=200, c="red", label="fewest GPUs per req/s")
        if bound is not None:
            ax.axhline(bound, color="grey", ls="--", lw=1, label="SLO")
        ax.set_xlabel("GPUs")
        ax.set_ylabel(label)
    for _, row in fr.iterrows():
        axes[0].annotate(row.label, (row.gpus, row.goodput_per_s), fontsize=7)
    axes[0].legend(fontsize=7)
    fig.suptitle(f"disagg plan, SLO {slo}: at each configuration's maximum goodput rate")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path

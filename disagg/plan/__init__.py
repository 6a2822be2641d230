"""Capacity planning: the cheapest cluster configuration that serves a workload within SLOs.

    space = Space(max_gpus=64, vary=(parse_vary("transfer.policy=layerwise,whole"),))
    result = plan(base, space, Options(Slo.parse("ttft_ms=2000,tpot_ms=50")), Path("runs/plan"))

`space` (disagg.plan.space) lists the configurations; `search` (disagg.plan.search) bisects each
one's maximum goodput rate; `report` writes plan.csv, plan.png and winner.json.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import pandas as pd

from disagg.config import Experiment
from disagg.errors import ConfigError
from disagg.plan import report
from disagg.plan.search import (
    Options,
    Outcome,
    base_window_s,
    native_rate_per_s,
    parse_prune,
    search,
)
from disagg.plan.space import Candidate, Space, expand, parse_counts, parse_vary

__all__ = ["Options", "Plan", "Space", "parse_counts", "parse_prune", "parse_vary", "plan"]


@dataclass
class Plan:
    """A finished search: every outcome (in the space's order), the skipped configurations
    (label, reason), the Pareto front, the winner and the files written."""

    outcomes: list[Outcome]
    skipped: list[tuple[str, str]]
    front: list[Outcome]
    winner: Outcome
    table: pd.DataFrame
    files: list[Path]


def plan(
    base: Experiment,
    space: Space,
    opts: Options,
    out: Path,
    progress: Callable[[int, int], None] | None = None,
    on_space: Callable[[int, int], None] | None = None,
) -> Plan:
    """Search `space` around `base`, write plan.csv, plan.png and winner.json under `out`.
    `on_space(configurations, skipped)` is called once the space is known. ConfigError if no
    configuration keeps up at any rate (the table is written first)."""
    expansion = expand(base, space)
    if on_space:
        on_space(len(expansion.candidates), len(expansion.skipped))
    native_per_s = native_rate_per_s(base)
    opts = replace(opts, probe_s=opts.probe_s or base_window_s(base))

    def start_per_s(c: Candidate) -> float:  # the base's rate per GPU, at c's GPUs
        return native_per_s * c.gpus / base.cluster.total_gpus

    outcomes = search(expansion.candidates, opts, start_per_s, progress)
    df = report.table(outcomes, expansion.skipped)
    out.mkdir(parents=True, exist_ok=True)
    files = [out / "plan.csv"]
    df.to_csv(files[0], index=False)
    winner = report.cheapest(outcomes)
    if winner is None:
        raise ConfigError(_nothing_keeps_up(opts, outcomes, files[0]))
    files += [report.plot(df, opts.slo, out / "plan.png")]
    files += [report.write_winner(winner, out / "winner.json", opts.probe_s)]
    return Plan(outcomes, expansion.skipped, report.front(outcomes), winner, df, files)


def _nothing_keeps_up(opts: Options, outcomes: list[Outcome], csv: Path) -> str:
    tried = [o for o in outcomes if o.best is not None]
    head = (
        f"--slo {opts.slo}: no configuration keeps up (goodput >= {opts.fraction:g} x the "
        "offered rate) at any rate probed"
    )
    if not tried:
        failed = outcomes[0]
        return f"{head}; every simulation failed, the first ({failed.candidate.label}): " + (
            failed.reason
        )
    o = max(tried, key=lambda o: (o.best.attainment if o.best else 0.0, -o.candidate.gpus))
    b = o.best
    assert b is not None  # tried holds outcomes with a probe
    return (
        f"{head}. The best found: {o.candidate.label} ({o.candidate.gpus} GPUs) met it for "
        f"{b.attainment:.0%} of requests at {b.rate_per_s:.3g} req/s (TTFT p90 "
        f"{b.ttft_ms_p90:.0f} ms, TPOT p90 {b.tpot_ms_p90:.1f} ms); every configuration: {csv}"
    )

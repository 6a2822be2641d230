"""Does a setting change the real backend? Each hw run given is run again as it ran (its
experiment.json: the same seed, workload and load, fresh servers) under each set of overrides,
the sets taking turns round after round, so that drift of the machine falls on every set alike.

Writes `hw_ab.csv` (run, set, round, each fidelity metric, and the prefill passes' median host
and device ms), `hw_ab.md` (medians over the rounds, each set over the first), and each run
under OUT/RUN/SET-ROUND (RUN: the run's directory name, with as many parents as tell it from
the others, as hw_repeat.py names them).

    python benchmarks/hw_ab.py runs/validate/hw/disagg-3.09rps --rounds 2 \\
        --sets 'hw.latency.meta_in_stream=true;hw.latency.meta_in_stream=false'
"""

from __future__ import annotations

import argparse
from pathlib import Path

import pandas as pd
from hw_repeat import labels  # this script's folder is on the path when it runs

from disagg.config import load_experiment
from disagg.fidelity import LABELS, METRICS
from disagg.hw.driver import run_hw

PASS_COLUMNS = ["prefill_host_ms", "prefill_device_ms"]


def prefill_passes(run: Path) -> dict[str, float]:
    """The median host and device ms of a run's prefill passes (host: a pass's wall time
    that its device time does not cover)."""
    steps = pd.read_parquet(run / "steps.parquet")
    p = steps[steps.kind == "prefill"]
    return {
        "prefill_host_ms": float(((p.duration_s - p.device_s) * 1e3).median()),
        "prefill_device_ms": float((p.device_s * 1e3).median()),
    }


def report(table: pd.DataFrame) -> str:
    """hw_ab.md of the rows of `table` (hw_ab.csv's): per run and set, the medians over the
    rounds, each beside its ratio to the first set's (the sets in their first order)."""
    columns = [*METRICS.values(), *PASS_COLUMNS]
    med = table.groupby(["run", "set"], sort=False)[columns].median()
    first = table.set.iloc[0]
    lines = [
        "# Each hw run again under each set",
        "",
        f"Medians over the rounds; in brackets, over {first}'s.",
        "",
        "| run | set | " + " | ".join(LABELS.get(c, c) for c in columns) + " |",
        "|---|---|" + "---:|" * len(columns),
    ]
    for (run, s), r in med.iterrows():
        base = med.loc[(run, first)] if (run, first) in med.index else r
        cells = [f"{v:.4g}" + ("" if s == first else f" ({v / base[c]:.3f})") for c, v in r.items()]
        lines.append(f"| {run} | {s} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("runs", type=Path, nargs="+", help="hw run directories")
    ap.add_argument("--sets", required=True, help="';'-separated sets of ','-separated key=value")
    ap.add_argument("--rounds", type=int, default=1, help="times each set runs each run")
    ap.add_argument("--out", type=Path, default=Path("runs/hw-ab"))
    a = ap.parse_args()
    sets = [s.strip() for s in a.sets.split(";") if s.strip()]
    rows = []
    a.out.mkdir(parents=True, exist_ok=True)
    for run, label in zip(a.runs, labels(a.runs), strict=True):
        for rnd in range(1, a.rounds + 1):
            for k, s in enumerate(sets):
                out = a.out / label / f"set{k}-{rnd}"
                print(f"hw ab: {label}, round {rnd}/{a.rounds}, {s}", flush=True)
                summary, _ = run_hw(load_experiment(run, s.split(",")), out)
                metrics = {key: summary[key] for key in METRICS.values()}
                rows.append({"run": label, "set": s, "round": rnd, **metrics} | prefill_passes(out))
                # both files as each run ends: a call cut short keeps them
                table = pd.DataFrame(rows)
                table.to_csv(a.out / "hw_ab.csv", index=False)
                (a.out / "hw_ab.md").write_text(report(table))
    print(report(table))


if __name__ == "__main__":
    main()

"""How far the real backend moves from itself: each hw run given is run again as it ran (its
experiment.json: the same seed, workload, load and settings, fresh servers), and each fidelity
metric of the second run is set over the first's. No simulator can be closer to a run than the
run is to itself, so these ratios are the floor under validate's tolerances.

Writes `hw_repeat.csv` (run, metric, first, again, ratio), `hw_repeat.md`, and each second run
under OUT/RUN (RUN: the run's directory name, with as many parents as tell it from the others).

    python benchmarks/hw_repeat.py runs/validate/hw/colocated-7.04rps \\
        runs/validate/hw/disagg-7.04rps --out runs/hw-repeat
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pandas as pd

from disagg.config import load_experiment
from disagg.fidelity import LABELS, METRICS, ratio
from disagg.hw.driver import run_hw


def labels(runs: list[Path]) -> list[str]:
    """Each run's name, or as many of its last parts as tell it from the others, joined by
    "-" (`validate/hw/disagg-10rps` beside `validate/calibration/disagg-10rps`:
    `hw-disagg-10rps`)."""
    for k in range(1, max(len(run.parts) for run in runs) + 1):
        tails = ["-".join(run.parts[-k:]) for run in runs]
        if len(set(tails)) == len(tails):
            return tails
    raise SystemExit("hw_repeat.py: a run directory is given twice")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("runs", type=Path, nargs="+", help="hw run directories")
    ap.add_argument("--out", type=Path, default=Path("runs/hw-repeat"))
    a = ap.parse_args()
    rows = []
    for i, (run, label) in enumerate(zip(a.runs, labels(a.runs), strict=True), 1):
        first = json.loads((run / "summary.json").read_text())
        print(f"hw repeat {i}/{len(a.runs)}: {label}", flush=True)
        again, _ = run_hw(load_experiment(run), a.out / label)
        for key in METRICS.values():
            rows.append((label, key, first[key], again[key], ratio(again[key], first[key])))
    table = pd.DataFrame(rows, columns=["run", "metric", "first", "again", "ratio"])
    a.out.mkdir(parents=True, exist_ok=True)
    table.to_csv(a.out / "hw_repeat.csv", index=False)
    wide = table.pivot(index="run", columns="metric", values="ratio")[list(METRICS.values())]
    lines = [
        "# The same hw run again: second over first",
        "",
        "| run | " + " | ".join(LABELS[k] for k in wide.columns) + " |",
        "|---|" + "---:|" * len(wide.columns),
        *(f"| {run} | " + " | ".join(f"{v:.3f}" for v in r) + " |" for run, r in wide.iterrows()),
    ]
    (a.out / "hw_repeat.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()

"""How far a cell's replay moves with the host time alone: each cell of a validate replayed
(on its profile replay's settings) with the host time per pass of every server process the
validate ran, each fitted on its own run (`loop_costs`, as validate fits the calibration's;
the colocated processes only, as the calibration's are). The spread of sim/hw across them is
what one calibration process's host speed can do to a cell.

    python host_noise.py VALIDATE_DIR [--out FILE.csv]

VALIDATE_DIR holds a validate with its replays (`disagg validate --replay`).
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import numpy as np
import pandas as pd

from disagg.fidelity import METRICS, median_summary
from disagg.validate import HOST_KEYS, hw_dirs, loop_costs, replay

JUDGED = ["ttft_s_p50", "ttft_s_p90", "tpot_s_p50", "tpot_s_p90", "output_throughput"]


def colocated_processes(validate: Path) -> dict[str, Path]:
    """Every colocated run of the validate (calibration and validation), by name."""
    runs = sorted(validate.glob("calibration/*rps*")) + sorted(validate.glob("hw*/colocated-*"))
    runs = [r for r in runs if not r.name.startswith("disagg") and (r / "steps.parquet").exists()]
    return {"/".join(r.parts[-2:]): r for r in runs}


def host_fits(runs: dict[str, Path]) -> dict[str, dict[str, float]]:
    """Each run's host time per pass (`loop_costs`' host fields), fitted on it alone."""
    fits = {}
    for name, run in runs.items():
        costs = loop_costs([pd.read_parquet(run / "steps.parquet")])
        fits[name] = {k: v for k, v in costs.items() if k in HOST_KEYS}
    return fits


def spread(validate: Path) -> pd.DataFrame:
    """Per cell and judged metric: sim/hw replayed with each process's host time."""
    fits = host_fits(colocated_processes(validate))
    labels = json.loads((validate / "runs.json").read_text())
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for label in labels:
            ran = [json.loads((d / "summary.json").read_text()) for d in hw_dirs(validate, label)]
            hw = median_summary(ran)
            for name, fit in fits.items():
                sets = [f"cost.{k}={v!r}" for k, v in fit.items()]
                sim, _ = replay(validate / "sim-profile" / label, sets, Path(tmp) / label)
                rows += [(label, name, m, sim[m] / hw[m]) for m in JUDGED if m in METRICS.values()]
    return pd.DataFrame(rows, columns=["run", "host_of", "metric", "ratio"])


def main(validate: Path, out: Path | None) -> None:
    table = spread(validate)
    if out:
        table.to_csv(out, index=False)
    q = table.groupby(["run", "metric"]).ratio.agg(
        low="min", p10=lambda r: np.quantile(r, 0.1), p90=lambda r: np.quantile(r, 0.9), high="max"
    )
    print(q.round(3).unstack("metric").to_string())


if __name__ == "__main__":
    args = sys.argv[1:]
    at = args.index("--out") if "--out" in args else None
    out = Path(args[at + 1]) if at is not None else None
    main(Path(args[0]), out)

"""Cells met and mean |log sim/hw| of TPOT and TTFT per validate, for replays of every
committed validate at several heads (`2026-12-05g-cpu/replay_all.sh TAG`, which writes
/tmp/rep/TAG/NAME/DIR/fidelity.csv). From the repo's root:

    python benchmarks/results/2026-12-05i-cpu/compare_replays.py TAG...

The last table: the errors over the validates of 2026-12-05 (the six newest).
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pandas as pd

ROOT = Path("/tmp/rep")
TOLERANCES = {
    "ttft_s_p50": 0.05,
    "ttft_s_p90": 0.05,
    "tpot_s_p50": 0.03,
    "tpot_s_p90": 0.03,
    "output_throughput": 0.03,
}


def main() -> None:
    tables = []
    for tag in sys.argv[1:]:
        for path in sorted(ROOT.glob(f"{tag}/*/*/fidelity.csv")):
            tables.append(pd.read_csv(path).assign(tag=tag, validate=path.parts[-3]))
    df = pd.concat(tables)
    df = df[df.metric.isin(TOLERANCES)]
    ratio = df.sim_profile / df.hw
    df["met"] = (ratio - 1).abs() <= df.metric.map(TOLERANCES) + 1e-12
    df["error"] = np.log(ratio).abs()
    df["family"] = df.metric.str[:4]
    cells = df.groupby(["validate", "tag"]).met.sum()
    errors = df.groupby(["validate", "tag", "family"]).error.mean().unstack()
    pd.set_option("display.width", 250)
    pd.set_option("display.max_columns", 30)
    print(errors.join(cells).unstack("tag").round(3))
    print(df.groupby("tag").met.sum())
    newest = df[df.validate.str.startswith("2026-12-05")]
    print(newest.groupby(["tag", "family"]).error.mean().unstack().round(4))


if __name__ == "__main__":
    main()

"""Each cell's sim/hw (profile replay) per run, a miss starred, for replays of committed
validates (`2026-12-05g-cpu/replay_all.sh TAG`, or `hold_experiment.py OUT`, which write
/tmp/rep/TAG/NAME/DIR/fidelity.csv). Columns: TTFT p50, TTFT p90, TPOT p50, TPOT p90, tok/s.

    python cells_by_run.py TAG NAME...
"""

from __future__ import annotations

import sys
from pathlib import Path

import pandas as pd

sys.path.insert(0, str(Path(__file__).parent.parent / "2026-12-05i-cpu"))
from compare_replays import TOLERANCES  # the 12-05i records' tolerances, by summary key

if __name__ == "__main__":
    tag, names = sys.argv[1], sys.argv[2:]
    for name in names:
        table = pd.read_csv(next(Path("/tmp/rep", tag, name).glob("*/fidelity.csv")))
        table = table[table.metric.isin(TOLERANCES)]
        cells = {}
        for row in table.itertuples():
            x = row.sim_profile / row.hw
            star = "*" if abs(x - 1) > TOLERANCES[row.metric] else " "
            cells.setdefault(row.run, []).append(f"{x:.3f}{star}")
        missed = sum(c.endswith("*") for v in cells.values() for c in v)
        print(f"== {name} {missed} missed")
        for run, said in cells.items():
            print(f"{run:22s} {' '.join(said)}")

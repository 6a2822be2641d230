"""The roofline replays of `roofline_gpu.sh`, per validate and way: mean |log sim/hw| over its
30 cells, TPOT's range, and the cells within tolerance (TTFT 5%, TPOT and tok/s 3%)."""

from pathlib import Path

import numpy as np
import pandas as pd

TOLERANCE = {"ttft_s_p50": 0.05, "ttft_s_p90": 0.05, "tpot_s_p50": 0.03, "tpot_s_p90": 0.03}
TOLERANCE["output_throughput"] = 0.03

for name in sorted(p.name for p in Path("/tmp/roof/recorded").glob("*") if p.is_dir()):
    row = [name]
    for way in ("recorded", "gpu", "fixed"):
        t = pd.read_csv(next(Path("/tmp/roof", way, name).glob("*/fidelity.csv")))
        t = t[t.metric.isin(TOLERANCE)]
        r = t.sim_roofline / t.hw
        tpot = r[t.metric.str.startswith("tpot")]
        met = int((abs(r - 1) <= t.metric.map(TOLERANCE)).sum())
        row.append(f"{np.abs(np.log(r)).mean():.3f} ({tpot.min():.2f}-{tpot.max():.2f}; {met})")
    print(" | ".join(row))

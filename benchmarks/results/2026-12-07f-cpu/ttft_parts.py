"""A disaggregated run's TTFT in its parts, hardware runs against the profile's replay: the
queue (arrival to the first chunk's start), the prefill (first chunk's start to the last's
end), the handoff (the last chunk's end to the KV ready at the decoder) and the first token
(ready to the first token); p50, p90 and the mean of each, in ms (2026-12-07f).

    python benchmarks/results/2026-12-07f-cpu/ttft_parts.py VALIDATE_DIR RUN...

VALIDATE_DIR: an unpacked validate replayed on the CPU (its sim-profile/ holds the replays);
RUN: e.g. disagg-5.86rps."""

import sys

import numpy as np
import pandas as pd

from disagg.core.metrics import ttft_parts


def cell(x: pd.Series) -> str:
    p50, p90 = np.percentile(x, [50, 90]) * 1e3
    return f"{p50:7.1f} {p90:7.1f} m{x.mean() * 1e3:6.1f}"


where = sys.argv[1]
for run in sys.argv[2:]:
    print(f"== {run}  (p50 p90 mean, ms)")
    for side in ("hw", "hw-2", "sim-profile"):
        try:
            r = pd.read_parquet(f"{where}/{side}/{run}/requests.parquet")
        except FileNotFoundError:
            continue
        parts = ttft_parts(r)
        parts.insert(0, "ttft", parts.sum(axis=1))
        print(f"{side:12s}", " | ".join(f"{k} {cell(v)}" for k, v in parts.items()))

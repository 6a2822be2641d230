"""A disaggregated run's wide decode passes beside chunk passes on one GPU (2026-12-07i), by
how much of each the chunk passes' GPU time covered: on the hardware a chunk pass holds the
GPU from the end of its host time before (host_before_s) for its device time; under the
simulator's weights rule a pass holds its share for its whole time, host included. Each
decode pass's time is to the next one's start (ms, median and mean); the passes are those of
22-32 sequences begun 5-14 s into the run, when the prefill server is never idle.

    python benchmarks/results/2026-12-07i-gpu/straddle.py VALIDATE_DIR RUN

VALIDATE_DIR: a validate directory after `disagg validate --replay` (e.g. this folder's
llama/runs.tar.xz unpacked, then replayed), RUN one of its disaggregated runs."""

import sys

import numpy as np
import pandas as pd

where, run = sys.argv[1:]
print("| side | covered | passes | median | mean |")
print("|---|---|---:|---:|---:|")
for side in ("hw", "hw-2", "sim-profile"):
    steps = pd.read_parquet(f"{where}/{side}/{run}/steps.parquet").sort_values("start_s")
    chunks = steps[steps.node.str.startswith("prefill")]
    before = chunks.host_before_s.fillna(0.0).to_numpy(float)  # the replay's: none recorded
    held = chunks.device_s.to_numpy(float) if side != "sim-profile" else chunks.duration_s
    start = chunks.start_s.to_numpy(float) + before
    end = start + np.asarray(held, float)
    decodes = steps[steps.node.str.startswith("decode")].copy()
    decodes["per"] = decodes.start_s.shift(-1) - decodes.start_s
    a = decodes.start_s.to_numpy(float)
    b = a + decodes.per.to_numpy(float)
    held_s = [
        np.clip(np.minimum(y, end) - np.maximum(x, start), 0, None).sum()
        for x, y in zip(a, b, strict=True)
    ]
    decodes["cover"] = np.array(held_s) / (b - a)
    plateau = decodes[decodes.start_s.between(5, 14) & decodes.batch_size.between(22, 32)]
    for lo, hi, label in ((0.7, 0.95, "0.70-0.95"), (0.95, 1.01, "0.95-1")):
        x = plateau[(plateau.cover >= lo) & (plateau.cover < hi)].per * 1e3
        print(f"| {side} | {label} | {len(x)} | {x.median():.2f} | {x.mean():.2f} |")

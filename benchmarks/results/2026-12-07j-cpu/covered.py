"""A disaggregated run's decode passes on one GPU by how much of each the prefill server's
device time covered, and the fully covered ones by their batch (2026-12-07j): each pass's
time over the median of the passes of its batch size that met no chunk (median; passes), for
the hardware's runs and the replay, pooled over validates by load (light, middle, top). A
chunk pass covers from its device work's start to its end (`host_before_s`, `device_s`)
where its row has them, the replay's rows as they are.

    python benchmarks/results/2026-12-07j-cpu/covered.py VALIDATE_DIR...

VALIDATE_DIR: a validate directory after `disagg validate --replay`."""

import os
import sys

import numpy as np
import pandas as pd

from disagg.share import overlap_segments

COVERED = [-0.01, 1e-4, 0.3, 0.6, 0.9, 0.999, 1.0]
BATCH = [0, 4, 8, 16, 32, 256]
LOADS = ("light", "middle", "top")


def on_device(steps: pd.DataFrame) -> pd.DataFrame:
    """`steps` with each chunk pass cut to its device time, where its row has it."""
    out = steps.copy()
    if {"host_before_s", "device_s"} <= set(out):
        chunk = (out.prefill_tokens > 0) & out.host_before_s.notna() & out.device_s.notna()
        out.loc[chunk, "start_s"] += out.host_before_s[chunk]
        out.loc[chunk, "duration_s"] = out.device_s[chunk]
    return out


def decode_passes(steps: pd.DataFrame) -> pd.DataFrame:
    """The decode passes of `steps`: each one's covered part and time over its size's alone."""
    steps = steps.sort_values("start_s").reset_index(drop=True)  # positions for the segments
    d = steps[steps.prefill_tokens == 0].copy()
    d["time"] = d.duration_s / d.steps
    segments = overlap_segments(on_device(steps))
    part = {i: s[chunks > 0].sum() / s.sum() for i, (s, _, chunks) in segments.items()}
    d["covered"] = pd.Series(part, dtype=float).reindex(d.index, fill_value=0.0)
    alone = d[d.covered == 0].groupby("batch_size").time.median()
    d["ratio"] = d.time / np.interp(d.batch_size, alone.index, alone.to_numpy())
    return d


rows = []
for where in sys.argv[1:]:
    runs = [r for r in os.listdir(f"{where}/hw") if r.startswith("disagg")]
    runs.sort(key=lambda r: float(r.removeprefix("disagg-").removesuffix("rps")))
    for load, run in zip(LOADS, runs, strict=True):
        for side in ("hw", "hw-2", "sim-profile"):
            if os.path.exists(f"{where}/{side}/{run}/steps.parquet"):
                d = decode_passes(pd.read_parquet(f"{where}/{side}/{run}/steps.parquet"))
                d["side"], d["load"] = ("replay" if side == "sim-profile" else "hw"), load
                rows.append(d[["ratio", "covered", "batch_size", "side", "load"]])
passes = pd.concat(rows, ignore_index=True)
passes["covered by"] = pd.cut(passes.covered, COVERED)
passes["batch"] = pd.cut(passes.batch_size, BATCH)
full = passes[passes.covered > 0.999]
for by, table in (("covered by", passes), ("batch", full)):
    cells = table.groupby([by, "load", "side"], observed=True).ratio.agg(["median", "size"])
    cells = cells.apply(lambda r: f"{r['median']:.2f} ({r['size']:.0f})", axis=1)
    print(cells.unstack(["load", "side"]).fillna("-").to_markdown(), end="\n\n")

"""Decode-only passes of validates' colocated runs (calibration and validation), their device
time over the profile's at their shape (`shape_device`), by the time since their node's last
pass with a prompt chunk ended (`since_chunk`): the median per validate, and per batch range
less the median of that range's passes 200 ms or more after one. From the repo's root:

    python benchmarks/results/2026-12-05i-cpu/after_chunk_time.py DIR...

DIR: a validate directory replayed by this checkout (`disagg validate --replay --out DIR`).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pandas as pd

from disagg.config import load_experiment
from disagg.validate_passes import shape_device, since_chunk

EDGES_MS = [0, 10, 20, 30, 40, 60, 80, 120, 200, 10**6]
BATCHES = [0, 4, 8, 16, 32, 64]


def passes(out: Path) -> pd.DataFrame:
    """The decode-only passes of `out`'s colocated runs, with `ratio` and `since_ms`."""
    exp = load_experiment(sorted((out / "sim-profile").glob("colocated-*"))[0])
    runs = sorted((out / "hw").glob("colocated-*")) + [
        p for p in sorted((out / "calibration").glob("*rps")) if not p.name.startswith("disagg")
    ]
    rows = []
    for run in runs:
        steps = pd.read_parquet(run / "steps.parquet")
        if "decode_context" not in steps or steps.device_s.isna().all():
            continue
        steps = steps.assign(since_ms=since_chunk(steps) * 1e3, shaped=shape_device(steps, exp))
        pick = (steps.prefill_tokens == 0) & steps.device_s.notna() & steps.shaped.notna()
        rows.append(steps[pick].assign(ratio=steps.device_s / steps.shaped, dir=out.name))
    return pd.concat(rows, ignore_index=True)


def main() -> None:
    pd.set_option("display.width", 200)
    pd.set_option("display.max_columns", 20)
    df = pd.concat([passes(Path(d)) for d in sys.argv[1:]], ignore_index=True)
    df["since"] = pd.cut(df.since_ms, EDGES_MS, right=False)
    df["batch"] = pd.cut(df.batch_size, BATCHES)
    print(df.groupby(["dir", "since"], observed=True).ratio.median().unstack().round(3))
    far = df[df.since_ms >= 200].groupby("batch", observed=True).ratio.median()
    by = df.groupby(["batch", "since"], observed=True).ratio.median().unstack()
    print(by.sub(far, axis=0).round(3))


if __name__ == "__main__":
    main()

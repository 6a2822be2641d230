"""The serving loop's time per decode pass (median, ms; `loop_s`) by batch range, and the
passes in each, for the hw runs in DIR (each a run directory with steps.parquet). From the
repo's root, on this folder's runs.tar.xz unpacked:

    python benchmarks/results/2026-12-05j-gpu/host-repeat/host_by_batch.py DIR
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pandas as pd

from disagg.validate_passes import loop_s

BATCHES = [0, 8, 16, 24, 32, 40, 48, 56, 64]


def main() -> None:
    rows = []
    for run in sorted(p for p in Path(sys.argv[1]).iterdir() if (p / "steps.parquet").exists()):
        steps = pd.read_parquet(run / "steps.parquet")
        steps = steps.assign(loop=loop_s(steps, waited=np.nan))
        decode = steps[steps.prefill_tokens == 0].dropna(subset=["loop"])
        by = decode.groupby(pd.cut(decode.batch_size, BATCHES), observed=False)
        rows.append((by.loop.median() * 1e3).rename(f"{run.name}: loop ms"))
        rows.append(by.size().rename(f"{run.name}: passes"))
        before = decode.host_before_s[decode.batch_size > 32].median() * 1e3
        print(f"{run.name}: before the launch, passes of more than 32 sequences: {before:.3f} ms")
    pd.set_option("display.width", 200)
    pd.set_option("display.max_columns", 20)
    print(pd.DataFrame(rows).round(2).to_string())


if __name__ == "__main__":
    main()

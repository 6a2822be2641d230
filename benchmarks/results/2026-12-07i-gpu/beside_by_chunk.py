"""A disaggregated run's decode passes beside a chunk pass on one GPU (2026-12-07i): each
one's time (to the next pass's start) over the median of the passes of its batch size that
met no chunk pass, by the tokens of the chunk beside it for longest (median, passes), for
the hardware's run and the replay. A pass counts as beside a chunk where chunk passes
covered over 90% of it.

    python benchmarks/results/2026-12-07i-gpu/beside_by_chunk.py VALIDATE_DIR RUN...

VALIDATE_DIR: a validate directory after `disagg validate --replay`."""

import sys
from itertools import pairwise

import numpy as np
import pandas as pd

from disagg.share import overlap_segments

BINS = [0, 1024, 2048, 3072, 4096]

where, runs = sys.argv[1], sys.argv[2:]
head = " | ".join(f"{lo + 1}-{hi}" for lo, hi in pairwise(BINS))
print(f"| run | side | {head} | all |")
print("|---|---|" + "---:|" * len(BINS))
for run in runs:
    for side in ("hw", "sim-profile"):
        steps = pd.read_parquet(f"{where}/{side}/{run}/steps.parquet").sort_values("start_s")
        steps = steps.reset_index(drop=True)  # overlap_segments keys passes by position
        d = steps[steps.prefill_tokens == 0].copy()
        d["per"] = (d.start_s.shift(-1) - d.start_s) / d.steps
        d["covered"], d["chunk"] = 0.0, 0
        # each decode pass's pieces: (seconds, decodes, chunks, the chunk's tokens running)
        for i, (seconds, _, chunks, tokens) in overlap_segments(
            steps, True, steps.prefill_tokens.to_numpy(float)
        ).items():
            by_chunk = pd.Series(seconds).groupby(tokens).sum().drop(0.0, errors="ignore")
            d.loc[i, "covered"] = seconds[chunks > 0].sum() / seconds.sum()
            d.loc[i, "chunk"] = int(by_chunk.idxmax())
        alone = d[d.covered == 0].groupby("batch_size").per.median()
        beside = d[(d.covered > 0.9) & d.per.notna()].copy()
        beside["ratio"] = beside.per / np.interp(beside.batch_size, alone.index, alone.to_numpy())
        by = beside.groupby(pd.cut(beside.chunk, BINS), observed=False).ratio.agg(
            ["median", "size"]
        )
        cells = [
            f"{m:.2f} ({n})" if n else "-" for m, n in zip(by["median"], by["size"], strict=True)
        ]
        label = "hw" if side == "hw" else "replay"
        print(f"| {run} | {label} | " + " | ".join(cells) + f" | {beside.ratio.median():.2f} |")

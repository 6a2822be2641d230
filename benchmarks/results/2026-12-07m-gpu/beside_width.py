"""The disaggregated runs' full prompt chunks (2,000 tokens or more) by the decode passes
beside them: the count and the median device time (ms) of the chunks, by the median
sequences of the decode passes their time overlaps, in each run directory given.
  python beside_width.py VALIDATE_DIR/calibration/disagg-10.4rps VALIDATE_DIR/hw/disagg-10.4rps ...
"""

import sys
from itertools import pairwise

import numpy as np
import pandas as pd

BINS = [0, 8, 10, 12, 14, 16, 17, 18, 20, 22, 26, 40]


def chunks_by_width(run: str) -> pd.DataFrame:
    steps = pd.read_parquet(f"{run}/steps.parquet")
    chunks = steps[(steps.node == "prefill0") & (steps.prefill_tokens >= 2000)].copy()
    dec = steps[steps.node == "decode0"]
    start, end = dec.start_s.to_numpy(), (dec.start_s + dec.duration_s).to_numpy()
    seqs = dec.batch_size.to_numpy()
    widths = []
    for a, b in zip(chunks.start_s, chunks.start_s + chunks.duration_s, strict=True):
        met = (start < b) & (end > a)
        widths.append(float(np.median(seqs[met])) if met.any() else 0.0)
    chunks["width"] = widths
    return chunks


if len(sys.argv) < 2:
    sys.exit("usage: python beside_width.py RUN_DIR [RUN_DIR ...]")
table = {}
for run in sys.argv[1:]:
    chunks = chunks_by_width(run)
    by = chunks.groupby(pd.cut(chunks.width, BINS), observed=False).device_s
    cells = by.agg(["count", "median"]).itertuples(index=False)
    table[run] = [f"{n} / {m * 1e3:.1f}" if n else "-" for n, m in cells]
index = [f"{lo + 1}-{hi}" for lo, hi in pairwise(BINS)]
print(pd.DataFrame(table, index=index).to_markdown())

"""How long a decode pass keeps its own work on the GPU beside a chunk pass, against one alone at
its batch, from the 2026-12-06 kernel timelines of one H100 (`../2026-12-06-gpu/h100/`): per
decode pass of the run, the time (1 us bins) when a kernel or copy of the decoder's has begun
and not ended and no turn of the prefill's runs ("active": the decoder's kernels, and the
switches that a preempted kernel spans), the prefill's turns inside the pass, and the rest.

    python benchmarks/results/2026-12-06b-cpu/decoder_active.py   # decoder_active.txt
"""

import sys
import tarfile
import tempfile
from pathlib import Path

import numpy as np
import pandas as pd

HERE = Path(__file__).parent
GPU = HERE.parent / "2026-12-06-gpu"
sys.path.insert(0, str(GPU))
from kernel_turns import turns  # noqa: E402  (the records' own tables)


def passes(kernels: Path, steps: pd.DataFrame) -> pd.DataFrame:
    k = pd.read_csv(kernels)
    t, lo, hi = turns(k)
    n = int((hi - lo) * 1000) + 1
    mine, theirs = np.zeros(n, bool), np.zeros(n, bool)
    d = k[k.kind.isin(["kernel", "memcpy", "memset"]) & (k.node == "decode0")]
    p = t[t.node == "prefill0"]
    for mask, a, b in ((mine, d.start_ms, d.end_ms), (theirs, p.start, p.end)):
        starts, ends = ((a - lo) * 1000).astype(int), ((b - lo) * 1000).astype(int)
        for i, j in zip(starts, ends, strict=True):
            mask[max(i, 0) : max(j, 0)] = True
    active = mine & ~theirs
    s = steps.assign(a=steps.start_s * 1e3, b=(steps.start_s + steps.duration_s) * 1e3)
    s = s[(s.node == "decode0") & (s.a > lo) & (s.b < hi)]
    rows = []
    for r in s.itertuples():
        i, j = int((r.a - lo) * 1000), int((r.b - lo) * 1000)
        inside = int(((p.start >= r.a) & (p.start < r.b)).sum())
        busy = active[i:j].sum() / 1e3, theirs[i:j].sum() / 1e3
        rows.append((r.batch_size, r.b - r.a, *busy, inside))
    x = pd.DataFrame(rows, columns=["batch", "pass ms", "active ms", "prefill ms", "turns"])
    return x.assign(beside=x.turns > 0)


with tempfile.TemporaryDirectory() as tmp:
    with tarfile.open(GPU / "h100" / "runs.tar.xz") as tar:
        tar.extractall(tmp, filter="data")
    for rate in ("5.59", "9.5"):
        steps = pd.read_parquet(Path(tmp) / f"run-{rate}" / "steps.parquet")
        x = passes(GPU / "h100" / f"kernels-{rate}.csv.xz", steps)
        bins = pd.cut(x.batch, [0, 4, 8, 16, 24, 32, 48, 64])
        table = x.groupby([bins, "beside"], observed=True).median().drop(columns="batch")
        print(f"H100, {rate} req/s: medians by batch, beside a chunk pass or not")
        print(table.round(2).to_string(), end="\n\n")

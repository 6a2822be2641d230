"""A disaggregated chunk pass's extra on one shared GPU by the sequences of the first decode
pass it met, in a validate's calibration runs and its hardware runs (2026-12-07e).

    python benchmarks/results/2026-12-07e-cpu/extra_seqs.py VALIDATE_DIR...

Each VALIDATE_DIR is a validate directory (a runs.tar.xz unpacked) with calibration/ and hw/.
The extra is what `disagg validate` fits the chunk extra's shape on (`disagg.share`): a chunk
pass's device time beyond its time alone at its shape, over the shape's factor. Shown for the
full chunks only (over 30 ms alone): the median in ms, and the passes, by sequences."""

import json
import sys
from pathlib import Path

import numpy as np
import pandas as pd

from disagg.share import _met_passes, extra_shape
from disagg.sim.costmodel import make_cost_model
from disagg.validate import load_experiment, profiled
from disagg.validate_passes import shape_device

EDGES = [0, 2, 4, 8, 12, 16, 24, 32, 64, 256]

for v in map(Path, sys.argv[1:]):
    costs = json.loads((v / "calibration" / "calibration.json").read_text())
    csv = (v / "profile.csv").resolve()
    for kind in ("calibration", "hw"):
        runs, exp = [], None
        for d in sorted((v / kind).glob("disagg-*")):
            steps = pd.read_parquet(d / "steps.parquet")
            exp = load_experiment(d, profiled(csv, costs))
            runs.append((steps, shape_device(steps, exp)))
        if exp is None:
            continue
        host_s = make_cost_model(exp, exp.cluster.prefill, "prefill").host_s(True, 0)
        shape = extra_shape(runs, exp.hw.latency.prefill_graphs, host_s)
        passes = _met_passes(runs)
        at = np.array([s for s, _ in shape], float)
        factor = np.interp(passes.alone + host_s, at, [f for _, f in shape]) if len(at) else 1.0
        full = passes.assign(x=passes.extra / factor)[passes.alone > 0.03]
        by = full.groupby(pd.cut(full.first_seqs, EDGES), observed=True).x.agg(["median", "size"])
        said = " ".join(f"<={iv.right:g}: {m * 1e3:.1f} ({n})" for iv, (m, n) in by.iterrows())
        print(f"{v}: {kind}, {len(passes)} passes met a decode pass; full chunks: {said}")

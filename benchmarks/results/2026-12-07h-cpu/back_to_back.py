"""A colocated run's passes with a prompt chunk on the hardware against the profile at their
shape, by the time since the node's last pass with a chunk ended and by load (2026-12-07h):
the median of device time over the profile's (`disagg.validate_passes.shape_device`), and the
passes, both hardware runs of each cell pooled, over the validates given.

    python benchmarks/results/2026-12-07h-cpu/back_to_back.py VALIDATE_DIR...

Each VALIDATE_DIR needs its hw/, hw-2/ and sim-profile/ runs (a replay's directory)."""

import sys
from pathlib import Path

import pandas as pd

from disagg.validate import load_experiment
from disagg.validate_passes import shape_device, since_chunk

EDGES_S = [-1, 0.004, 0.015, 0.03, 0.06, 0.12, 0.25, 0.5, 10]
rows = []
for where in map(Path, sys.argv[1:]):
    for run in sorted(d.name for d in (where / "hw").glob("colocated-*rps")):
        exp = load_experiment(where / "sim-profile" / run, [])
        for side in ("hw", "hw-2"):
            steps = pd.read_parquet(where / side / run / "steps.parquet")
            passes = steps[steps.prefill_tokens > 0].assign(
                r=steps.device_s / shape_device(steps, exp),
                since=since_chunk(steps),
                validate=str(where),
                rate=float(run.removeprefix("colocated-").removesuffix("rps")),
            )
            rows.append(passes)
passes = pd.concat(rows)
passes["load"] = (
    passes.groupby("validate").rate.rank(method="dense").map({1: "light", 2: "middle", 3: "top"})
)
table = passes.groupby([pd.cut(passes.since, EDGES_S), "load"], observed=True).r
table = table.agg(["median", "count"]).unstack().round(3)
print(table.to_markdown())

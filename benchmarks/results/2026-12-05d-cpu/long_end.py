"""How many of a validate's colocated pass records with decodes have a mean context past the
longest one its profile measured: on the grid it was profiled on, and on the grid with the
longest quarter's mixes (`disagg.hw.profile.long_mixes`).

    tar xJf benchmarks/results/2026-12-05b-gpu/llama-overlap/runs.tar.xz -C /tmp/v
    python benchmarks/results/2026-12-05d-cpu/long_end.py /tmp/v/validate-llama8-overlap
"""

import sys
from pathlib import Path

import numpy as np
import pandas as pd

from disagg.config import load_experiment
from disagg.hw.profile import long_mixes
from disagg.validate_plan import profile_grid

root = Path(sys.argv[1])
runs = sorted(d for d in (root / "hw").iterdir() if d.name.startswith("colocated-"))
exps = [
    load_experiment(d) for d in (runs[0], root / "hw" / runs[0].name.replace("colocated", "disagg"))
]
grid = profile_grid(exps, 3)
profiled = pd.read_csv(root / "profile.csv").query("kind == 'decode'").context.max()
batches = sorted({*grid.decode_batch, *(b for _, b, _ in grid.mixed)})
longest = max(np.mean(m) for m in long_mixes(grid.decode_mix, batches, 0).values())
rows = []
for run in runs:
    steps = pd.read_parquet(root / "sim-profile" / run.name / "steps.parquet")
    steps = steps[steps.decode_seqs > 0]
    mean = steps.decode_context / steps.decode_seqs
    rows.append(
        {"run": run.name, "pass records": len(mean),
         f"past {profiled:,.0f}": f"{(mean > profiled).mean():.1%}",
         f"past {longest:,.0f}": f"{(mean > longest).mean():.1%}", "longest": mean.max()}
    )  # fmt: skip
print(pd.DataFrame(rows).round(0).to_markdown(index=False))

"""How far a colocated chunk pass ran beyond the profile at its own shape, against the time the
host took to launch it, in the 2026-12-05b overlap validate (its runs.tar.xz, unpacked to ROOT).

    tar xJf benchmarks/results/2026-12-05b-gpu/llama-overlap/runs.tar.xz -C /tmp/v
    python benchmarks/results/2026-12-05c-cpu/launch_excess.py /tmp/v/validate-llama8-overlap
"""

import sys
from pathlib import Path

import numpy as np
import pandas as pd

from disagg.config import load_experiment
from disagg.validate_passes import shape_device

root = Path(sys.argv[1])
csv = (root / "profile.csv").resolve()
runs = [*sorted(root.glob("calibration/*rps")), *sorted(root.glob("hw/colocated-*"))]
rows = []
for d in (d for d in runs if not d.name.startswith("disagg")):
    steps = pd.read_parquet(d / "steps.parquet")
    steps = steps[(steps.prefill_tokens > 0) & steps.device_s.notna()].copy()
    exp = load_experiment(d).updated(f"cost.source=profile:{csv}")
    steps["excess_ms"] = (steps.device_s - shape_device(steps, exp)) * 1e3
    steps["launch_ms"] = steps.launch_s * 1e3
    small = steps[steps.prefill_tokens < 900]
    full = steps.prefill_tokens >= 2030
    rows.append(
        {
            "run": f"{d.parent.name}/{d.name}",
            "chunk passes": len(steps),
            "launch, < 2,030 tokens": steps[~full].launch_ms.median(),
            "launch, 2,030-2,048": steps[full].launch_ms.median(),
            "excess, < 900 tokens": small.excess_ms.median(),
            "excess, 2,030-2,048": steps[full].excess_ms.median(),
            "corr, all": np.corrcoef(steps.excess_ms, steps.launch_ms)[0, 1],
            "corr, < 900 tokens": np.corrcoef(small.excess_ms, small.launch_ms)[0, 1],
        }
    )
print(pd.DataFrame(rows).round(2).to_markdown(index=False))

"""The 2026-12-05b overlap validate's colocated replays (profile and loop calibration as
validate replayed them) rerun under each colocated scheduler, beside the disaggregated replay:
what the simulator predicts before the hw measures it (`disagg validate --schedulers`).

    tar xJf benchmarks/results/2026-12-05b-gpu/llama-overlap/runs.tar.xz -C /tmp/v
    python benchmarks/results/2026-12-05c-cpu/policies.py /tmp/v/validate-llama8-overlap
"""

import sys
import tempfile
from pathlib import Path

import pandas as pd

from disagg.validate import replay

root = Path(sys.argv[1])
profile = f"cost.source=profile:{(root / 'profile.csv').resolve()}"
rows = []
with tempfile.TemporaryDirectory() as tmp:
    for load in ("2.67", "5.34", "9.08"):
        runs = [(p, f"colocated-{load}rps", [f"cluster.colocated.scheduler.name={p}"])
                for p in ("chunked", "prefill_first", "decode_priority")]  # fmt: skip
        for policy, label, flags in [*runs, ("disagg", f"disagg-{load}rps", [])]:
            s, _ = replay(root / "sim-profile" / label, [profile, *flags], Path(tmp))
            figures = {
                f"{k} {q}": s[f"{k}_s_{q}"] * 1e3
                for k, qs in (("ttft", "p50 p90 p99"), ("tpot", "p50 p90 p99"), ("itl", "p50 p99"))
                for q in qs.split()
            }
            rows.append(
                {"req/s": load, "policy": policy, **figures, "tok/s": s["output_throughput"],
                 "beyond the grid": s["profile_passes_extrapolated"]}
            )  # fmt: skip
print(pd.DataFrame(rows).round(1).to_markdown(index=False))

"""Decode priority's chunk beside decodes (`chunk_with_decodes`), as the simulator predicts it
on the 2026-12-05b overlap validate's colocated replays (profile and loop calibration as
validate replayed them), against chunked prefill: which settings are worth a GPU run of
`disagg validate --schedulers decode_priority:chunk_with_decodes=N`.

    tar xJf benchmarks/results/2026-12-05b-gpu/llama-overlap/runs.tar.xz -C /tmp/v
    python benchmarks/results/2026-12-05d-cpu/decode_priority_chunks.py \
        /tmp/v/validate-llama8-overlap
"""

import sys
import tempfile
from pathlib import Path

import pandas as pd

from disagg.validate import replay

root = Path(sys.argv[1])
profile = f"cost.source=profile:{(root / 'profile.csv').resolve()}"
policies = [("chunked", "chunked")] + [
    (f"decode_priority {n}", f'{{"name": "decode_priority", "chunk_with_decodes": {n}}}')
    for n in (256, 512, 1024, 1536)
]
rows = []
with tempfile.TemporaryDirectory() as tmp:
    for load in ("2.67", "5.34", "9.08"):
        for name, spec in policies:
            flags = [profile, f"cluster.colocated.scheduler={spec}"]
            s, _ = replay(root / "sim-profile" / f"colocated-{load}rps", flags, Path(tmp))
            figures = {
                f"{k} {q}": s[f"{k}_s_{q}"] * 1e3
                for k, qs in (("ttft", "p50 p90"), ("tpot", "p50 p90"), ("itl", "p99"))
                for q in qs.split()
            }
            rows.append(
                {"req/s": load, "policy": name, **figures, "tok/s": s["output_throughput"],
                 "beyond the grid": s["profile_passes_extrapolated"]}
            )  # fmt: skip
print(pd.DataFrame(rows).round(1).to_markdown(index=False))

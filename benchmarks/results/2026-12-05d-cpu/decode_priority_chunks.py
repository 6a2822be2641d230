"""Decode priority's chunk beside decodes (`chunk_with_decodes`), as the simulator predicts it
on the 2026-12-05b overlap validate's colocated replays (profile and loop calibration as
validate replayed them), against chunked prefill: which settings are worth a GPU run of
`disagg validate --schedulers decode_priority:chunk_with_decodes=N`.

    tar xzf benchmarks/results/2026-12-05b-gpu/llama-overlap/runs.tgz -C /tmp/v
    python benchmarks/results/2026-12-05d-cpu/decode_priority_chunks.py \
        /tmp/v/validate-llama8-overlap
"""

import sys
from pathlib import Path

import pandas as pd

from disagg.config import load_experiment
from disagg.core.metrics import requests_table, steps_table, summarize, transfers_table
from disagg.sim.cluster import Sim

root = Path(sys.argv[1])
profile = f"cost.source=profile:{(root / 'profile.csv').resolve()}"
policies = [("chunked", "chunked")] + [
    (f"decode_priority {n}", f'{{"name": "decode_priority", "chunk_with_decodes": {n}}}')
    for n in (256, 512, 1024, 1536)
]
rows = []
for load in ("2.67", "5.34", "9.08"):
    for name, spec in policies:
        exp = load_experiment(root / "sim-profile" / f"colocated-{load}rps").updated(
            profile, f"cluster.colocated.scheduler={spec}"
        )
        sim = Sim(exp)
        sim.run()
        req, steps = requests_table(sim.requests.values()), steps_table(sim.rec)
        s = summarize(req, steps, transfers_table(sim.rec), exp.cluster.total_gpus, 0.0)
        figures = {
            f"{k} {q}": s[f"{k}_s_{q}"] * 1e3
            for k, qs in (("ttft", "p50 p90"), ("tpot", "p50 p90"), ("itl", "p99"))
            for q in qs.split()
        }
        beyond = sim.cost_summary(steps)["profile_passes_extrapolated"]
        rows.append(
            {"req/s": load, "policy": name, **figures, "tok/s": s["output_throughput"],
             "beyond the grid": beyond}
        )  # fmt: skip
print(pd.DataFrame(rows).round(1).to_markdown(index=False))

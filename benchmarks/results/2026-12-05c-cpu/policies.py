"""The 2026-12-05b overlap validate's colocated replays (profile and loop calibration as
validate replayed them) rerun under each colocated scheduler, beside the disaggregated replay:
what the simulator predicts before the hw measures it (`disagg validate --schedulers`).

    tar xzf benchmarks/results/2026-12-05b-gpu/llama-overlap/runs.tgz -C /tmp/v
    python benchmarks/results/2026-12-05c-cpu/policies.py /tmp/v/validate-llama8-overlap
"""

import sys
from pathlib import Path

import pandas as pd

from disagg.config import load_experiment
from disagg.core.metrics import requests_table, steps_table, summarize, transfers_table
from disagg.sim.cluster import Sim

root = Path(sys.argv[1])
profile = f"cost.source=profile:{(root / 'profile.csv').resolve()}"
rows = []
for load in ("2.67", "5.34", "9.08"):
    runs = [(p, f"colocated-{load}rps", [f"cluster.colocated.scheduler.name={p}"])
            for p in ("chunked", "prefill_first", "decode_priority")]  # fmt: skip
    for policy, label, flags in [*runs, ("disagg", f"disagg-{load}rps", [])]:
        exp = load_experiment(root / "sim-profile" / label).updated(profile, *flags)
        sim = Sim(exp)
        sim.run()
        req, steps = requests_table(sim.requests.values()), steps_table(sim.rec)
        s = summarize(req, steps, transfers_table(sim.rec), exp.cluster.total_gpus, 0.0)
        figures = {
            f"{k} {q}": s[f"{k}_s_{q}"] * 1e3
            for k, qs in (("ttft", "p50 p90 p99"), ("tpot", "p50 p90 p99"), ("itl", "p50 p99"))
            for q in qs.split()
        }
        rows.append(
            {"req/s": load, "policy": policy, **figures, "tok/s": s["output_throughput"],
             "beyond the grid": sim.cost_summary(steps)["profile_passes_extrapolated"]}
        )  # fmt: skip
print(pd.DataFrame(rows).round(1).to_markdown(index=False))

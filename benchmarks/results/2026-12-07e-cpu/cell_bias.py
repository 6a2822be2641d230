"""Each cell's mean sim/hw and misses over replayed validates (2026-12-07e), by model, mode,
load (light, middle, top) and metric, from their fidelity.csv.

    python benchmarks/results/2026-12-07e-cpu/cell_bias.py VALIDATE_DIR...

A directory whose path names "moe" counts as the MoE model's, any other as Llama's."""

import csv
import math
import re
import sys
from collections import defaultdict

METRICS = {"ttft_s_p50": 5, "ttft_s_p90": 5, "tpot_s_p50": 3, "tpot_s_p90": 3}
METRICS["output_throughput"] = 3
LOADS = ("light", "middle", "top")


def load_of(run: str) -> float:
    return float(re.findall(r"[\d.]+(?=rps)", run)[0])


logs = defaultdict(list)
for where in sys.argv[1:]:
    model = "MoE" if "moe" in where else "Llama"
    with open(f"{where}/fidelity.csv") as f:
        rows = [r for r in csv.DictReader(f) if r["metric"] in METRICS]
    for r in rows:
        mode = r["run"].split("-")[0]
        same = sorted({x["run"] for x in rows if x["run"].startswith(mode)}, key=load_of)
        key = (model, mode, LOADS[same.index(r["run"])], r["metric"])
        logs[key].append(math.log(float(r["sim_profile"]) / float(r["hw"])))
print("| model | mode | load | " + " | ".join(METRICS) + " |")
print("|---|---|---|" + "---:|" * len(METRICS))
for model, mode, load in sorted({k[:3] for k in logs}, key=lambda k: (*k[:2], LOADS.index(k[2]))):
    cells = []
    for metric, tol in METRICS.items():
        v = logs[(model, mode, load, metric)]
        misses = sum(abs(x) > math.log(1 + tol / 100) for x in v)
        cells.append(f"{math.exp(sum(v) / len(v)):.3f} ({misses}/{len(v)})")
    print(f"| {model} | {mode} | {load} | " + " | ".join(cells) + " |")

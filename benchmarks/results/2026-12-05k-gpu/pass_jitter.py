"""How far one replay's cells move when each pass's time varies as the hw's do: each pass with
a prompt chunk and each lone decode pass (a run of decode passes costed as one is left as it
is) scaled by a mean-1 lognormal factor of log-sd SIGMA_CHUNK / SIGMA_DECODE drawn from a
seeded stream, the run replayed SEEDS times, each cell (sim over the hw runs' median) given as
the median over the seeds and their range. An experiment: the simulator has no such noise.

    python pass_jitter.py VALIDATE_DIR RUN[,RUN...] --sigma-chunk 0.07 --sigma-decode 0.02 --seeds 5

VALIDATE_DIR is a validate's directory after `disagg validate --replay` (its sim-profile/ runs
hold the experiments replayed). The hw's own spread within a shape, as a log-sd, was 0.016-0.041
(decode passes) and 0.068-0.087 (passes with a chunk) against the replay's 0.006 / 0.024-0.054
(12-05k, colocated runs).
"""

from __future__ import annotations

import argparse
import json
import math
import random
from pathlib import Path

import numpy as np

import disagg.sim.cluster as cluster
from disagg.validate import replay

METRICS = ("ttft_s_p50", "ttft_s_p90", "tpot_s_p50", "tpot_s_p90", "output_throughput")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("validate", type=Path)
    ap.add_argument("runs")
    ap.add_argument("--sigma-chunk", type=float, default=0.07)
    ap.add_argument("--sigma-decode", type=float, default=0.02)
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument("--scratch", type=Path, default=Path("/tmp/pass_jitter"))
    a = ap.parse_args()
    busy, stream = cluster.Node.busy, {"rng": random.Random(0)}

    def jittered(node: cluster.Node, seconds: float, prefill: bool, decodes: int):  # type: ignore[no-untyped-def]
        s = a.sigma_chunk if prefill else a.sigma_decode
        if s > 0:
            seconds *= math.exp(stream["rng"].gauss(0.0, s) - s * s / 2)
        return busy(node, seconds, prefill, decodes)

    cluster.Node.busy = jittered  # type: ignore[method-assign]
    print("| run | " + " | ".join(METRICS) + " |\n|---|" + "---:|" * len(METRICS))
    for run in a.runs.split(","):
        hws = [a.validate / d / run for d in ("hw", "hw-2", "hw-3")]
        hw = [json.loads((d / "summary.json").read_text()) for d in hws if d.exists()]
        median = {k: float(np.median([h[k] for h in hw])) for k in METRICS}
        cells = {k: [] for k in METRICS}
        for seed in range(a.seeds):
            stream["rng"] = random.Random(seed)
            sim, _ = replay(a.validate / "sim-profile" / run, [], a.scratch / f"{run}-{seed}")
            for k in METRICS:
                cells[k].append(sim[k] / median[k])
        said = [f"{np.median(v):.3f} ({min(v):.3f}-{max(v):.3f})" for v in cells.values()]
        print(f"| {run} | " + " | ".join(said) + " |", flush=True)


if __name__ == "__main__":
    main()

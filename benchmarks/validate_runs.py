"""The hw runs of `disagg validate` for one mode only, at given loads, into a validate directory's
`hw/` (MODE-RATErps, as validate labels them), so that `disagg validate --replay --out DIR`
replays them with that directory's profile and loop calibration. For a device call too short for
a whole validate: its other runs come from an earlier call.

    python benchmarks/validate_runs.py experiments/llama8b-h200.toml --mode disagg \\
        --rates 2.22,4.43,7.53 --requests 32 --device cuda:0 --out runs/validate \\
        --set hw.latency.cores_per_server=2
"""

from __future__ import annotations

import argparse
from pathlib import Path

from disagg.hw.driver import run_hw
from disagg.validate import Options, prepare
from disagg.validate_plan import plan_runs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("experiment", type=Path)
    ap.add_argument("--mode", choices=["colocated", "disagg"], required=True)
    ap.add_argument("--rates", required=True, help="requests/s, e.g. 2.22,4.43,7.53")
    ap.add_argument("--requests", type=int)
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--set", dest="overrides", action="append", default=[])
    a = ap.parse_args()
    opts = Options(device=a.device, requests=a.requests, overrides=tuple(a.overrides))
    exps = prepare([a.experiment], opts)
    rates = [float(r) for r in a.rates.split(",")]
    for run in plan_runs(exps, rates):
        if run.exp.cluster.mode == a.mode:
            print(f"hw run: {run.label}", flush=True)
            run_hw(run.exp, a.out / "hw" / run.label)


if __name__ == "__main__":
    main()

"""Replay the five committed validates two ways and count the cells met: their calibration runs'
steps tables as committed (no shape columns: the chunk offsets are fitted on the replays), and
with the shape columns rebuilt from the requests tables (`rebuild_shapes.py`: the offsets are
fitted pass by pass):

    cd benchmarks/results/2026-12-05-cpu && python compare.py > compare.md
"""

from __future__ import annotations

import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

import numpy as np
import pandas as pd

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[2]
VALIDATES = {
    "Llama 12-03d": "2026-12-03d-gpu/llama/runs.tar.xz",
    "Llama 12-04": "2026-12-04-gpu/llama/runs.tar.xz",
    "Llama 12-04b": "2026-12-04b-gpu/llama/runs.tar.xz",
    "Llama 12-04d": "2026-12-04d-gpu/llama/runs.tar.xz",
    "MoE 12-03c": "2026-12-03c-gpu/moe/runs.tar.xz",
}
TOLERANCES = {"ttft_s_p50": 5, "ttft_s_p90": 5, "tpot_s_p50": 3, "tpot_s_p90": 3}
TOLERANCES["output_throughput"] = 3
FLAG = "ttft_p50=5,ttft_p90=5,tpot_p50=3,tpot_p90=3,output_throughput=3"


def unpack(tgz: Path, into: Path) -> Path:
    """The validate directory in `tgz` (the one holding profile.csv), extracted under `into`."""
    with tarfile.open(tgz) as t:
        t.extractall(into, filter="data")
    return next(p.parent for p in into.rglob("profile.csv"))


def cells(out: Path) -> dict[str, str]:
    """Per mode: cells met of all, and the mean |log sim/hw| over them."""
    f = pd.read_csv(out / "fidelity.csv")
    f = f[f.metric.isin(TOLERANCES)]
    r = f.sim_profile / f.hw
    met = (abs(r - 1) * 100 <= f.metric.map(TOLERANCES)).to_numpy()
    mode = f.run.str.split("-").str[0].to_numpy()
    logs = np.abs(np.log(r.to_numpy()))
    return {
        m: f"{met[mode == m].sum()} / {(mode == m).sum()} ({logs[mode == m].mean():.3f})"
        for m in ("colocated", "disagg")
    }


def main() -> None:
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, tgz in VALIDATES.items():
            for way in ("replays", "passes"):
                out = unpack(ROOT / "benchmarks" / "results" / tgz, Path(tmp) / name / way)
                if way == "passes":
                    subprocess.run(
                        [sys.executable, HERE / "rebuild_shapes.py", out],
                        check=True,
                        capture_output=True,
                    )
                cmd = [str(Path(sys.executable).parent / "disagg"), "validate", "--replay"]
                cmd += ["--out", str(out), "--tolerance", FLAG]
                subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)  # exit 1: a miss
                got = cells(out)
                rows.append((name, way, got["colocated"], got["disagg"]))
                print(name, way, got, file=sys.stderr, flush=True)
    head = "| validate | offsets fitted on | colocated met (mean abs log) | disagg met (ditto) |"
    print(head)
    print("|---|---|---:|---:|")
    for row in rows:
        print("| " + " | ".join(row) + " |")


if __name__ == "__main__":
    main()

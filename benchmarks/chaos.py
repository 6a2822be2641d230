"""Chaos runs on the CPU tcp backend (the seeds of tests/test_chaos.py and more): per seed,
the faults injected, requests completed, failed and unfinished, and pages left reserved.

    python benchmarks/chaos.py --seeds 1-6 --out benchmarks/results/DATE-chaos
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent.parent / "tests"))

from test_chaos import chaos_experiment, draw_faults

from disagg.config import build_experiment
from disagg.errors import TransportError
from disagg.hw.driver import run_hw


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seeds", default="1-6", help="first-last")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    first, last = (int(x) for x in args.seeds.split("-"))
    rows = []
    for seed in range(first, last + 1):
        faults = draw_faults(seed)
        run = args.out / f"seed{seed}"
        with contextlib.suppress(TransportError):  # a kill stops the run; its tables stay
            run_hw(build_experiment(chaos_experiment(seed, faults)), run)
        s = json.loads((run / "summary.json").read_text())
        row = {
            "seed": seed,
            "faults": "; ".join(f["fault"] for f in s["faults"]),
            "completed": s["completed"],
            "failed": s["failed"],
            "unfinished": s.get("unfinished", 0),
            "pages_left": sum(s["pages_in_use"].values()) if "stopped" not in s else "cut short",
            "peers_declared_dead": s["peers_declared_dead"],
        }
        rows.append(row)
        print(json.dumps(row), flush=True)
    (args.out / "chaos.json").write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()

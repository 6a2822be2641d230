"""The collector's share of one hour of `r1-disagg-1p3d` with the `disagg` of DIR: wall seconds
of `Sim(exp)` and `sim.run()`, the seconds spent in collections (timed by `gc.callbacks`) and
their count per generation.

    python benchmarks/results/2026-12-02d-sim-speed/gc_time.py DIR
"""

import gc
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[3]


def main() -> None:
    code_dir = str(Path(sys.argv[1]).resolve())
    sys.path.insert(0, code_dir)
    from disagg.config import load_experiment
    from disagg.sim.cluster import Sim

    toml = ROOT / "experiments" / "r1-disagg-1p3d.toml"
    exp = load_experiment(toml, ["workload.duration_s=3600"])
    spent, started, counts = [0.0], [0.0], {0: 0, 1: 0, 2: 0}

    def timed(phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            started[0] = time.perf_counter()
        else:
            spent[0] += time.perf_counter() - started[0]
            counts[info["generation"]] += 1

    gc.callbacks.append(timed)
    t0 = time.perf_counter()
    sim = Sim(exp)
    sim.run()
    wall = time.perf_counter() - t0
    print(f"{code_dir}: {wall:.3f} s, collector {spent[0]:.3f} s, collections {counts}")


if __name__ == "__main__":
    main()

"""The collector's collections and seconds during one hour of r1-disagg-1p3d (`Sim.run`, which
freezes the objects made before it), by generation, read with `gc.callbacks`.

    python benchmarks/results/2026-12-02c-sim-speed/gc_time.py DIR
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

    exp = load_experiment(
        ROOT / "experiments" / "r1-disagg-1p3d.toml", ["workload.duration_s=3600"]
    )
    sim = Sim(exp)
    seconds, count, began = [0.0, 0.0, 0.0], [0, 0, 0], [0.0]

    def timed(phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            began[0] = time.perf_counter()
        else:
            seconds[info["generation"]] += time.perf_counter() - began[0]
            count[info["generation"]] += 1

    gc.callbacks.append(timed)
    start = time.perf_counter()
    sim.run()
    wall = time.perf_counter() - start
    gc.callbacks.remove(timed)
    by_gen = ", ".join(f"gen{g}: {count[g]} in {seconds[g]:.3f} s" for g in range(3))
    print(f"{code_dir}: {wall:.3f} s wall, collector {sum(seconds):.3f} s ({by_gen})")


if __name__ == "__main__":
    main()

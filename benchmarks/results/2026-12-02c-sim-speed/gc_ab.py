"""Wall time of one hour of r1-disagg-1p3d with the collector as `Sim.run` leaves it
(`normal`), off for the whole process (`off`), or with a young-generation threshold of 20,000
(`thresh`): how much of the run the collector takes. Tried, not adopted.

    OPENBLAS_NUM_THREADS=1 python benchmarks/results/2026-12-02c-sim-speed/gc_ab.py DIR MODE
"""

import gc
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


def main() -> None:
    sys.path.insert(0, str(Path(sys.argv[1]).resolve()))
    mode = sys.argv[2]
    from disagg.config import load_experiment
    from disagg.sim.cluster import Sim

    exp = load_experiment(
        ROOT / "experiments" / "r1-disagg-1p3d.toml", ["workload.duration_s=3600"]
    )
    if mode == "thresh":
        gc.set_threshold(20000, 10, 10)
    elif mode == "off":
        gc.disable()
    start = time.perf_counter()
    sim = Sim(exp)
    sim.run()
    print(f"{mode} {time.perf_counter() - start:.3f} s")


if __name__ == "__main__":
    main()

"""One run of `r1-disagg-1p3d` for DURATION_S simulated seconds with the `disagg` of DIR, in
this process (for `perf record` of a whole process): prints the wall seconds of `Sim(exp)` and
of `sim.run()` (the two parts of sim_speed.py's timed region).

    python benchmarks/results/2026-12-02d-sim-speed/one_run.py DIR [DURATION_S]
"""

import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


def main() -> None:
    code_dir = str(Path(sys.argv[1]).resolve())
    duration_s = sys.argv[2] if len(sys.argv) > 2 else "3600"
    sys.path.insert(0, code_dir)
    from disagg.config import load_experiment
    from disagg.sim.cluster import Sim

    toml = ROOT / "experiments" / "r1-disagg-1p3d.toml"
    exp = load_experiment(toml, [f"workload.duration_s={duration_s}"])
    t0 = time.perf_counter()
    sim = Sim(exp)
    t1 = time.perf_counter()
    sim.run()
    t2 = time.perf_counter()
    n = len(sim.requests)
    print(f"{code_dir}: Sim(exp) {t1 - t0:.3f} s, run {t2 - t1:.3f} s, {n} requests")


if __name__ == "__main__":
    main()

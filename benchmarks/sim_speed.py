"""How fast the simulator runs: one hour of the R1 1 P : 3 D experiment (about 10,800 requests).

    python benchmarks/sim_speed.py [--repeats 3] [--duration-s 3600]

Prints one line per run and, last, the median run:
    sim_speed: <requests> requests, <simulated_s> simulated s, <wall_s> wall s, <req/s> req/s
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from disagg.config import load_experiment
from disagg.sim.cluster import Sim

EXPERIMENT = Path(__file__).parent.parent / "experiments" / "r1-disagg-1p3d.toml"


def once(duration_s: float) -> tuple[int, float, float]:
    exp = load_experiment(EXPERIMENT, [f"workload.duration_s={duration_s}"])
    start = time.perf_counter()
    sim = Sim(exp)
    sim.run()
    wall = time.perf_counter() - start
    return len(sim.requests), sim.env.now, wall


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--duration-s", type=float, default=3600.0)
    args = ap.parse_args()
    runs = []
    for i in range(args.repeats):
        n, sim_s, wall = once(args.duration_s)
        runs.append((wall, n, sim_s))
        print(f"run {i}: {n} requests, {sim_s:.0f} simulated s, {wall:.2f} wall s")
    wall, n, sim_s = sorted(runs)[len(runs) // 2]  # the median run (odd repeats)
    print(
        f"sim_speed: {n} requests, {sim_s:.0f} simulated s, {wall:.2f} wall s, {n / wall:.0f} req/s"
    )


if __name__ == "__main__":
    main()

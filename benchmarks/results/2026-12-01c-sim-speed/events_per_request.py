"""SimPy events scheduled per request (the environment's event counter) for one hour of
r1-disagg-1p3d and one minute of cluster-1000gpu, with the `disagg` of the checkout given.

    python benchmarks/results/2026-12-01c-sim-speed/events_per_request.py DIR
"""

import sys
from pathlib import Path

EXPERIMENTS = Path(__file__).resolve().parents[3] / "experiments"


def main(code_dir: str) -> None:
    sys.path.insert(0, code_dir)
    from disagg.config import load_experiment
    from disagg.sim.cluster import Sim

    for name, duration_s in (("r1-disagg-1p3d", 3600), ("cluster-1000gpu", 60)):
        overrides = [f"workload.duration_s={duration_s}"]
        sim = Sim(load_experiment(EXPERIMENTS / f"{name}.toml", overrides))
        sim.run()
        events = next(sim.env._eid)  # each scheduled event (and run slice's end mark) took one
        n = len(sim.requests)
        print(
            f"{code_dir} {name} {duration_s} s: {n} requests, {events} events, "
            f"{events / n:.2f} per request"
        )


if __name__ == "__main__":
    main(sys.argv[1])

"""Calls per finished request, by function (cProfile's ncalls over the requests finished
meanwhile): runs `r1-disagg-1p3d` to 600 simulated s unprofiled, then profiles 600 to 1,200 s,
and prints the calls per request in all, those of Python functions, and the top N functions by
calls (builtins included, as cProfile counts them).

    python benchmarks/results/2026-12-02c-sim-speed/calls_per_request.py DIR [N]
"""

import cProfile
import gc
import pstats
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


def main() -> None:
    code_dir = str(Path(sys.argv[1]).resolve())
    top = int(sys.argv[2]) if len(sys.argv) > 2 else 60
    sys.path.insert(0, code_dir)
    from disagg.config import load_experiment
    from disagg.sim.cluster import Sim

    toml = ROOT / "experiments" / "r1-disagg-1p3d.toml"
    sim = Sim(load_experiment(toml, ["workload.duration_s=1500"]))
    gc.freeze()
    sim.env.run(until=600)
    finished = sim.finished
    profile = cProfile.Profile()
    profile.enable()
    sim.env.run(until=1200)
    profile.disable()
    n = sim.finished - finished
    stats = pstats.Stats(profile).stats  # type: ignore[attr-defined]
    rows = [
        (calls / n, f"{Path(path).name}:{line} {name}" if path != "~" else name)
        for (path, line, name), (_, calls, _, _, _) in stats.items()
    ]
    python = sum(c for (path, _, _), (_, c, _, _, _) in stats.items() if path != "~") / n
    print(
        f"{code_dir}: {sum(c for c, _ in rows):.1f} calls per request ({n} finished), "
        f"{python:.1f} of Python functions"
    )
    for calls, name in sorted(rows, reverse=True)[:top]:
        print(f"{calls:8.2f}  {name}")


if __name__ == "__main__":
    main()

"""CPU time (`time.process_time`, the process's own user + system time: time spent waiting for
a core on a shared machine is not in it) of one hour of r1-disagg-1p3d, with the `disagg` of
each checkout given, alternately in fresh processes; prints each run and the ratio of the
medians (the first checkout's over the second's).

    python benchmarks/results/2026-12-02-sim-speed/cpu_time.py THIS OTHER [REPEATS]
"""

import statistics
import subprocess
import sys
from pathlib import Path

RUN = (
    "import sys, time; sys.path.insert(0, {dir!r}); from disagg.config import load_experiment; "
    "from disagg.sim.cluster import Sim; "
    "exp = load_experiment({toml!r}, ['workload.duration_s=3600']); "
    "t = time.process_time(); Sim(exp).run(); print(time.process_time() - t)"
)
TOML = str(Path(__file__).resolve().parents[3] / "experiments" / "r1-disagg-1p3d.toml")


def cpu_s(code_dir: str) -> float:
    code = RUN.format(dir=str(Path(code_dir).resolve()), toml=TOML)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return float(out.stdout.split()[-1])


def main() -> None:
    this, other = sys.argv[1], sys.argv[2]
    repeats = int(sys.argv[3]) if len(sys.argv) > 3 else 7
    runs: dict[str, list[float]] = {this: [], other: []}
    for i in range(repeats):
        for d in (other, this):
            runs[d].append(cpu_s(d))
            print(f"run {i} {d}: {runs[d][-1]:.3f} CPU s")
    a, b = statistics.median(runs[this]), statistics.median(runs[other])
    print(f"cpu_time: median {a:.3f} s ({this}), {b:.3f} s ({other}): ratio {a / b:.3f}")


if __name__ == "__main__":
    main()

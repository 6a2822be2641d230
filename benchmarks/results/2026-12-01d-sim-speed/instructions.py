"""Instructions the simulation itself executes, counted by valgrind (cachegrind, no cache
model): deterministic, unlike wall time on a loaded machine. Runs the experiment for D1 and for
D2 simulated seconds with the `disagg` of DIR, each under valgrind, and prints the difference
(the imports and setup cancel out: what is left is simulating from D1 to D2).

    python benchmarks/results/2026-12-01d-sim-speed/instructions.py DIR [EXPERIMENT D1 D2]
"""

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
RUN = (
    "import sys; sys.path.insert(0, {dir!r}); from disagg.config import load_experiment; "
    "from disagg.sim.cluster import Sim; "
    "Sim(load_experiment({toml!r}, ['workload.duration_s={dur}'])).run()"
)


def instructions(code_dir: str, toml: str, duration_s: float) -> int:
    code = RUN.format(dir=code_dir, toml=toml, dur=duration_s)
    cmd = ["valgrind", "--tool=cachegrind", "--cache-sim=no", "--cachegrind-out-file=/dev/null"]
    out = subprocess.run([*cmd, sys.executable, "-c", code], capture_output=True, text=True)
    found = re.search(r"I\s+refs:\s+([\d,]+)", out.stderr)
    if found is None:
        raise SystemExit(f"valgrind gave no count: {out.stderr[-1000:]}")
    return int(found.group(1).replace(",", ""))


def main() -> None:
    code_dir = os.path.abspath(sys.argv[1])
    name, d1, d2 = (sys.argv[2:5] + ["r1-disagg-1p3d", "600", "1200"][len(sys.argv[2:5]) :])[:3]
    toml = str(ROOT / "experiments" / f"{name}.toml")
    a, b = instructions(code_dir, toml, float(d1)), instructions(code_dir, toml, float(d2))
    print(f"{code_dir} {name} {d1}-{d2} s: {b - a:,} instructions ({a:,} and {b:,})")


if __name__ == "__main__":
    main()

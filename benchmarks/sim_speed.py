"""How fast the simulator runs: one hour of the R1 1 P : 3 D experiment (about 10,800 requests).

    python benchmarks/sim_speed.py [--repeats 3] [--duration-s 3600]
    python benchmarks/sim_speed.py --against DIR [--repeats 5]

Prints one line per run and, last, the median run:
    sim_speed: <requests> requests, <simulated_s> simulated s, <wall_s> wall s, <req/s> req/s
With `--against DIR` (a checkout of another commit, e.g. `git worktree add DIR COMMIT`), each
repeat runs that checkout and this one, alternately, each in a fresh process, and the last line
gives the ratio of their median wall times (this one's over the other's): machine noise hits
both alike.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
EXPERIMENT = ROOT / "experiments" / "r1-disagg-1p3d.toml"


def once(duration_s: float) -> tuple[int, float, float]:
    from disagg.config import load_experiment
    from disagg.sim.cluster import Sim

    exp = load_experiment(EXPERIMENT, [f"workload.duration_s={duration_s}"])
    start = time.perf_counter()
    sim = Sim(exp)
    sim.run()
    wall = time.perf_counter() - start
    return len(sim.requests), sim.env.now, wall


def in_process(code_dir: Path, duration_s: float) -> tuple[int, float, float]:
    """`once` in a fresh interpreter importing `disagg` from `code_dir`."""
    script = (
        f"import sys, json; sys.path.insert(0, {str(code_dir)!r}); "
        f"sys.path.insert(0, {str(ROOT / 'benchmarks')!r}); import sim_speed; "
        f"print(json.dumps(sim_speed.once({duration_s})))"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(f"{code_dir}: {out.stderr[-2000:]}")
    n, sim_s, wall = json.loads(out.stdout.strip().splitlines()[-1])
    return n, sim_s, wall


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--duration-s", type=float, default=3600.0)
    ap.add_argument("--against", type=Path, help="another checkout, run alternately with this")
    args = ap.parse_args()
    if args.against is None:
        runs = []
        for i in range(args.repeats):
            n, sim_s, wall = once(args.duration_s)
            runs.append((wall, n, sim_s))
            print(f"run {i}: {n} requests, {sim_s:.0f} simulated s, {wall:.2f} wall s")
        wall, n, sim_s = sorted(runs)[len(runs) // 2]  # the median run (odd repeats)
        print(
            f"sim_speed: {n} requests, {sim_s:.0f} simulated s, {wall:.2f} wall s, "
            f"{n / wall:.0f} req/s"
        )
        return
    walls: dict[str, list[float]] = {"other": [], "this": []}
    for i in range(args.repeats):
        for name, code in (("other", args.against.resolve()), ("this", ROOT)):
            n, sim_s, wall = in_process(code, args.duration_s)
            walls[name].append(wall)
            print(f"run {i} {name}: {n} requests, {sim_s:.0f} simulated s, {wall:.2f} wall s")
    other, this = (statistics.median(walls[k]) for k in ("other", "this"))
    print(f"sim_speed: median wall {this:.2f} s here, {other:.2f} s at {args.against}")
    print(f"sim_speed ratio (this / other): {this / other:.3f}")


if __name__ == "__main__":
    main()

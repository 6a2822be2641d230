"""How fast the simulator runs: one hour of the R1 1 P : 3 D experiment (about 10,800 requests).

    python benchmarks/sim_speed.py [--repeats 3] [--duration-s 3600] [--experiment NAME]
    python benchmarks/sim_speed.py --against DIR [--repeats 5]
    python benchmarks/sim_speed.py --experiment cluster-1000gpu --duration-s 600 --repeats 1

Prints one line per run and, last, the median run:
    sim_speed: <requests> requests, <simulated_s> simulated s, <wall_s> wall s, <req/s> req/s,
    peak RSS <MB> MB (<MB> MB before the simulation)
Peak memory is the process's peak resident set (`resource.getrusage(RUSAGE_SELF).ru_maxrss`),
read after the imports and again after the run: the second figure includes the interpreter and
the imports (numpy, pandas, pydantic), the difference is what the simulation added.
With `--against DIR` (a checkout of another commit, e.g. `git worktree add DIR COMMIT`), each
repeat runs that checkout and this one, alternately, each in a fresh process, and the last line
gives the ratio of their median wall times (this one's over the other's): machine noise hits
both alike. Run from a compiled copy (`python tools/compile_sim.py DIR`, then this script from
DIR), "this" is the compiled simulator.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
EXPERIMENT = "r1-disagg-1p3d"


def _rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def once(duration_s: float, experiment: str = EXPERIMENT) -> tuple[int, float, float, float, float]:
    """One run: (requests, simulated s, wall s, peak RSS MB before it, peak RSS MB after)."""
    from disagg.config import load_experiment
    from disagg.sim.cluster import Sim

    path = ROOT / "experiments" / f"{experiment}.toml"
    exp = load_experiment(path, [f"workload.duration_s={duration_s}"])
    rss0 = _rss_mb()
    start = time.perf_counter()
    sim = Sim(exp)
    sim.run()
    wall = time.perf_counter() - start
    return len(sim.requests), sim.env.now, wall, rss0, _rss_mb()


def in_process(
    code_dir: Path, duration_s: float, experiment: str = EXPERIMENT
) -> tuple[int, float, float]:
    """`once` in a fresh interpreter importing `disagg` from `code_dir`."""
    script = (
        f"import sys, json; sys.path.insert(0, {str(code_dir)!r}); "
        f"sys.path.insert(0, {str(ROOT / 'benchmarks')!r}); import sim_speed; "
        f"print(json.dumps(sim_speed.once({duration_s}, {experiment!r})))"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(f"{code_dir}: {out.stderr[-2000:]}")
    n, sim_s, wall, _, _ = json.loads(out.stdout.strip().splitlines()[-1])
    return n, sim_s, wall


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--duration-s", type=float, default=3600.0)
    ap.add_argument("--experiment", default=EXPERIMENT, help="a name in experiments/")
    ap.add_argument("--against", type=Path, help="another checkout, run alternately with this")
    args = ap.parse_args()
    if not (ROOT / "experiments" / f"{args.experiment}.toml").exists():
        raise SystemExit(f"--experiment {args.experiment}: no experiments/{args.experiment}.toml")
    if args.against is None:
        runs = []
        for i in range(args.repeats):
            n, sim_s, wall, rss0, rss = once(args.duration_s, args.experiment)
            runs.append((wall, n, sim_s, rss0, rss))
            print(
                f"run {i}: {n} requests, {sim_s:.0f} simulated s, {wall:.2f} wall s, "
                f"peak RSS {rss:.0f} MB"
            )
        wall, n, sim_s, rss0, rss = sorted(runs)[len(runs) // 2]  # the median run (odd repeats)
        print(
            f"sim_speed: {n} requests, {sim_s:.0f} simulated s, {wall:.2f} wall s, "
            f"{n / wall:.0f} req/s, peak RSS {rss:.0f} MB ({rss0:.0f} MB before the simulation)"
        )
        return
    walls: dict[str, list[float]] = {"other": [], "this": []}
    for i in range(args.repeats):
        for name, code in (("other", args.against.resolve()), ("this", ROOT)):
            n, sim_s, wall = in_process(code, args.duration_s, args.experiment)
            walls[name].append(wall)
            print(f"run {i} {name}: {n} requests, {sim_s:.0f} simulated s, {wall:.2f} wall s")
    other, this = (statistics.median(walls[k]) for k in ("other", "this"))
    print(f"sim_speed: median wall {this:.2f} s here, {other:.2f} s at {args.against}")
    print(f"sim_speed ratio (this / other): {this / other:.3f}")


if __name__ == "__main__":
    main()

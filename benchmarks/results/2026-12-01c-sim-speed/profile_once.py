"""cProfile of benchmarks/sim_speed.py's once() (one hour of r1-disagg-1p3d), sorted by tottime
and by cumtime.  python benchmarks/results/2026-12-01c-sim-speed/profile_once.py OUT.prof"""

import cProfile
import pstats
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "benchmarks"))
import sim_speed  # noqa: E402

profile = cProfile.Profile()
profile.enable()
print(sim_speed.once(3600.0))
profile.disable()
profile.dump_stats(sys.argv[1])
stats = pstats.Stats(sys.argv[1])
stats.sort_stats("tottime").print_stats(35)
stats.sort_stats("cumtime").print_stats(45)

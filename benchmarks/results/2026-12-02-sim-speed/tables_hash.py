"""A digest of one run's requests, steps and transfers tables (every float to 17 digits), to
compare two checkouts' runs longer than `benchmarks/same_tables.py`'s 10 minutes:

    python benchmarks/results/2026-12-02-sim-speed/tables_hash.py DIR [EXPERIMENT|TOML [DURATION_S]]
"""

import hashlib
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


def main() -> None:
    code_dir = str(Path(sys.argv[1]).resolve())
    name = sys.argv[2] if len(sys.argv) > 2 else "r1-disagg-1p3d"
    duration_s = sys.argv[3] if len(sys.argv) > 3 else "3600"
    sys.path.insert(0, code_dir)
    from disagg.config import load_experiment
    from disagg.core.metrics import requests_table, steps_table, transfers_table
    from disagg.sim.cluster import Sim

    toml = Path(name) if name.endswith(".toml") else ROOT / "experiments" / f"{name}.toml"
    sim = Sim(load_experiment(toml, [f"workload.duration_s={duration_s}"]))
    sim.run()
    digest = hashlib.sha256()
    for table in (requests_table(sim.requests.values()), steps_table(sim.rec)):
        digest.update(table.to_csv(float_format="%.17g").encode())
    digest.update(transfers_table(sim.rec).to_csv(float_format="%.17g").encode())
    print(f"{code_dir} {toml.stem} {duration_s} s: {digest.hexdigest()[:16]}")


if __name__ == "__main__":
    main()

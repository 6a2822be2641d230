"""Are the article experiments' tables the same at another commit? Simulates each experiment
with this checkout and with another (e.g. `git worktree add DIR COMMIT`), each in a fresh
process, and compares the requests, steps and transfers tables value for value.

    python benchmarks/same_tables.py --against DIR [--experiments r1-colocated,...]

Prints one line per table and exits 1 if any differs: a change meant to keep behaviour keeps
every table bit for bit.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pandas as pd

ROOT = Path(__file__).resolve().parent.parent
EXPERIMENTS = "r1-colocated,r1-disagg-1p3d,r1-disagg-dp8,qwen3coder-disagg-1p3d"
TABLES = ("requests", "steps", "transfers")


def simulate(code_dir: Path, experiment: str, out: Path) -> None:
    """`disagg sim run` of `experiment` with the `disagg` of `code_dir`, into `out`."""
    cmd = [sys.executable, "-m", "disagg.cli", "sim", "run", f"experiments/{experiment}.toml"]
    done = subprocess.run(
        [*cmd, "--out", str(out), "--quiet"],
        cwd=code_dir,
        env=os.environ | {"PYTHONPATH": str(code_dir)},
        capture_output=True,
        text=True,
    )
    if not (out / "requests.parquet").exists():
        raise SystemExit(f"{code_dir}: {experiment}: {done.stdout[-1000:]}{done.stderr[-1000:]}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--against", type=Path, required=True, help="another checkout")
    ap.add_argument("--experiments", default=EXPERIMENTS, help="comma-separated names")
    args = ap.parse_args()
    differ = 0
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.experiments.split(","):
            here, there = Path(tmp) / "here" / name, Path(tmp) / "there" / name
            simulate(ROOT, name, here)
            simulate(args.against.resolve(), name, there)
            for table in TABLES:
                a = pd.read_parquet(here / f"{table}.parquet")
                b = pd.read_parquet(there / f"{table}.parquet")
                same = list(a.columns) == list(b.columns) and a.equals(b)
                differ += not same
                print(f"{name} {table}: {len(a)} rows, {'identical' if same else 'DIFFERENT'}")
    print(f"same_tables: {differ} of the tables differ")
    raise SystemExit(1 if differ else 0)


if __name__ == "__main__":
    main()

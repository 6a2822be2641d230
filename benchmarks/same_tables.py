"""Are the article experiments' tables the same at another commit? Simulates each experiment
with this checkout and with another (e.g. `git worktree add DIR COMMIT`), each in a fresh
process, and compares the requests, steps and transfers tables value for value.

    python benchmarks/same_tables.py --against DIR [--experiments r1-colocated,...]
    python benchmarks/same_tables.py --against DIR --summary-tol 0.01 --twice

Prints one line per table and exits 1 if any differs: a change meant to keep behaviour keeps
every table bit for bit (a column this checkout adds is not compared). With `--summary-tol F`
(a change that may reorder events at exact time ties) the tables may differ, but each summary
figure of FIGURES must be within a fraction F of the other checkout's (one line per figure:
here, there, relative change), else exit 1.
With `--twice` this checkout runs each experiment a second time, and the two runs' tables must
be the same bit for bit (determinism), else exit 1.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pandas as pd

ROOT = Path(__file__).resolve().parent.parent
EXPERIMENTS = "r1-colocated,r1-disagg-1p3d,r1-disagg-dp8,qwen3coder-disagg-1p3d"
TABLES = ("requests", "steps", "transfers")
# summary.json figures compared under --summary-tol: TTFT, TPOT, inter-token, throughput, KV
FIGURES = (
    "ttft_s_p50",
    "ttft_s_p99",
    "tpot_s_p50",
    "tpot_s_p99",
    "itl_s_p50",
    "itl_s_p99",
    "itl_s_p999",
    "output_tps_per_gpu",
    "transfer_bytes_per_request",
)


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


def same(a_dir: Path, b_dir: Path) -> dict[str, tuple[int, bool]]:
    """Per table: rows of the first, and whether the two runs' tables are equal in the
    columns the second has (a checkout that adds columns keeps the others' values), which
    the first must all have."""
    out = {}
    for table in TABLES:
        a = pd.read_parquet(a_dir / f"{table}.parquet")
        b = pd.read_parquet(b_dir / f"{table}.parquet")
        shared = set(b.columns) <= set(a.columns)
        out[table] = (len(a), shared and a[list(b.columns)].equals(b))
    return out


def figures(run_dir: Path) -> dict[str, float]:
    raw = json.loads((run_dir / "summary.json").read_text())
    return {k: float(raw[k]) for k in FIGURES if raw.get(k) is not None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--against", type=Path, required=True, help="another checkout")
    ap.add_argument("--experiments", default=EXPERIMENTS, help="comma-separated names")
    ap.add_argument("--summary-tol", type=float, help="compare summaries, not tables")
    ap.add_argument("--twice", action="store_true", help="also check determinism here")
    args = ap.parse_args()
    bad = 0
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.experiments.split(","):
            here, there = Path(tmp) / "here" / name, Path(tmp) / "there" / name
            simulate(ROOT, name, here)
            simulate(args.against.resolve(), name, there)
            for table, (rows, equal) in same(here, there).items():
                bad += not equal and args.summary_tol is None
                print(f"{name} {table}: {rows} rows, {'identical' if equal else 'DIFFERENT'}")
            if args.twice:
                again = Path(tmp) / "again" / name
                simulate(ROOT, name, again)
                for table, (_, equal) in same(here, again).items():
                    bad += not equal
                    verdict = "identical" if equal else "DIFFERENT (not deterministic)"
                    print(f"{name} {table}, run twice here: {verdict}")
            if args.summary_tol is not None:
                a, b = figures(here), figures(there)
                for k in FIGURES:
                    if k not in a or k not in b:
                        continue
                    rel = (a[k] - b[k]) / b[k] if b[k] else float(a[k] != b[k])
                    over = abs(rel) > args.summary_tol
                    bad += over
                    flag = "  OVER" if over else ""
                    print(f"{name} {k}: {a[k]:.6g} here, {b[k]:.6g} there, {rel:+.4%}{flag}")
    print(f"same_tables: {bad} checks failed")
    raise SystemExit(1 if bad else 0)


if __name__ == "__main__":
    main()

"""The pace of a decode pass wholly inside a chunk pass of another node on one shared GPU, by
the chunk pass's time alone and the decode pass's batch: its time alone (the profile at its
shape) over its full time, median per group. The README's table.

    python beside_chunk_pace.py VALIDATE_DIR RUN [RUN ...]

VALIDATE_DIR holds a validate with its replays (`disagg validate --replay`); each RUN is a
directory under it, e.g. hw/disagg-2.83rps or calibration/disagg-9.61rps.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pandas as pd

from disagg.config import load_experiment
from disagg.validate_passes import shape_device

CHUNK_MS = [0, 15, 25, 35, 50]  # bins of the chunk pass's time alone
BATCH = [0, 4, 16, 64]  # and of the decode pass's batch


def paces(run: Path, exp_dir: Path) -> pd.DataFrame:
    """Per decode pass inside exactly one chunk pass: that chunk's time alone (ms), the decode
    pass's batch, and its pace (time alone over full time)."""
    steps = pd.read_parquet(run / "steps.parquet")
    steps["alone"] = shape_device(steps, load_experiment(exp_dir))
    steps["end_s"] = steps.start_s + steps.duration_s
    chunks = steps[steps.prefill_tokens > 0]
    rows = []
    for d in steps[steps.prefill_tokens == 0].itertuples():
        inside = chunks[(chunks.start_s <= d.start_s) & (chunks.end_s >= d.end_s)]
        if len(inside) == 1:
            chunk_ms = float(inside.alone.iloc[0]) * 1e3
            rows.append((chunk_ms, d.decode_seqs, d.alone / d.duration_s))
    return pd.DataFrame(rows, columns=["chunk_ms", "batch", "pace"])


def main(validate: Path, runs: list[str]) -> None:
    # the cost model of the disaggregated replays (their decode server's scales)
    any_replay = sorted((validate / "sim-profile").glob("disagg-*"))[0]
    for name in runs:
        p = paces(validate / name, any_replay)
        groups = [pd.cut(p.chunk_ms, CHUNK_MS), pd.cut(p.batch, BATCH)]
        table = p.groupby(groups, observed=True).pace.agg(["size", "median"]).round(3)
        print(f"{name}\n{table.to_string()}\n")


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2:])

"""A colocated server's chunk passes against the profile at their own shape, by the time since
its last pass with a prompt chunk ended, apart for chunks after cached tokens of their prompt
(a long prompt's later chunks, which always come right after the one before).

    python chunk_since.py VALIDATE_DIR [--out FILE.md]

VALIDATE_DIR is a validate's directory with its replays (`disagg validate --replay`): the
colocated calibration runs and hw runs, each pass's device time over what the profile gives
its shape (`shape_device`, without the chunk offsets), medians per range of the time since.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pandas as pd

from disagg.config import load_experiment
from disagg.validate_passes import shape_device, since_chunk

sys.path.insert(0, str(Path(__file__).parent.parent / "2026-12-05k-gpu"))
from host_by_run import report  # the 12-05k records' command line

EDGES_MS = [-1, 1, 5, 10, 20, 50, 100, 200, 1e9]


def chunk_passes(validate: Path) -> pd.DataFrame:
    """The colocated chunk passes of a validate's calibration and hw runs, each with its
    `ratio` (device time over the profile's at its shape) and `since` (s)."""
    exp = load_experiment(next((validate / "sim-profile").glob("colocated-*")))
    runs = [d for d in sorted((validate / "calibration").glob("*rps*")) if d.name[0].isdigit()]
    runs += sorted(validate.glob("hw*/colocated-*"))
    passes = []
    for run in runs:
        steps = pd.read_parquet(run / "steps.parquet")
        steps = steps.assign(shaped=shape_device(steps, exp), since=since_chunk(steps))
        passes.append(steps[steps.prefill_tokens > 0])
    c = pd.concat(passes, ignore_index=True)
    return c.assign(ratio=c.device_s / c.shaped)


def rows(validate: Path) -> list[dict]:
    c = chunk_passes(validate)
    tokens = c.prefill_tokens
    c["cached"] = c.prefill_attn_pairs > tokens * (tokens + 1) / 2
    c["since"] = pd.cut(c.since * 1e3, EDGES_MS)
    out = []
    for (cached, since), g in c.groupby(["cached", "since"], observed=True):
        row = {"chunk": "after cached tokens" if cached else "first of its prompt"}
        row |= {"since the last chunk pass (ms)": str(since), "passes": len(g)}
        out.append(row | {"device / profile": round(float(g.ratio.median()), 3)})
    return out


if __name__ == "__main__":
    report(rows, __doc__)

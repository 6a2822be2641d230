"""Decode-only passes of a validate's colocated runs: their device time over the profile's at
their shape (`shape_device`), by how many passes ago the node last ran a pass with a prompt
chunk, for 16 sequences or fewer and for more (median, and passes). From the repo's root:

    python benchmarks/results/2026-12-05h-gpu/after_chunk.py DIR colocated-10.7rps ...

DIR: a validate directory replayed by this checkout (`disagg validate --replay --out DIR`),
e.g. this folder's h200-pieces/runs.tar.xz unpacked.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pandas as pd

from disagg.config import load_experiment
from disagg.validate_passes import shape_device

SINCE = [0, 1, 2, 4, 8, 1000]  # passes since the last one with a chunk: 1, 2, 3-4, 5-8, more


def since_chunk(steps: pd.DataFrame) -> pd.Series:
    """Per pass (in start order), passes since the node's last one with a prompt chunk."""
    out, k = [], len(steps)
    for tokens in steps.prefill_tokens:
        k = 0 if tokens > 0 else k + 1
        out.append(k)
    return pd.Series(out, index=steps.index)


def main() -> None:
    out = Path(sys.argv[1])
    for run in sys.argv[2:]:
        steps = pd.read_parquet(out / "hw" / run / "steps.parquet").sort_values("start_s")
        steps["shape_s"] = shape_device(steps, load_experiment(out / "sim-profile" / run))
        steps["since"] = since_chunk(steps)
        d = steps[(steps.prefill_tokens == 0) & steps.device_s.notna()]
        ratio = (d.device_s / d.shape_s).rename("ratio")
        bins = pd.cut(d.since, SINCE)
        for name, pick in (("<= 16", d.decode_seqs <= 16), ("> 16", d.decode_seqs > 16)):
            g = ratio[pick].groupby(bins[pick], observed=True).agg(["median", "size"])
            cells = ", ".join(f"{b}: {m:.3f} ({int(n)})" for b, (m, n) in g.iterrows())
            print(f"{run}, {name} sequences: {cells}")


if __name__ == "__main__":
    main()

"""A colocated server's chunk passes against the profile at their own shape (as
chunk_since.py), by the decodes beside the chunk: those right after another chunk pass (within
1 ms) apart from those after a gap (20 ms or more).

    python chunk_by_decodes.py VALIDATE_DIR [--out FILE.md]
"""

from __future__ import annotations

import sys
from pathlib import Path

import pandas as pd
from chunk_since import chunk_passes  # this directory's

sys.path.insert(0, str(Path(__file__).parent.parent / "2026-12-05k-gpu"))
from host_by_run import report  # the 12-05k records' command line

EDGES = [0, 4, 8, 16, 32, 64, 256]


def rows(validate: Path) -> list[dict]:
    c = chunk_passes(validate)
    kinds = {"right after a chunk pass": c.since < 1e-3, "after a gap": c.since >= 0.02}
    out = []
    for kind, pick in kinds.items():
        g = c[pick]
        for decodes, h in g.groupby(pd.cut(g.batch_size, EDGES), observed=True):
            row = {"chunk pass": kind, "decodes beside it": str(decodes), "passes": len(h)}
            out.append(row | {"device / profile": round(float(h.ratio.median()), 3)})
    return out


if __name__ == "__main__":
    report(rows, __doc__)

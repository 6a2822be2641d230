"""How much a chunk pass on one shared GPU slows the decode passes beside it, by the size it
ran at: each decode pass that began and ended inside a chunk pass, its length over the
decode-alone line (a least-squares line over batch size through the decode passes that met no
chunk pass), median by that chunk pass's tokens, hw runs against the profile replay.

    python beside_chunk.py VALIDATE_DIR [--out FILE.md]

VALIDATE_DIR is a validate's directory with its replays (`disagg validate --replay`): its hw
runs under hw*/ and the profile replays under sim-profile/. In pieces (hw.latency.
prefill_graphs = [256, 512, 1024, 2048]) a chunk of 1,025-2,048 tokens runs as 2,048.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pandas as pd

sys.path.insert(0, str(Path(__file__).parent.parent / "2026-12-05k-gpu"))
from host_by_run import report  # the 12-05k records' command line

EDGES = [0, 512, 1024, 1600, 2048]


def slowdowns(run: Path) -> pd.Series:
    """Per decode pass inside a chunk pass: its length over the decode-alone line, indexed by
    that chunk pass's tokens."""
    s = pd.read_parquet(run / "steps.parquet")
    s = s.assign(end=s.start_s + s.duration_s)
    d, p = s[s.kind == "decode"], s[s.kind == "prefill"]
    a, b = d.start_s.to_numpy(), d.end.to_numpy()
    inside = np.zeros(len(d))
    met = np.zeros(len(d), bool)
    for start, end, tokens in zip(p.start_s, p.end, p.prefill_tokens, strict=True):
        inside[(a >= start) & (b <= end)] = tokens
        met |= (a < end) & (b > start)
    line = np.polyfit(d.batch_size[~met], d.duration_s[~met], 1)
    ratio = d.duration_s.to_numpy() / np.polyval(line, d.batch_size.to_numpy())
    return pd.Series(ratio[inside > 0], index=inside[inside > 0])


def rows(validate: Path) -> list[dict]:
    out = []
    for source in [*sorted(validate.glob("hw*")), validate / "sim-profile"]:
        for run in sorted(source.glob("disagg-*")):
            r = slowdowns(run)
            row = {"run": run.name, "from": source.name}
            for tokens, g in r.groupby(pd.cut(r.index, EDGES), observed=True):
                row[f"chunk {tokens}"] = round(float(g.median()), 2)
            out.append(row)
    return out


if __name__ == "__main__":
    report(rows, __doc__)

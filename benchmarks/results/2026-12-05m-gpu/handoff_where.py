"""Where a disaggregated request's KV waits on one shared GPU, in its hw runs: from its
prefill's end to its last immediate at the decoder's wire (`to_decoder`, the `landed` stamp)
and on until the decoder's loop took it (`until_taken`); and, by the decoder's passes, which
one the KV was taken after: the pass in flight at the prefill's end ("in flight"), or the
first, second, ... pass the decoder began after it.

    python handoff_where.py VALIDATE_DIR [--out FILE.md]

VALIDATE_DIR is a validate's directory: its hw runs under hw*/ and, with `--replay`, its
profile replays under sim-profile/ (a replay and a hw run without `landed` stamps,
before 2026-12-05l, show only the pass). Times in ms, median (p90).
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pandas as pd

sys.path.insert(0, str(Path(__file__).parent.parent / "2026-12-05k-gpu"))
from host_by_run import report  # the 12-05k records' command line


def taken_after(run: Path) -> pd.DataFrame:
    """Per request: to_decoder, until_taken (s) and the decoder's pass it was taken after (0:
    the one in flight at its prefill's end; k: the k-th begun after it; -1: none was)."""
    r = pd.read_parquet(run / "requests.parquet").set_index("request_id")
    landed = pd.Series(np.nan, r.index)  # a replay keeps no hops table
    if (run / "hops.parquet").exists():
        hops = pd.read_parquet(run / "hops.parquet")
        landed = hops[hops.event == "landed"].groupby("request_id").t_s.min().reindex(r.index)
    steps = pd.read_parquet(run / "steps.parquet")
    out = []
    for rid, q in r.iterrows():
        d = steps[steps.node == f"decode{int(q.decode_node)}"]
        ends = (d.start_s + d.duration_s).to_numpy()
        starts = d.start_s.to_numpy()
        # the pass whose end is the last at or before ready: the one the KV was taken after
        done = np.flatnonzero(ends <= q.ready_s + 1e-6)
        if not len(done) or not np.isfinite(q.ready_s):
            out.append((rid, np.nan, np.nan, -1))
            continue
        i = done[-1]
        after = int(np.sum(starts[: i + 1] >= q.prefill_end_s))  # 0: in flight at the end
        out.append((rid, landed[rid] - q.prefill_end_s, q.ready_s - landed[rid], after))
    return pd.DataFrame(out, columns=["request_id", "to_decoder", "until_taken", "after"])


def ms(col: pd.Series) -> str:
    col = col.dropna() * 1e3
    return "-" if col.empty else f"{col.median():.2f} ({col.quantile(0.9):.2f})"


def rows(validate: Path) -> list[dict]:
    out = []
    for source in [*sorted(validate.glob("hw*")), validate / "sim-profile"]:
        for run in sorted(source.glob("disagg-*")):
            t = taken_after(run)
            row = {"run": run.name, "from": source.name, "requests": len(t)}
            row |= {"to decoder": ms(t.to_decoder), "until taken": ms(t.until_taken)}
            share = t.after.value_counts(normalize=True)
            for k, name in [(0, "in flight"), (1, "first"), (2, "second")]:
                row[f"taken after: {name}"] = f"{share.get(k, 0.0):.0%}"
            row["later"] = f"{share[share.index > 2].sum():.0%}"
            out.append(row)
    return out


if __name__ == "__main__":
    report(rows, __doc__)

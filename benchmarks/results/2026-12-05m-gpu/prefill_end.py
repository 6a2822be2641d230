"""What the decode server is doing when a request's prefill ends on one shared GPU: the decode
pass end nearest the request's prefill end (ms after it, median, and the share within 1 ms
either side) and the request's handoff (its prefill end to its KV ready at the decoder,
median), hw runs against the profile replay.

    python prefill_end.py VALIDATE_DIR [--out FILE.md]

VALIDATE_DIR is a validate's directory with its replays (`disagg validate --replay`): its hw
runs under hw*/ and the profile replays under sim-profile/.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pandas as pd

sys.path.insert(0, str(Path(__file__).parent.parent / "2026-12-05k-gpu"))
from host_by_run import report  # the 12-05k records' command line


def rows(validate: Path) -> list[dict]:
    out = []
    for source in [*sorted(validate.glob("hw*")), validate / "sim-profile"]:
        for run in sorted(source.glob("disagg-*")):
            s = pd.read_parquet(run / "steps.parquet")
            ends = np.sort((s.start_s + s.duration_s)[s.kind == "decode"].to_numpy())
            r = pd.read_parquet(run / "requests.parquet")
            i = np.clip(np.searchsorted(ends, r.prefill_end_s), 1, len(ends) - 1)
            after, before = ends[i] - r.prefill_end_s, ends[i - 1] - r.prefill_end_s
            near = np.where(after.abs() < before.abs(), after, before) * 1e3
            handoff = (r.ready_s - r.prefill_end_s) * 1e3
            out.append(
                {
                    "run": run.name,
                    "from": source.name,
                    "nearest decode end (ms)": round(float(np.median(near)), 2),
                    "within 1 ms": f"{np.mean(np.abs(near) < 1):.0%}",
                    "handoff (ms)": round(float(handoff.median()), 2),
                }
            )
    return out


if __name__ == "__main__":
    report(rows, __doc__)

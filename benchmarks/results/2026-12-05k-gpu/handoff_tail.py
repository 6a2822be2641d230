"""A disaggregated request's last steps on one shared GPU, hw against its profile replay: from
its prefill's end to its KV ready at the decoder, and on to its first token; and, at each
prefill pass's end, how long the decode pass then in flight still ran.

    python handoff_tail.py VALIDATE_DIR [--out FILE.md]

VALIDATE_DIR is a validate's directory with its replays (`disagg validate --replay`): its hw
runs under hw*/ and the profile replays under sim-profile/. Times in ms, medians (p90).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
from host_by_run import report  # this directory's


def request_parts(run: Path) -> pd.DataFrame:
    r = pd.read_parquet(run / "requests.parquet")
    return (
        pd.DataFrame(
            {
                "prefill end to KV ready": r.ready_s - r.prefill_end_s,
                "KV ready to first token": r.first_token_s - r.ready_s,
            }
        )
        * 1e3
    )


def left_at_prefill_ends(run: Path) -> np.ndarray:
    """Per prefill pass with a decode pass in flight at its end: how long that one still ran."""
    s = pd.read_parquet(run / "steps.parquet")
    dec = s[s.node.str.startswith("decode")].sort_values("start_s")
    pre = s[s.node.str.startswith("prefill")]
    starts, ends = dec.start_s.to_numpy(), (dec.start_s + dec.duration_s).to_numpy()
    pe = (pre.start_s + pre.duration_s).to_numpy()
    i = np.searchsorted(starts, pe, side="right") - 1
    live = (i >= 0) & (ends[np.maximum(i, 0)] > pe)
    return (ends[i[live]] - pe[live]) * 1e3


def rows(validate: Path) -> list[dict]:
    out = []
    for run in sorted((validate / "sim-profile").glob("disagg-*")):
        for source in [*sorted(validate.glob("hw*")), validate / "sim-profile"]:
            where = source / run.name
            if not (where / "requests.parquet").exists():
                continue
            parts, left = request_parts(where), left_at_prefill_ends(where)
            row = {"run": run.name, "from": source.name}
            for name, col in parts.items():
                row[name] = f"{col.median():.2f} ({col.quantile(0.9):.2f})"
            row["decode pass left at a prefill end"] = (
                f"{np.median(left):.2f} ({np.percentile(left, 90):.2f})"
            )
            row["of them, under 1 ms"] = f"{(left < 1).mean():.0%}"
            out.append(row)
    return out


if __name__ == "__main__":
    report(rows, __doc__)

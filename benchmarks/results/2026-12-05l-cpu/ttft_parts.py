"""Where a validate's TTFT goes, hw runs against the profile replay: per run and source, the
median (mean) ms of each request's parts: queue (arrival to its prefill's first pass),
prefill (that pass's start to the last one's end), handoff (the prefill's end to the KV
ready at the decoder) and first (ready to the first token), and TTFT.

    python ttft_parts.py VALIDATE_DIR [--out FILE.md]

VALIDATE_DIR is a validate's directory with its replays (`disagg validate --replay`): its hw
runs under hw*/ and the profile replays under sim-profile/. A colocated run has no handoff.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pandas as pd

sys.path.insert(0, str(Path(__file__).parent.parent / "2026-12-05k-gpu"))
from host_by_run import report  # the 12-05k records' command line


def parts(requests: pd.DataFrame) -> pd.DataFrame:
    r = requests
    return (
        pd.DataFrame(
            {
                "queue": r.prefill_start_s - r.arrival_s,
                "prefill": r.prefill_end_s - r.prefill_start_s,
                "handoff": r.ready_s - r.prefill_end_s,
                "first": r.first_token_s - r.ready_s,
                "TTFT": r.ttft_s,
            }
        )
        * 1e3
    )


def rows(validate: Path) -> list[dict]:
    out = []
    for run in sorted((validate / "sim-profile").glob("*rps")):
        for source in [*sorted(validate.glob("hw*")), validate / "sim-profile"]:
            where = source / run.name / "requests.parquet"
            if not where.exists():
                continue
            row = {"run": run.name, "from": source.name}
            for name, col in parts(pd.read_parquet(where)).items():
                row[name] = "-" if col.isna().all() else f"{col.median():.1f} ({col.mean():.1f})"
            out.append(row)
    return out


if __name__ == "__main__":
    report(rows, __doc__)

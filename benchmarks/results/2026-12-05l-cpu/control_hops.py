"""The control plane's hop that `disagg validate` measures on each validate's calibration runs
(`disagg.validate.control_hop`), and the same measure on each validation run: the time from a
request's message being sent (by the driver, or by a decoder handing it on to its prefill
server) to its server taking it, over the messages that reached a server between its passes.

    python control_hops.py VALIDATE_DIR... [--out FILE.md]

Per directory: the calibration's hop (ms) and how many messages, then per hw run the median
(p90) and count. The validate directories are those of the committed archives, extracted
(`2026-12-05g-cpu/replay_all.sh` extracts them to /tmp/rep/src).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import pandas as pd

from disagg.validate import calibration_runs, control_hop
from disagg.validate_passes import idle_hops


def rows(validate: Path) -> list[dict]:
    name = "/".join(validate.parts[-2:])  # its archive's folder and its own
    shared, alone = calibration_runs(validate / "calibration")
    hop = control_hop([*alone, *shared])
    out = [
        {
            "validate": name,
            "run": "calibration (the replays' hop)",
            "hop ms": "-" if hop is None else f"{hop[0] * 1e3:.3f}",
            "messages": 0 if hop is None else hop[1],
        }
    ]
    for run in sorted(validate.glob("hw*/*")):
        if not (run / "hops.parquet").exists():
            continue
        hops = idle_hops(
            pd.read_parquet(run / "hops.parquet"), pd.read_parquet(run / "steps.parquet")
        )
        said = (
            "-"
            if not len(hops)
            else f"{np.median(hops) * 1e3:.3f} ({np.percentile(hops, 90) * 1e3:.3f})"
        )
        out.append(
            {
                "validate": name,
                "run": f"{run.parent.name}/{run.name}",
                "hop ms": said,
                "messages": len(hops),
            }
        )
    return out


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("validates", type=Path, nargs="+")
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    table = pd.DataFrame([row for v in a.validates for row in rows(v)])
    print(table.to_string(index=False))
    if a.out:
        a.out.write_text(f"{__doc__.splitlines()[0]}\n\n{table.to_markdown(index=False)}\n")

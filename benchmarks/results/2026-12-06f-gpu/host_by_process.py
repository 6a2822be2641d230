"""Each server process's host time per pass, fitted on its run alone (`loop_costs`, as
validate fits the calibration's; a run on a shared GPU on the passes that met no other
node's): fixed, per sequence, and both at ten sequences.

    python host_by_process.py RUN [RUN ...]

Each RUN is a hw run's directory, e.g. calibration/8.27rps-2 or hw-2/colocated-8.27rps.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pandas as pd

from disagg.validate import loop_costs, shares_gpu


def main(runs: list[Path]) -> None:
    for run in runs:
        c = loop_costs([pd.read_parquet(run / "steps.parquet")], alone=shares_gpu(run))
        fixed, per_seq = c["profile_host_s"] * 1e3, c["profile_host_per_seq_s"] * 1e3
        name = "/".join(run.parts[-2:])
        at_ten = fixed + 10 * per_seq
        print(f"{name:32s} {fixed:.3f} ms + {per_seq:.4f} ms a sequence: {at_ten:.3f}")


if __name__ == "__main__":
    main([Path(a) for a in sys.argv[1:]])

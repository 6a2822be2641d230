"""A pass with a chunk: its loop time on each colocated server process, against the line the
validate's loop calibration runs fit (`loop_costs`: the mixed pass's fixed part plus its part
per decode beside the chunk).

    python benchmarks/results/2026-12-07b-gpu/chunk_host.py VALIDATE_DIR...

VALIDATE_DIR: an unpacked validate (`runs.tar.xz`). One row per server process: the hardware's
runs (`hw`, `hw-2`) and the calibration runs, each with the median decodes beside a chunk, the
median loop time (ms) and the median of loop time over the line's.
"""

import sys
from pathlib import Path

import pandas as pd

from disagg.validate import busy_passes, loop_costs

RUNS = ("hw", "hw-", "cal")  # the hardware's runs (hw, hw-2, ...) and the calibration runs


def process_rows(validate: Path) -> pd.DataFrame:
    dirs = sorted(validate.glob("*/*rps*"))
    runs = {p: pd.read_parquet(p / "steps.parquet") for p in dirs if p.parent.name[:3] in RUNS}
    colocated = {p: steps for p, steps in runs.items() if "disagg" not in p.name}
    costs = loop_costs([s for p, s in colocated.items() if p.parent.name == "calibration"])
    rows = []
    for path, steps in colocated.items():
        passes = busy_passes(steps)
        chunk = passes[passes.prefill_tokens > 0]
        per_decode = costs["profile_host_mixed_per_seq_s"]
        line = costs["profile_host_mixed_s"] + per_decode * chunk.decode_seqs
        rows.append(
            {
                "validate": validate.parent.name,
                "process": f"{path.parent.name}/{path.name}",
                "decodes": chunk.decode_seqs.median(),
                "loop_ms": 1e3 * chunk.loop_s.median(),
                "line_ms": 1e3 * line.median(),
                "loop/line": (chunk.loop_s / line).median(),
            }
        )
    return pd.DataFrame(rows)


if __name__ == "__main__":
    table = pd.concat([process_rows(Path(arg)) for arg in sys.argv[1:]])
    print(table.round(3).to_markdown(index=False))

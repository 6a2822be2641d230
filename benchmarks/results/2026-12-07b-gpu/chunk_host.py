"""A pass with a chunk: its loop time on each colocated server process, against the line the
validate's loop calibration runs fit (`repeat_loop_costs`, as `disagg validate` fits it: the
mixed pass's fixed part plus its part per decode beside the chunk).

    python benchmarks/results/2026-12-07b-gpu/chunk_host.py VALIDATE_DIR...

VALIDATE_DIR: an unpacked validate (`runs.tar.xz`). One row per server process: the hardware's
runs (`hw`, `hw-2`) and the calibration runs, each with the median decodes beside a chunk, the
median loop time (ms) and the median of loop time over the line's.
"""

import sys
from pathlib import Path

import pandas as pd

from disagg.validate import busy_passes, by_repeat, calibration_runs, repeat_loop_costs


def process_rows(validate: Path) -> pd.DataFrame:
    calibration = calibration_runs(validate / "calibration")[1]  # its colocated runs
    costs = repeat_loop_costs(by_repeat(calibration))
    fixed, per_decode = costs["profile_host_mixed_s"], costs["profile_host_mixed_per_seq_s"]
    rows = []
    for path in [*sorted(validate.glob("hw*/colocated-*")), *calibration]:
        passes = busy_passes(pd.read_parquet(path / "steps.parquet"))
        chunk = passes[passes.prefill_tokens > 0]
        line = fixed + per_decode * chunk.decode_seqs
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

"""A disaggregated decode server's passes that met no prefill pass, of 16 sequences or fewer,
their device time over the profile's at their shape (no decode scale), by the time since the
other server's last prefill pass on the shared GPU ended: whether the lift a colocated server's
decode passes show after its own chunk pass (after_chunk_time.py) is the card's. From the repo's
root, on the 12-05j validate replayed by this checkout:

    python benchmarks/results/2026-12-05i-cpu/decode_after_prefill.py DIR
"""

from __future__ import annotations

import sys
from pathlib import Path

import pandas as pd

from disagg.config import load_experiment
from disagg.share import free_decodes
from disagg.validate_passes import shape_device

EDGES_MS = [0, 10, 20, 40, 80, 200, 10**9]


def main() -> None:
    out = Path(sys.argv[1])
    exp = load_experiment(
        sorted((out / "sim-profile").glob("disagg-*"))[0], ["cost.profile_decode_scale=1.0"]
    )
    rows = []
    for run in sorted(out.glob("hw*/disagg-*")):
        steps = pd.read_parquet(run / "steps.parquet").sort_values("start_s")
        ends = (steps.start_s + steps.duration_s).where(steps.prefill_tokens > 0)
        since = (steps.start_s - ends.cummax().ffill().shift(1)) * 1e3
        free = free_decodes(steps.assign(since_ms=since, shaped=shape_device(steps, exp)))
        free = free[free.batch_size <= 16]
        rows.append(
            free.assign(ratio=free.device_s / free.shaped, run=run.parent.name + "/" + run.name)
        )
    df = pd.concat(rows)
    df["since"] = pd.cut(df.since_ms, EDGES_MS, right=False)
    pd.set_option("display.width", 200)
    pd.set_option("display.max_columns", 20)
    print(df.groupby(["run", "since"], observed=True).ratio.median().unstack().round(3))
    print(df.groupby(["run", "since"], observed=True).ratio.size().unstack())


if __name__ == "__main__":
    main()

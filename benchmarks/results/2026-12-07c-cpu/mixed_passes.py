"""Passes with a prompt chunk on colocated servers: the profile's device time at each pass's
shape (`shape_device`, without the serving runs' chunk offsets) over the time it ran, the
median by the decodes beside the chunk and by its tokens (and the passes of each row).

    python benchmarks/results/2026-12-07c-cpu/mixed_passes.py VALIDATE_DIR...

VALIDATE_DIR: an unpacked validate (`runs.tar.xz`); every colocated run of the hardware and of
the loop calibration counts, each costed on its validate's own profile.
"""

import sys
from pathlib import Path

import pandas as pd

from disagg.validate import load_experiment
from disagg.validate_passes import shape_device

TOKENS = [0, 600, 1100, 1800, 2600, 5000]
DECODES = [-1, 0, 5, 11, 20, 30, 40, 60, 130]


def chunk_passes(validate: Path) -> pd.DataFrame:
    csv = validate / "profile.csv"
    runs = [*sorted(validate.glob("hw*/colocated-*")), *sorted(validate.glob("calibration/*rps*"))]
    runs = [run for run in runs if not run.name.startswith("disagg")]
    tables = []
    for run in runs:
        exp = load_experiment(run, [f"cost.source=profile:{csv}"])
        steps = pd.read_parquet(run / "steps.parquet")
        chunks = steps[(steps.prefill_tokens > 0) & steps.device_s.notna()]
        tables.append(chunks.assign(ratio=shape_device(chunks, exp) / chunks.device_s))
    return pd.concat(tables)


def labels(breaks: list[int]) -> list[str]:
    return [str(i) for i in pd.IntervalIndex.from_breaks(breaks)]


if __name__ == "__main__":
    passes = pd.concat([chunk_passes(Path(arg)) for arg in sys.argv[1:]])
    tokens = pd.cut(passes.prefill_tokens, TOKENS).astype(str)
    decodes = pd.cut(passes.decode_seqs, DECODES).astype(str).rename("decodes \\ chunk tokens")
    table = passes.groupby([decodes, tokens]).ratio.median().unstack()
    table = table.reindex(index=labels(DECODES), columns=labels(TOKENS)).dropna(how="all")
    table["passes"] = passes.groupby(decodes).size()
    print(table.round(3).to_markdown())

"""The queue's growth through each hardware run of committed validates: the mean queue
(arrival to the first prefill pass) of the last quarter of a run's requests to arrive over the
first quarter's (`disagg.fidelity.queue_growth`), the mean over the runs of each cell (hw,
hw-2, ...), and the calibration's disaggregated run at the top load.

    python queue_growth.py RUNS_TAR_XZ...   # from the repository root, e.g.
    python benchmarks/results/2026-12-08b-cpu/queue_growth.py \\
        benchmarks/results/2026-12-0*-gpu/*/runs.tar.xz
"""

import sys
import tarfile
import tempfile
from pathlib import Path

import pandas as pd

from disagg.fidelity import queue_growth

if len(sys.argv) < 2:
    sys.exit(__doc__)
rows = []
for archive in map(Path, sys.argv[1:]):
    with tempfile.TemporaryDirectory() as tmp:
        with tarfile.open(archive) as tar:
            tar.extractall(tmp, filter="data")
        for requests in sorted(Path(tmp).glob("*/*/*/requests.parquet")):
            run, side = requests.parent.name, requests.parent.parent.name
            if side.startswith("hw") or (side == "calibration" and run.startswith("disagg-")):
                growth = queue_growth(pd.read_parquet(requests))
                rows.append(
                    (archive.parent.parent.name[:11], archive.parent.name, side, run, growth)
                )
table = pd.DataFrame(rows, columns=["validate", "model", "side", "run", "growth"])
table["mode"] = table.run.str.split("-").str[0]
table["rate"] = table.run.str.extract(r"-([\d.]+)rps")[0].astype(float)
hw = table[table.side.str.startswith("hw")].copy()
rank = hw.groupby(["validate", "model", "mode"]).rate.rank(method="dense").astype(int)
hw["column"] = hw["mode"] + " " + rank.map({1: "light", 2: "middle", 3: "top"})
wide = hw.pivot_table(index=["validate", "model"], columns="column", values="growth")
cal = table[table.side == "calibration"]  # the top of its disaggregated runs
top = cal.loc[cal.groupby(["validate", "model"]).rate.idxmax()].set_index(["validate", "model"])
wide["disagg top, calibration"] = top.growth
print(wide.round(2).to_markdown())

"""The prefill server's full chunk passes (2,048 tokens) on one GPU that both servers share:
their median duration (ms) by the sequences of the first decode pass each met and of the
widest it overlapped, at each load (light, middle, top: under 4, 4-7 and over 7 req/s for
Llama), pooled over the calibration's and the hardware's disaggregated runs of every
validate given (2026-12-07f).

    python benchmarks/results/2026-12-07f-cpu/chunks_by_decodes.py VALIDATE_DIR..."""

import glob
import sys

import numpy as np
import pandas as pd

BINS = [0, 4, 8, 12, 16, 24, 64]
rows = []
for where in sys.argv[1:]:
    runs = glob.glob(f"{where}/calibration/disagg-*") + glob.glob(f"{where}/hw*/disagg-*")
    for path in sorted(runs):
        load = float(path.split("disagg-")[1].removesuffix("rps"))
        s = pd.read_parquet(f"{path}/steps.parquet").sort_values("start_s")
        chunks = s[s.node.str.startswith("prefill") & (s.prefill_tokens == 2048)]
        dec = s[s.node.str.startswith("decode")]
        d0, d1 = dec.start_s.to_numpy(), (dec.start_s + dec.duration_s).to_numpy()
        seqs = dec.decode_seqs.to_numpy()
        for t0, dur in zip(chunks.start_s.to_numpy(), chunks.duration_s.to_numpy(), strict=True):
            met = (d0 < t0 + dur) & (d1 > t0)
            if met.any():
                first = seqs[int(np.argmax(met))]
                rows.append((load, first, seqs[met].max(), int(met.sum()), dur * 1e3))
df = pd.DataFrame(rows, columns=["load", "first", "widest", "overlapped", "ms"])
df["load"] = pd.cut(df.load, [0, 4, 7, 1e9], labels=["light", "middle", "top"])
for by in ("first", "widest"):
    df["seqs"] = pd.cut(df[by], BINS)
    table = df.pivot_table(
        index="seqs", columns="load", values="ms", aggfunc=["median", "size"], observed=False
    )
    print(f"by the {by} decode pass's sequences: median ms, then passes")
    print(table.round(1).to_string(), "\n")

"""How the two servers of a disaggregated run on one GPU slowed each other: each decode pass's
length over the median of its batch size's passes that met no prefill pass, by how much of it
a prefill pass overlapped, and the prefill passes' lengths by chunk tokens. For the 12-05b
validate (H200, eager prefill passes) and the 12-05e one (H100, prefill pieces).

    mkdir -p /tmp/v /tmp/h
    tar xzf benchmarks/results/2026-12-05b-gpu/llama-overlap/runs.tgz -C /tmp/v
    tar xzf benchmarks/results/2026-12-05e-gpu/h100-pieces/runs.tgz -C /tmp/h
    python benchmarks/results/2026-12-05e-gpu/shared_gpu.py \
        /tmp/v/validate-llama8-overlap /tmp/h/validate-pieces8k
"""

import sys
from pathlib import Path

import numpy as np
import pandas as pd

OVERLAP = [-0.01, 0, 0.5, 0.99, 1.0]  # share of a decode pass that a prefill pass overlapped
TOKENS = [0, 512, 1024, 1600, 2047, 2048]


def covered(starts: np.ndarray, ends: np.ndarray, by: pd.DataFrame) -> np.ndarray:
    """Per pass [start, end), the share of it that the passes of `by` overlap."""
    a, b = by.start_s.to_numpy()[None, :], by.end.to_numpy()[None, :]
    inside = np.clip(np.minimum(ends[:, None], b) - np.maximum(starts[:, None], a), 0, None)
    return inside.sum(axis=1) / (ends - starts)


decode_rows, prefill_rows = [], []
for root in map(Path, sys.argv[1:]):
    for run in sorted((root / "hw").glob("disagg-*")):
        steps = pd.read_parquet(run / "steps.parquet")
        steps = steps.assign(end=steps.start_s + steps.duration_s)
        chunks = steps[steps.prefill_tokens > 0]
        decodes = steps[(steps.prefill_tokens == 0) & (steps.decode_seqs > 0)]
        share = covered(decodes.start_s.to_numpy(), decodes.end.to_numpy(), chunks)
        alone = decodes[share == 0].groupby("batch_size").duration_s.median()
        slowed = decodes.duration_s / decodes.batch_size.map(alone)
        by = pd.cut(share, OVERLAP, labels=["none", "<= 1/2", "1/2-0.99", "all"])
        for label, group in slowed.groupby(by, observed=True):
            decode_rows.append(
                {"validate": root.name, "run": run.name, "prefill overlap": label,
                 "passes": len(group), "length / alone": group.median()}
            )  # fmt: skip
        for label, group in chunks.groupby(pd.cut(chunks.tokens, TOKENS), observed=True):
            prefill_rows.append(
                {"validate": root.name, "run": run.name, "chunk tokens": str(label),
                 "passes": len(group), "length ms": 1e3 * group.duration_s.median(),
                 "launch ms": 1e3 * group.launch_s.median()}
            )  # fmt: skip
print("Decode passes: length over their batch's passes alone (median)\n")
print(pd.DataFrame(decode_rows).round(2).to_markdown(index=False))
print("\nPrefill passes beside the decode server (median)\n")
print(pd.DataFrame(prefill_rows).round(1).to_markdown(index=False))

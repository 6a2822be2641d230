"""The passes with a prompt chunk of the two MoE validates (eager and in pieces): medians of
their device time and of the host's launch of their forward (`launch_s`), ms, by chunk size,
over every run of each workload. Where launch_s is about device_s the device waited on the host.

    cd benchmarks/results/2026-12-06d-gpu && python launch.py > launch.md
"""

from __future__ import annotations

import sys
import tarfile
import tempfile
from pathlib import Path

import pandas as pd

HERE = Path(__file__).parent
BINS = [0, 1000, 2048, 3072, 4096]


def passes(setup: str) -> pd.DataFrame:
    """Every hw run's passes with a chunk, with the run's name and the repeat's directory."""
    out = []
    with tempfile.TemporaryDirectory() as tmp:
        with tarfile.open(HERE / setup / "runs.tar.xz") as tar:
            tar.extractall(tmp, filter="data")
        for steps in sorted(Path(tmp).glob("*/hw*/*/steps.parquet")):
            s = pd.read_parquet(steps)
            s = s[s.prefill_tokens > 0].assign(run=steps.parent.name)
            out.append(s)
    return pd.concat(out)


def main() -> None:
    rows = []
    for setup in ("eager", "pieces"):
        s = passes(setup)
        s["chunk"] = pd.cut(s.prefill_tokens, BINS).astype(str)
        for (node, chunk), p in s.groupby(["node", "chunk"], observed=True):
            rows.append(
                {
                    "setup": setup,
                    "server": node,
                    "chunk tokens": chunk,
                    "passes": len(p),
                    "device ms": round(p.device_s.median() * 1e3, 2),
                    "launch ms": round(p.launch_s.median() * 1e3, 2),
                    "launch / device": round((p.launch_s / p.device_s).median(), 3),
                }
            )
    sys.stdout.write(pd.DataFrame(rows).to_markdown(index=False) + "\n")


if __name__ == "__main__":
    main()

"""The GPU's timeline on a shared device: every kernel, copy and memset that each server of a hw
run launched inside a window, from torch.profiler's CUDA activity (DISAGG_KERNEL_TRACE), on the
run's clock (seconds since the driver's t0), so the two processes' work lines up.

    python benchmarks/kernel_timeline.py TRACE_DIR --out kernels.csv.gz

TRACE_DIR holds NAME.json (the chrome trace) and NAME.window (t0, the window's start and end on
the run's clock) for each server. Rows: node, kind (kernel, memcpy, memset, or the host's
runtime call: graph launch, launch, sync), start_ms, end_ms, correlation, stream, name.
"""

from __future__ import annotations

import argparse
import csv
import gzip
import json
from pathlib import Path

KINDS = {"kernel": "kernel", "gpu_memcpy": "memcpy", "gpu_memset": "memset"}
RUNTIME = ("Graph", "Synchronize", "LaunchKernel", "Memcpy", "EventRecord", "StreamWait")


def rows(trace: Path) -> list[tuple]:
    t0 = float(trace.with_suffix(".window").read_text().split()[0])
    doc = json.loads(trace.read_text())
    base_us = doc.get("baseTimeNanoseconds", 0) / 1e3 - t0 * 1e6  # ts + base_us: the run's µs
    out = []
    for e in doc["traceEvents"]:
        if e.get("ph") != "X":
            continue
        cat, name = e.get("cat", ""), e.get("name", "")
        kind = KINDS.get(cat)
        if kind is None and cat in ("cuda_runtime", "cuda_driver"):
            kind = next((k for k in RUNTIME if k in name), None)
        if kind is None:
            continue
        start = (e["ts"] + base_us) / 1e3
        args = e.get("args", {})
        out.append(
            (
                trace.stem,
                kind,
                f"{start:.4f}",
                f"{start + e.get('dur', 0) / 1e3:.4f}",
                args.get("correlation", ""),
                args.get("stream", e.get("tid", "")),
                name[:60],
            )
        )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("trace_dir", type=Path)
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args()
    with gzip.open(a.out, "wt", newline="") as f:
        w = csv.writer(f)
        w.writerow(("node", "kind", "start_ms", "end_ms", "correlation", "stream", "name"))
        for trace in sorted(a.trace_dir.glob("*.json")):
            got = rows(trace)
            w.writerows(got)
            win = trace.with_suffix(".window").read_text().split()
            print(f"{trace.stem}: {len(got)} rows, window {win[1]}-{win[2]} s")


if __name__ == "__main__":
    main()

"""What splitting one KV layer region into row views costs on this device (the cuda wire's
copier did this whole, at a post's first batched copy): seconds per split, by row size.

    python benchmarks/split_cost.py --device cuda:0 --region-mib 1024
"""

from __future__ import annotations

import argparse
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--region-mib", type=int, default=1024)
    ap.add_argument("--rows", default="4096,32768", help="row sizes in bytes")
    a = ap.parse_args()
    t = torch.empty(a.region_mib << 20, dtype=torch.uint8, device=a.device).view(torch.int64)
    for row in (int(r) for r in a.rows.split(",")):
        start = time.perf_counter()
        views = t.view(-1, row // 8).unbind(0)
        took = time.perf_counter() - start
        print(f"{a.region_mib} MiB in rows of {row} B: {len(views)} views, {took:.3f} s")


if __name__ == "__main__":
    main()

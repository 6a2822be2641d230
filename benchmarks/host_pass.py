"""The host work of building one decode pass's inputs, by batch and context, on the CPU.

    python benchmarks/host_pass.py [--batches 1,8,25,52,100] [--contexts 294,4245] [--out DIR]

A server's pass is host work (its sequences, the attention's index arrays, the packed
per-token inputs) then device work. On an H200 the host part of a Llama-3.1-8B decode pass grew
with its batch and with its sequences' context, and moved from one server process to the next
(`benchmarks/results/2026-12-04d-gpu/`). This times, on any CPU, what a decode server does each
pass before the device: each sequence's `Seq.decode` (from the pool's page list), the
`BatchMeta` of the graph's padded rows, the int32 index tensors the attention plan takes and
`StepTensors.pack`. FlashInfer's own planning is not included: it needs a GPU. Contexts are
drawn evenly between the two `--contexts` (seeded), each sequence on pages of its own. Prints,
and writes host_pass.csv (batch, pages, median and p90 µs over `--repeats`) with `--out`.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from pathlib import Path

import pandas as pd

from disagg.core.kvcache import pages_for
from disagg.hw.attention import plan_tensors
from disagg.hw.batch import BatchMeta, Seq, StepTensors
from disagg.hw.runner import GRAPH_BATCHES, graph_batch_for

PAGE_SIZE = 16


def pool_pages(batch: int, lo: int, hi: int, seed: int) -> list[tuple[int, list[int]]]:
    """(context, page list) of each sequence: contexts drawn evenly in [lo, hi]."""
    rng, out, at = random.Random(seed), [], 0
    for _ in range(batch):
        c = rng.randint(lo, hi)
        n = pages_for(c + 1, PAGE_SIZE)
        out.append((c, list(range(at, at + n))))
        at += n
    return out


def one_pass(rows: list[tuple[int, list[int]]], num_pages: int) -> None:
    """What a decode server does on the host before a graph replay."""
    seqs = [Seq.decode(7, c, pages) for c, pages in rows]
    size = graph_batch_for(GRAPH_BATCHES, len(seqs)) or len(seqs)
    pad = Seq((0,), 0, (num_pages,))
    padded = [*seqs, *[pad] * (size - len(seqs))]
    meta = BatchMeta.of(padded, PAGE_SIZE, num_pages)
    plan_tensors(meta)
    StepTensors.pack(padded, meta)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--batches", default="1,8,25,52,100")
    ap.add_argument("--contexts", default="294,4245", help="LOW,HIGH tokens cached")
    ap.add_argument("--repeats", type=int, default=200)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    lo, hi = (int(x) for x in args.contexts.split(","))
    out = []
    for batch in (int(b) for b in args.batches.split(",")):
        rows = pool_pages(batch, lo, hi, args.seed)
        num_pages = sum(len(p) for _, p in rows)
        times = []
        for _ in range(args.repeats + 10):
            began = time.perf_counter()
            one_pass(rows, num_pages)
            times.append(time.perf_counter() - began)
        times = sorted(times[10:])
        med, p90 = statistics.median(times) * 1e6, times[int(0.9 * len(times))] * 1e6
        out.append((batch, num_pages, round(med, 1), round(p90, 1)))
        print(f"batch {batch:4d}: {num_pages:6d} pages, median {med:8.1f} µs, p90 {p90:8.1f} µs")
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        df = pd.DataFrame(out, columns=["batch", "pages", "median_us", "p90_us"])
        df.to_csv(args.out / "host_pass.csv", index=False)


if __name__ == "__main__":
    main()

"""The host work of preparing one decode pass, by batch and context: on the CPU, and on a GPU
with FlashInfer's plan, with and without a pass running on the device.

    python benchmarks/host_pass.py [--batches 1,8,25,52,100] [--contexts 294,4245]
                                   [--device cpu|cuda[:N]] [--repeats 200] [--out DIR]

A server's pass is host work (its sequences, the attention's index arrays, the packed
per-token inputs, the attention's plan) then device work. On an H200 the host part of a
Llama-3.1-8B decode pass grew with its batch and with its sequences' context, and moved from
one server process to the next (`benchmarks/results/2026-12-04d-gpu/`). This times what a
decode server does each pass before the device: each sequence's `Seq.decode` (from the pool's
page list), the `BatchMeta` of the graph's padded rows, the int32 index tensors the plan takes
and `StepTensors.pack` (`host_us`, on any CPU). On a GPU it also times FlashInfer's plan of
Llama-3.1-8B's attention for the graph of that batch, with the packed inputs' copy, three ways:
- `plan_us`: the device idle, as a pass prepared after the one before has ended;
- `in_flight_us`: behind a kernel of about 5 ms on the device, planned as such a pass is;
- `staged_us`: behind that kernel, staged (pinned copies, page ids on the device first) as
  `hw.latency.overlap` plans the next pass while one runs.
A plan whose copies wait for the device takes about the kernel's 5 ms; one that does not, about
`plan_us`. Contexts are drawn evenly between the two `--contexts` (seeded), each sequence on
pages of its own. Prints, and writes host_pass.csv (medians and host p90 over `--repeats`) with
`--out`.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import pandas as pd
import torch

from disagg.core.kvcache import pages_for
from disagg.hw.attention import AttnShape, FlashInferAttention, plan_tensors
from disagg.hw.batch import BatchMeta, Seq, StepTensors
from disagg.hw.device import resolve_device
from disagg.hw.runner import GRAPH_BATCHES, graph_batch_for
from disagg.models import LLAMA_31_8B

PAGE_SIZE = 16
BUSY_S = 5e-3  # the kernel a plan in flight queues behind
CLOCK_HZ = 1.98e9  # an H200's SM clock: cycles of torch.cuda._sleep per second


def pool_pages(batch: int, lo: int, hi: int, seed: int) -> list[tuple[int, list[int]]]:
    """(context, page list) of each sequence: contexts drawn evenly in [lo, hi]."""
    rng, out, at = random.Random(seed), [], 0
    for _ in range(batch):
        c = rng.randint(lo, hi)
        n = pages_for(c + 1, PAGE_SIZE)
        out.append((c, list(range(at, at + n))))
        at += n
    return out


def padded(rows: list[tuple[int, list[int]]], num_pages: int) -> tuple[list[Seq], BatchMeta]:
    """What a decode server does on the host before a graph replay: the rows, padded to the
    graph's batch with rows on the scratch page, and their meta."""
    seqs = [Seq.decode(7, c, pages) for c, pages in rows]
    size = graph_batch_for(GRAPH_BATCHES, len(seqs)) or len(seqs)
    pad = Seq((0,), 0, (num_pages,))
    seqs = [*seqs, *[pad] * (size - len(seqs))]
    return seqs, BatchMeta.of(seqs, PAGE_SIZE, num_pages)


def one_pass(rows: list[tuple[int, list[int]]], num_pages: int) -> None:
    seqs, meta = padded(rows, num_pages)
    plan_tensors(meta)
    StepTensors.pack(seqs, meta)


def times_us(work: Callable[[], object], repeats: int, before: Callable[[], object]) -> list[float]:
    """`work`'s host time, µs, `repeats` times after 10 not kept, each after `before`."""
    out = []
    for _ in range(repeats + 10):
        before()
        began = time.perf_counter()
        work()
        out.append((time.perf_counter() - began) * 1e6)
    return sorted(out[10:])


def idle(device: torch.device) -> None:
    """Nothing runs on the device (a pass prepared after the one before has ended)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def busy(device: torch.device) -> None:
    """A kernel of about BUSY_S runs on the device (a pass prepared while one runs)."""
    idle(device)
    torch.cuda._sleep(int(BUSY_S * CLOCK_HZ))


def preparer(
    rows: list[tuple[int, list[int]]], num_pages: int, device: torch.device
) -> Callable[[bool], None]:
    """A pass's whole prepare on `device` (plan and packed copy), staged or not."""
    seqs, meta = padded(rows, num_pages)
    shape = AttnShape.of(LLAMA_31_8B, PAGE_SIZE)
    size = len(seqs)
    attn = FlashInferAttention(shape, device, graph_batch=size, max_pages=num_pages + size)
    packed = torch.zeros(len(StepTensors.pack(seqs, meta)), dtype=torch.int64, device=device)

    def prepare(staged: bool) -> None:
        seqs, meta = padded(rows, num_pages)
        attn.plan(meta, staged=staged)
        host = torch.from_numpy(StepTensors.pack(seqs, meta)).pin_memory()
        packed.copy_(host, non_blocking=True)

    return prepare


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--batches", default="1,8,25,52,100")
    ap.add_argument("--contexts", default="294,4245", help="LOW,HIGH tokens cached")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--repeats", type=int, default=200)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    device = resolve_device(args.device)
    lo, hi = (int(x) for x in args.contexts.split(","))
    out = []
    for batch in (int(b) for b in args.batches.split(",")):
        rows = pool_pages(batch, lo, hi, args.seed)
        num_pages = sum(len(p) for _, p in rows)
        host = times_us(partial(one_pass, rows, num_pages), args.repeats, partial(idle, device))
        row: dict[str, float] = {
            "batch": batch,
            "pages": num_pages,
            "host_us": round(statistics.median(host), 1),
            "host_p90_us": round(host[int(0.9 * len(host))], 1),
        }
        if device.type == "cuda":
            prepare = preparer(rows, num_pages, device)
            for key, staged, before in (
                ("plan_us", False, idle),
                ("in_flight_us", False, busy),
                ("staged_us", True, busy),
            ):
                ts = times_us(partial(prepare, staged), args.repeats, partial(before, device))
                row[key] = round(statistics.median(ts), 1)
            idle(device)
        out.append(row)
        print("  ".join(f"{k} {v:g}" for k, v in row.items()))
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        pd.DataFrame(out).to_csv(args.out / "host_pass.csv", index=False)


if __name__ == "__main__":
    main()

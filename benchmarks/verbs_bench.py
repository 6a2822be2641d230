"""The verbs wire on soft-RoCE (rxe, in the qemu TCG VM): write rates and KV page write lists.

Soft-RoCE is the kernel's software RDMA over an emulated CPU: these figures say what the wire
costs per work request and per byte in Python and in rxe, not what a ConnectX NIC does.

Run inside the VM, from the repo root:
    tools/rdma-vm/run.sh python3 benchmarks/verbs_bench.py --out /out/verbs_rxe.md
Two endpoints in one process, both on rxe0 (loopback queue pairs).

1. Plain writes of 4 KiB, 64 KiB and 1 MiB: writes/s and MB/s.
2. One layer of Llama-3.1-8B KV pages (8 KV heads, head_dim 128, page size 16, bf16) moved from
   a TP8 prefill rank to a TP4 decode rank, as planned by disagg.core.sharding: NHD pages give
   one write per token per plane (256-byte runs), HND pages one write per plane (4 KiB runs).
"""

from __future__ import annotations

import argparse
import platform
import time
from collections.abc import Sequence

import numpy as np

from disagg.core.sharding import plan_transfer, shard_layout
from disagg.hw.transport.base import Polled, Unit, Write
from disagg.hw.transport.verbs import VerbsTransport
from disagg.models import LLAMA_31_8B


def run(a: VerbsTransport, b: VerbsTransport, units: Sequence[Unit], batch: int) -> float:
    """Post `units` from a to b in posts of `batch` units; seconds until all have landed."""
    imms = sum(u.imm is not None for u in units)
    posts = -(-len(units) // batch)
    done, got = Polled(), Polled()
    start = time.perf_counter()
    for k in range(posts):
        a.post("b", units[k * batch : (k + 1) * batch], wr_id=k)
    while len(done.completions) < posts or len(got.immediates) < imms:
        done.completions += a.poll().completions
        got.immediates += b.poll().immediates
    elapsed = time.perf_counter() - start
    if not all(c.ok for c in done.completions):
        raise SystemExit(f"a write failed: {done.completions}")
    return elapsed


def plain_writes(a: VerbsTransport, b: VerbsTransport) -> list[str]:
    rows = ["| write size | writes | seconds | writes/s | MB/s |", "|---:|---:|---:|---:|---:|"]
    for size, count in ((4 << 10, 4000), (64 << 10, 1500), (1 << 20, 200)):
        span = 64 << 20
        units = [Unit([Write("src", 0, "dst", (i * size) % span, size)]) for i in range(count)]
        run(a, b, units[:50], 50)  # warm up
        s = run(a, b, units, 64)
        rows.append(f"| {size >> 10} KiB | {count} | {s:.2f} | {count / s:,.0f} | "
                    f"{count * size / s / 1e6:,.1f} |")  # fmt: skip
    return rows


def page_units(layout: str, pages: int) -> tuple[list[Unit], int, int]:
    """Units of one layer for `pages` pages, prefill rank 0 -> its decode rank; (units, WRs, B)."""
    plan = plan_transfer(shard_layout(LLAMA_31_8B, 8), shard_layout(LLAMA_31_8B, 4), 16, layout)
    units, unit, nbytes = [], [], 0
    for w in plan.writes([(p, p) for p in range(pages)]):
        if w.src_rank != 0:
            continue
        unit.append(Write("src", w.src_offset, "dst", w.dst_offset, w.nbytes))
        nbytes += w.nbytes
        if w.imm:
            units.append(Unit(unit, imm=len(units)))
            unit = []
    return units, sum(len(u.writes) for u in units), nbytes


def page_writes(a: VerbsTransport, b: VerbsTransport, pages: int) -> list[str]:
    rows = [
        "| layout | writes/page | WRs posted | bytes | seconds | us/page | MB/s |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for layout in ("NHD", "HND"):
        units, writes, nbytes = page_units(layout, pages)
        wrs = sum(len(a._plan(a._peers["b"], u)) for u in units)
        run(a, b, units[:16], 16)
        s = run(a, b, units, 64)
        rows.append(f"| {layout} | {writes // pages} | {wrs} | {nbytes} | {s:.3f} | "
                    f"{s / pages * 1e6:,.0f} | {nbytes / s / 1e6:,.1f} |")  # fmt: skip
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pages", type=int, default=512, help="pages of the KV layer")
    parser.add_argument("--out", help="also write the markdown table here")
    args = parser.parse_args()
    a, b = VerbsTransport("a"), VerbsTransport("b")
    src = np.random.default_rng(0).integers(0, 256, 64 << 20, dtype=np.uint8)
    dst = np.zeros(64 << 20, dtype=np.uint8)
    a.register("src", src)
    a.connect("b", b.local_info(), [b.register("dst", dst)])
    lines = [
        f"verbs wire on soft-RoCE ({a.device}, rxe; not a ConnectX NIC), "
        f"{platform.machine()} {platform.release()}, Python {platform.python_version()}",
        "",
        *plain_writes(a, b),
        "",
        f"One layer of Llama-3.1-8B, {args.pages} pages of 16 tokens, TP8 prefill rank 0 -> "
        "TP4 decode rank 0 (1 KV head of 8, bf16), one immediate per page:",
        "",
        *page_writes(a, b, args.pages),
    ]
    a.close()
    b.close()
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()

"""MoE layer efficiency on one GPU: expert GEMMs against the GEMM ceiling, expert-weight reads
against copy bandwidth.

    python benchmarks/moe_bench.py --model qwen3-30b-a3b --device cuda:0 --out DIR

One MoE layer of the model at full width, seeded random weights, its router on random hidden
states. For each token count (prefill: 512..8192 tokens; decode: batch 1..256) it times the
routed experts alone (`experts_grouped` and the per-expert `experts_reference`), the median of
`--repeats` runs after warm-up, with CUDA events. Against ceilings measured in the same run:
- FLOPs: 2 * T * top_k * 3 * hidden * moe_intermediate over a bf16 GEMM of 8192^3;
- bytes: the distinct experts the batch routes to (counted), 3 * hidden * moe_intermediate
  weights each, over a device copy's bandwidth (bytes read + written, as gpu_bench.py counts).
Writes moe_bench.json and moe_bench.md into --out. `--smoke` runs toy sizes on the CPU.
"""

from __future__ import annotations

import argparse
import json
import statistics
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from disagg.hw.device import copy_seconds, resolve_device, time_it
from disagg.hw.moe import MoE, experts_grouped, experts_reference, route
from disagg.hw.weights import WeightMaker
from disagg.models import MODELS

PREFILL = (512, 2048, 8192)
DECODE = (1, 4, 16, 64, 256)


def ceilings(dev: torch.device, n: int) -> tuple[float, float]:
    """(bf16 GEMM FLOP/s at n^3, device copy bytes/s read + written), measured now."""
    a = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
    gemm_s = statistics.median(time_it(partial(torch.mm, a, a), dev, warmup=3, repeats=10))
    nbytes = 1 << 30 if dev.type == "cuda" else 1 << 24
    return 2 * n**3 / gemm_s, 2 * nbytes / copy_seconds(nbytes, dev)


def measure(moe: MoE, tokens: int, dev: torch.device, repeats: int) -> dict[str, Any]:
    h = moe.w13.shape[2]
    x = torch.randn(tokens, h, device=dev, generator=torch.Generator(dev).manual_seed(tokens))
    x = x.to(moe.w13.dtype)
    weights, ids = route(F.linear(x, moe.router), moe.routing, moe.bias)
    row: dict[str, Any] = {"tokens": tokens, "experts_hit": int(ids.unique().numel())}
    for name, fn in (("grouped", experts_grouped), ("reference", experts_reference)):
        call = partial(fn, x, weights, ids, moe.w13, moe.w2)
        row[f"{name}_s"] = statistics.median(time_it(call, dev, warmup=2, repeats=repeats))
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default="qwen3-30b-a3b")
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--out", type=Path, default=Path("runs/moe_bench"))
    ap.add_argument("--smoke", action="store_true", help="toy sizes on the CPU")
    args = ap.parse_args()
    spec = MODELS[args.model if not args.smoke else "tiny-moe"]
    dev = resolve_device("cpu" if args.smoke else args.device)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    moe = MoE(spec, WeightMaker(0, dev, dtype), "layer", out_scale=1.0)
    flops_peak, copy_bps = ceilings(dev, 1024 if args.smoke else 8192)
    per_expert = 3 * spec.hidden * spec.moe_intermediate  # w13 + w2 weights
    wbytes = torch.empty((), dtype=dtype).element_size()
    rows = []
    for kind, sizes in (("prefill", PREFILL), ("decode", DECODE)):
        for t in sizes if not args.smoke else (4, 32):
            row = {"kind": kind, **measure(moe, t, dev, args.repeats)}
            flops = 2 * t * spec.experts_per_token * per_expert
            read = row["experts_hit"] * per_expert * wbytes
            for name in ("grouped", "reference"):
                row[f"{name}_gemm_frac"] = flops / row[f"{name}_s"] / flops_peak
                row[f"{name}_read_frac"] = read / row[f"{name}_s"] / copy_bps
            rows.append(row)
            print(json.dumps(row), flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    record = {
        "model": spec.name,
        "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
        "gemm_tflops": flops_peak / 1e12,
        "copy_gbps": copy_bps / 1e9,
        "rows": rows,
    }
    (args.out / "moe_bench.json").write_text(json.dumps(record, indent=2) + "\n")
    lines = [
        f"# MoE layer of {spec.name} on {record['device']}",
        "",
        f"Ceilings in this run: bf16 GEMM {record['gemm_tflops']:.0f} TFLOP/s, device copy "
        f"{record['copy_gbps']:.0f} GB/s. `gemm`: expert FLOP/s over the GEMM ceiling; `read`: "
        "bytes of the experts hit per second over the copy bandwidth.",
        "",
        "| pass | tokens | experts hit | grouped ms | gemm | read | per-expert ms | gemm | read |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['kind']} | {r['tokens']} | {r['experts_hit']} | {r['grouped_s'] * 1e3:.3f} | "
            f"{r['grouped_gemm_frac']:.1%} | {r['grouped_read_frac']:.1%} | "
            f"{r['reference_s'] * 1e3:.3f} | {r['reference_gemm_frac']:.1%} | "
            f"{r['reference_read_frac']:.1%} |"
        )
    (args.out / "moe_bench.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()

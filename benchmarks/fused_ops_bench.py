"""Torch's elementwise steps of a layer against FlashInfer's fused kernels (model.TorchOps vs
model.FusedOps), at Llama-3.1-8B shapes, on one GPU.

    python benchmarks/fused_ops_bench.py [--tokens 128,8192]

Per step and token count: median microseconds of each (CUDA events, 20 runs after 5 warm-ups)
and the largest difference of their outputs relative to the output's scale. The steps: RMSNorm
of the hidden state, SiLU(gate) * up of the MLP, RoPE of q and k in place. A layer runs two
norms, one SiLU-mul and one RoPE.
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Callable
from functools import partial

import torch

from disagg.hw.device import time_it
from disagg.hw.model import FusedOps, TorchOps, inv_freq, rope_tables
from disagg.models import LLAMA_31_8B


def median_us(fn: Callable[[], object], dev: torch.device) -> float:
    return 1e6 * statistics.median(time_it(fn, dev, warmup=5, repeats=20))


def bench(t: int, dev: torch.device) -> list[dict[str, float | int | str]]:
    """Rows for `t` tokens: each step timed both ways, and their outputs compared."""
    s, g = LLAMA_31_8B, torch.Generator(device=dev).manual_seed(t)
    torch_ops, fused = TorchOps(), FusedOps()
    h = torch.randn(t, s.hidden, device=dev, generator=g).bfloat16()
    w = torch.rand(s.hidden, device=dev, generator=g).bfloat16()
    gate_up = torch.randn(t, 2 * s.intermediate, device=dev, generator=g).bfloat16()
    qkv = torch.randn(t, s.heads + 2 * s.kv_heads, s.head_dim, device=dev, generator=g).bfloat16()
    work = qkv.clone()  # timed RoPE runs rotate this one in place, again and again
    pos = torch.randint(0, 32768, (t,), device=dev, generator=g)
    tables = rope_tables(pos, inv_freq(s.head_dim, dev), torch.bfloat16)

    def qk(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x[:, : s.heads], x[:, s.heads : s.heads + s.kv_heads]

    def norm(o: TorchOps) -> torch.Tensor:
        return o.norm(h, w)

    def silu_mul(o: TorchOps) -> torch.Tensor:
        return o.silu_mul(gate_up)

    def rope_timed(o: TorchOps) -> None:
        o.rope(*qk(work), pos, tables)

    def rope(o: TorchOps) -> torch.Tensor:
        x = qkv.clone()
        o.rope(*qk(x), pos, tables)
        return x[:, : s.heads + s.kv_heads]

    rows: list[dict[str, float | int | str]] = []
    for name, run, result in (
        ("rmsnorm", norm, norm),
        ("silu_mul", silu_mul, silu_mul),
        ("rope", rope_timed, rope),
    ):
        a, b = result(torch_ops).float(), result(fused).float()
        rows.append(
            {
                "tokens": t,
                "step": name,
                "torch_us": median_us(partial(run, torch_ops), dev),
                "fused_us": median_us(partial(run, fused), dev),
                "max_rel_diff": float((a - b).abs().max() / a.abs().max()),
            }
        )
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", default="128,8192")
    args = ap.parse_args()
    for t in (int(x) for x in args.tokens.split(",")):
        for row in bench(t, torch.device("cuda")):
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()

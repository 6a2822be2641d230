"""Ways to copy one request's KV pages of every layer at once, against one plain copy.

    python benchmarks/copy_ways.py --src-device 0 --dst-device 0 --out DIR

The layers of both sides lie in one allocation each (`[layers, pool]` bytes, as KVCache holds
them); a request's pages are one run at the same offset of every layer. A whole-request post
(or a layer-wise post that caught up several layers) moves `layers` such runs, and how they
are issued decides how near one plain copy the wire gets. This times the ways of issuing the
same bytes: one copy per layer, torch's batched `_foreach_copy_` over the layers' runs (bytes and
8-byte words), one strided `copy_` of the `[layers, run]` view (bytes, words, 16-byte words),
and the driver's copies (one per layer, or one 2D copy). On two GPUs torch's copies are peer
copies in one process (torch enables peer access). Medians of CUDA-event timings after
warm-up; writes copy_ways.json and copy_ways.md into --out.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from disagg.hw.device import copy_seconds, resolve_device, time_it
from disagg.models import LLAMA_31_8B


def ways(
    src: torch.Tensor, dst: torch.Tensor, run: int, at: int
) -> dict[str, Callable[[], object]]:
    """Callables that copy bytes [at, at + run) of every row of `src` into `dst`."""
    from disagg.hw.transport import cudadriver

    rows = [(d[at : at + run], s[at : at + run]) for d, s in zip(dst, src, strict=True)]
    words = [(d.view(torch.int64), s.view(torch.int64)) for d, s in rows]
    s2, d2 = src[:, at : at + run], dst[:, at : at + run]
    pitch_s, pitch_d = src.stride(0), dst.stride(0)

    def per_layer() -> None:
        for d, s in rows:
            d.copy_(s)

    def driver_per_layer() -> None:
        stream = torch.cuda.current_stream(src.device).cuda_stream
        for d, s in rows:
            cudadriver.copy_async(d.data_ptr(), s.data_ptr(), run, stream)

    def driver_2d() -> None:
        stream = torch.cuda.current_stream(src.device).cuda_stream
        cudadriver.copy_2d_async(
            d2.data_ptr(), pitch_d, s2.data_ptr(), pitch_s, run, src.shape[0], stream
        )

    return {
        "one copy per layer": per_layer,
        "_foreach_copy_, bytes": lambda: torch._foreach_copy_(*map(list, zip(*rows, strict=True))),
        "_foreach_copy_, 8-byte words": lambda: torch._foreach_copy_(
            *map(list, zip(*words, strict=True))
        ),
        "strided copy_, bytes": lambda: d2.copy_(s2),
        "strided copy_, 8-byte words": lambda: d2.view(torch.int64).copy_(s2.view(torch.int64)),
        "strided copy_, 16-byte words": lambda: d2.view(torch.complex128).copy_(
            s2.view(torch.complex128)
        ),
        "driver copy per layer": driver_per_layer,
        "driver 2D copy": driver_2d,
    }


def measure(tokens: int, dev_s: torch.device, dev_d: torch.device) -> dict[str, object]:
    spec = LLAMA_31_8B
    run = tokens * spec.kv_bytes_per_token_per_layer()
    layers, pool = spec.layers, 2 * run
    src = torch.randint(0, 256, (layers, pool), dtype=torch.uint8, device=dev_s)
    dst = torch.zeros((layers, pool), dtype=torch.uint8, device=dev_d)
    nbytes = layers * run
    one = copy_seconds(nbytes, dev_s, dev_d)
    out: dict[str, object] = {"tokens": tokens, "bytes": nbytes}
    out["one copy gbps"] = nbytes / one / 1e9
    at = run // 2  # the run sits mid-row, as a request's pages in a pool
    for name, fn in ways(src, dst, run, at).items():
        dst.zero_()
        try:
            t = statistics.median(time_it(fn, dev_s, warmup=5, repeats=20))
        except Exception as e:  # a way the torch build lacks: record it, go on
            out[name] = {"error": f"{type(e).__name__}: {e}"[:200]}
            continue
        ok = torch.equal(dst[:, at : at + run], src[:, at : at + run].to(dev_d))  # on the GPU
        out[name] = {"gbps": nbytes / t / 1e9, "fraction_of_one_copy": one / t, "bytes_ok": ok}
    return out


def _name(dev: torch.device) -> str:
    return torch.cuda.get_device_name(dev) if dev.type == "cuda" else "CPU"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--src-device", default="0")
    ap.add_argument("--dst-device", default="0")
    ap.add_argument("--tokens", default="4096,32768")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    dev_s, dev_d = resolve_device(args.src_device), resolve_device(args.dst_device)
    results = [measure(int(n), dev_s, dev_d) for n in args.tokens.split(",")]
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "copy_ways.json").write_text(json.dumps(results, indent=2))
    lines = [
        f"# copy_ways {time.strftime('%Y-%m-%d %H:%M')}, {_name(dev_s)}",
        f"{dev_s} -> {dev_d}, torch {torch.__version__}",
        "",
        "| tokens | way | GB/s | of one copy | bytes ok |",
        "| --- | --- | --- | --- | --- |",
    ]
    for r in results:
        lines.append(f"| {r['tokens']} | one plain copy | {r['one copy gbps']:.0f} | 100% | |")
        for name, v in r.items():
            if isinstance(v, dict) and "gbps" in v:
                lines.append(
                    f"| {r['tokens']} | {name} | {v['gbps']:.0f} | "
                    f"{v['fraction_of_one_copy']:.0%} | {v['bytes_ok']} |"
                )
            elif isinstance(v, dict):
                lines.append(f"| {r['tokens']} | {name} | failed: {v['error']} | | |")
    (args.out / "copy_ways.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()

"""Does a KV copy running beside a compute-bound kernel slow that kernel down?

    python benchmarks/copy_overlap.py --compute-device 0 --copy-to 1 --out DIR

On two GPUs the layer-wise disaggregated prefill of 32k tokens ran about 30 ms (2.5%) slower
than the same prefill with whole-request transfer, on either GPU, while the copies it overlapped
add up to 11 ms. This runs a bf16 GEMM loop (8192^3, compute-bound like long-prompt attention)
on the compute device alone, then with 32 copies of `--layer-mib` MiB issued on a side stream
at the same time, the way the cuda wire posts them: through torch (`copy_`); through the driver
(`cuMemcpyDtoDAsync`, the wire's path to another GPU), also pulled (issued on the destination
GPU's stream); through `cuMemcpyPeerAsync` (each side named with its context); and through the
runtime's `cudaMemcpyAsync`. The destination is `--copy-to` (another GPU: a peer copy over
NVLink; the same GPU: a local copy). Medians of `--repeats`.
"""

from __future__ import annotations

import argparse
import ctypes
import glob
import json
import os
import statistics
import time
from pathlib import Path

import torch

from disagg.hw.device import resolve_device
from disagg.hw.transport import cudadriver


def cudart() -> ctypes.CDLL:
    """The CUDA runtime torch loaded (by soname), or the first libcudart found beside torch."""
    for name in ("libcudart.so.13", "libcudart.so.12", "libcudart.so"):
        try:
            return ctypes.CDLL(name)
        except OSError:
            pass
    site = os.path.dirname(os.path.dirname(torch.__file__))
    return ctypes.CDLL(sorted(glob.glob(f"{site}/nvidia/**/libcudart.so*", recursive=True))[0])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--compute-device", default="0")
    ap.add_argument("--copy-to", default="1")
    ap.add_argument("--gemms", type=int, default=200)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--layer-mib", type=int, default=128, help="32k tokens of Llama-3.1-8B")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    dev, dst_dev = resolve_device(args.compute_device), resolve_device(args.copy_to)
    torch.cuda.set_device(dev)
    n = 8192
    a = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
    c = torch.empty_like(a)
    nbytes = args.layer_mib << 20
    src = [torch.ones(nbytes, dtype=torch.uint8, device=dev) for _ in range(args.layers)]
    dst = [torch.empty(nbytes, dtype=torch.uint8, device=dst_dev) for _ in range(args.layers)]
    side = torch.cuda.Stream(dev)
    pull = torch.cuda.Stream(dst_dev)  # the copy issued on the destination GPU's stream
    lib, rt = cudadriver._lib(), cudart()
    ctx = {}
    for d in {dev.index, dst_dev.index}:  # the primary contexts torch made current on each GPU
        ctx[d] = ctypes.c_void_p()
        lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx[d]), ctypes.c_int(d))

    def post(how: str) -> None:
        stream = pull if how == "pull" else side
        with torch.cuda.stream(stream):
            for s, d in zip(src, dst, strict=True):
                if how == "torch":
                    d.copy_(s, non_blocking=True)
                elif how == "peer":  # cuMemcpyPeerAsync, each side named with its context
                    err = lib.cuMemcpyPeerAsync(
                        ctypes.c_uint64(d.data_ptr()),
                        ctx[dst_dev.index],
                        ctypes.c_uint64(s.data_ptr()),
                        ctx[dev.index],
                        ctypes.c_size_t(nbytes),
                        ctypes.c_void_p(side.cuda_stream),
                    )
                    assert err == 0, f"cuMemcpyPeerAsync: error {err}"
                elif how == "runtime":  # cudaMemcpyAsync, device to device, as torch's copy_
                    err = rt.cudaMemcpyAsync(
                        ctypes.c_void_p(d.data_ptr()),
                        ctypes.c_void_p(s.data_ptr()),
                        ctypes.c_size_t(nbytes),
                        ctypes.c_int(3),
                        ctypes.c_void_p(stream.cuda_stream),
                    )
                    assert err == 0, f"cudaMemcpyAsync: error {err}"
                else:
                    cudadriver.copy_async(d.data_ptr(), s.data_ptr(), nbytes, stream.cuda_stream)

    def run(copies: str | None, gemms: int) -> tuple[float, float]:
        """(GEMM loop seconds, copies seconds), each timed by events on its own stream."""
        torch.cuda.synchronize(dev)
        g0, g1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        c0, c1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        g0.record()
        if copies:
            c0.record(pull if copies == "pull" else side)
            post(copies)
            c1.record(pull if copies == "pull" else side)
        for _ in range(gemms):
            torch.matmul(a, a, out=c)
        g1.record()
        torch.cuda.synchronize(dev)
        torch.cuda.synchronize(dst_dev)
        return g0.elapsed_time(g1) / 1e3, (c0.elapsed_time(c1) / 1e3 if copies else 0.0)

    if dst_dev != dev:  # let torch enable peer access both ways before anything is timed
        dst[0][:1].copy_(src[0][:1])
        src[0][:1].copy_(dst[0][:1])
    results = {}
    for label, copies, gemms in [
        ("gemms alone", None, args.gemms),
        ("copies alone (torch)", "torch", 0),
        ("copies alone (driver)", "driver", 0),
        ("copies alone (driver, peer)", "peer", 0),
        ("copies alone (driver, pulled)", "pull", 0),
        ("copies alone (runtime)", "runtime", 0),
        ("gemms + copies (torch)", "torch", args.gemms),
        ("gemms + copies (driver)", "driver", args.gemms),
        ("gemms + copies (driver, peer)", "peer", args.gemms),
        ("gemms + copies (driver, pulled)", "pull", args.gemms),
        ("gemms + copies (runtime)", "runtime", args.gemms),
    ]:
        run(copies, min(gemms, 5))  # warm-up
        times = [run(copies, gemms) for _ in range(args.repeats)]
        results[label] = {
            "gemm_s": statistics.median(t[0] for t in times) if gemms else None,
            "copy_s": statistics.median(t[1] for t in times) if copies else None,
        }
    alone = results["gemms alone"]["gemm_s"]
    assert alone is not None
    total = args.layers * nbytes
    lines = [
        f"compute {dev} ({torch.cuda.get_device_name(dev)}), copies to {dst_dev}: "
        f"{args.gemms} GEMMs of {n}^3 bf16, {args.layers} copies of {args.layer_mib} MiB",
        "",
        "| run | GEMM loop (ms) | slower than alone (ms) | copies (ms) | copy GB/s |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    for label, r in results.items():
        g, cp = r["gemm_s"], r["copy_s"]
        lines.append(
            f"| {label} | {'' if g is None else f'{1e3 * g:.2f}'} | "
            f"{'' if g is None else f'{1e3 * (g - alone):.2f}'} | "
            f"{'' if cp is None else f'{1e3 * cp:.2f}'} | "
            f"{'' if not cp else f'{total / cp / 1e9:.0f}'} |"
        )
    md = "\n".join(lines) + "\n"
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"copy_overlap_{dev.index}_{dst_dev.index}.md").write_text(md)
    (args.out / f"copy_overlap_{dev.index}_{dst_dev.index}.json").write_text(
        json.dumps({"date": time.strftime("%Y-%m-%d %H:%M"), "results": results}, indent=1)
    )
    print(md)


if __name__ == "__main__":
    main()

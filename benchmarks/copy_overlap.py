"""Does a KV copy running beside a compute-bound kernel slow that kernel down?

    python benchmarks/copy_overlap.py --compute-device 0 --copy-to 1 --out DIR
    python benchmarks/copy_overlap.py --work prefill --tokens 32768 --compute-device 0 \
        --copy-to 1 --out DIR        # the real prefill, copies posted layer by layer

Layer-wise transfer overlaps the prefill with its copies; this tells whether the copies slow the
work they overlap by more than their own time (on two H200s they did: docs/results.md). It runs
some work on the compute device alone, then with `--layers` copies of `--layer-mib` MiB to
`--copy-to` (another GPU: peer copies over NVLink; the same GPU: local copies) on a side stream:

- `--work gemm`: a bf16 GEMM loop (`--gemms` x 8192^3), the copies issued all at once;
- `--work prefill`: one prefill of `--tokens` tokens through `--model` at full depth (FlashInfer
  on CUDA), each layer's copy issued when the layer counter passes that layer, the way the
  prefill server posts layer-wise (a watcher thread feeds a queue; the main thread posts). The
  copies are then that model's KV: `--layers` and `--layer-mib` are ignored, and a run's copy
  time spans the first copy to the last, most of the pass.

The copies go five ways: torch's `copy_`; the driver's `cuMemcpyDtoDAsync` (the wire's path to
another GPU), also issued on the destination GPU's stream ("pulled"); `cuMemcpyPeerAsync`; and
the runtime's `cudaMemcpyAsync`. Medians of `--repeats`; each way is compared with the work
alone timed right after it, so drift between ways does not count as a slowdown.
"""

from __future__ import annotations

import argparse
import ctypes
import glob
import json
import os
import queue
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from disagg.core.kvcache import pages_for
from disagg.hw.batch import Seq
from disagg.hw.device import resolve_device
from disagg.hw.model import Transformer
from disagg.hw.runner import LayerWatcher, Runner
from disagg.hw.transport import cudadriver
from disagg.models import get_model

WAYS = ("torch", "driver", "pulled", "peer", "runtime")


def cudart() -> ctypes.CDLL:
    """The CUDA runtime of torch's CUDA major version: by soname (torch loaded it), else the
    libcudart installed beside torch."""
    major = (torch.version.cuda or "").split(".")[0]
    try:
        return ctypes.CDLL(f"libcudart.so.{major}")
    except OSError:
        site = os.path.dirname(os.path.dirname(torch.__file__))
        found = sorted(glob.glob(f"{site}/nvidia/**/libcudart.so.{major}*", recursive=True))
        if not found:
            raise SystemExit(f"no libcudart.so.{major} (torch {torch.__version__})") from None
        return ctypes.CDLL(found[0])


class Copier:
    """`layers` source buffers on the compute device and their destinations, copied one way."""

    def __init__(self, dev: torch.device, dst_dev: torch.device, layers: int, nbytes: int):
        self.dev, self.dst_dev, self.nbytes = dev, dst_dev, nbytes
        self.src = [torch.ones(nbytes, dtype=torch.uint8, device=dev) for _ in range(layers)]
        self.dst = [torch.empty(nbytes, dtype=torch.uint8, device=dst_dev) for _ in range(layers)]
        self.side, self.pull = torch.cuda.Stream(dev), torch.cuda.Stream(dst_dev)
        self.lib, self.rt = cudadriver._lib(), cudart()
        self.ctx = {}
        for d in {dev.index, dst_dev.index}:  # the primary contexts torch made on each GPU
            self.ctx[d] = ctypes.c_void_p()
            err = self.lib.cuDevicePrimaryCtxRetain(ctypes.byref(self.ctx[d]), ctypes.c_int(d))
            cudadriver._check(err, "cuDevicePrimaryCtxRetain")
        if dst_dev != dev:  # let torch enable peer access both ways before anything is timed
            self.dst[0][:1].copy_(self.src[0][:1])
            self.src[0][:1].copy_(self.dst[0][:1])

    def stream(self, way: str) -> torch.cuda.Stream:
        return self.pull if way == "pulled" else self.side

    def post(self, way: str, layers: range) -> None:
        """Issue the copies of `layers` on the way's stream."""
        stream, n = self.stream(way), ctypes.c_size_t(self.nbytes)
        with torch.cuda.device(self.dev), torch.cuda.stream(stream):
            for i in layers:
                s, d = self.src[i], self.dst[i]
                if way == "torch":
                    d.copy_(s, non_blocking=True)
                elif way == "peer":  # each side named with its context
                    err = self.lib.cuMemcpyPeerAsync(
                        ctypes.c_uint64(d.data_ptr()),
                        self.ctx[self.dst_dev.index],
                        ctypes.c_uint64(s.data_ptr()),
                        self.ctx[self.dev.index],
                        n,
                        ctypes.c_void_p(stream.cuda_stream),
                    )
                    cudadriver._check(err, "cuMemcpyPeerAsync")
                elif way == "runtime":  # device to device (kind 3), as torch's copy_ does
                    err = self.rt.cudaMemcpyAsync(
                        ctypes.c_void_p(d.data_ptr()),
                        ctypes.c_void_p(s.data_ptr()),
                        n,
                        ctypes.c_int(3),
                        ctypes.c_void_p(stream.cuda_stream),
                    )
                    if err:
                        raise RuntimeError(f"cudaMemcpyAsync failed: error {err}")
                else:  # driver, and pulled: the same call on the destination GPU's stream
                    cudadriver.copy_async(
                        d.data_ptr(), s.data_ptr(), self.nbytes, stream.cuda_stream
                    )


def gemm_work(dev: torch.device, gemms: int) -> Callable[[], None]:
    a = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
    c = torch.empty_like(a)

    def work() -> None:
        for _ in range(gemms):
            torch.matmul(a, a, out=c)

    return work


def prefill_work(dev: torch.device, model_name: str, tokens: int) -> tuple[Runner, Seq]:
    spec = get_model(model_name)
    model = Transformer(spec, seed=0, device=dev)
    page = 16
    cache = model.new_cache(pages_for(tokens, page), page)
    prompt = torch.randint(0, spec.vocab, (tokens,), generator=torch.Generator().manual_seed(0))
    return Runner(model, cache), Seq.of(prompt.tolist(), 0, range(cache.num_pages))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--compute-device", default="0")
    ap.add_argument("--copy-to", default="1")
    ap.add_argument("--work", choices=["gemm", "prefill"], default="gemm")
    ap.add_argument("--gemms", type=int, default=200)
    ap.add_argument("--model", default="llama-3.1-8b")
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--layer-mib", type=int, default=128, help="32k tokens of Llama-3.1-8B")
    ap.add_argument("--ways", default=",".join(WAYS), help=f"comma-separated, of {WAYS}")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    dev, dst_dev = resolve_device(args.compute_device), resolve_device(args.copy_to)
    torch.cuda.set_device(dev)
    ways = [w for w in args.ways.split(",") if w]
    if unknown := set(ways) - set(WAYS):
        ap.error(f"unknown copy ways {sorted(unknown)}; known: {', '.join(WAYS)}")
    layers, nbytes = args.layers, args.layer_mib << 20
    if args.work == "prefill":
        runner, seq = prefill_work(dev, args.model, args.tokens)
        layers = runner.model.spec.layers
        nbytes = args.tokens * runner.model.spec.kv_bytes_per_token_per_layer("bf16")
        what = f"prefill of {args.tokens} tokens, {args.model} x{layers}"
    else:
        work = gemm_work(dev, args.gemms)
        what = f"{args.gemms} GEMMs of 8192^3 bf16"
    copier = Copier(dev, dst_dev, layers, nbytes)

    def run(way: str | None, with_work: bool = True) -> tuple[float, float]:
        """(work seconds, copies seconds), each timed by events on its own stream."""
        torch.cuda.synchronize(dev)
        w0, w1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        c0, c1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        if way and not (with_work and args.work == "prefill"):
            c0.record(copier.stream(way))
            copier.post(way, range(layers))
            c1.record(copier.stream(way))
        w0.record()
        if with_work and args.work == "prefill":
            before, posted = runner.counter.read(), 0
            layer_q: queue.Queue[int] = queue.Queue()
            with LayerWatcher(runner.counter, layer_q.put, 250e-6):  # as the prefill server
                runner.step([seq])
                w1.record()
                while posted < layers:  # post each layer's copy as the counter passes it
                    done = min(layer_q.get(timeout=60) - before, layers)
                    if way and done > posted:
                        if posted == 0:
                            c0.record(copier.stream(way))
                        copier.post(way, range(posted, done))
                        if done == layers:
                            c1.record(copier.stream(way))
                    posted = max(posted, done)
        else:
            if with_work:
                work()
            w1.record()
        torch.cuda.synchronize(dev)
        torch.cuda.synchronize(dst_dev)
        copy_s = c0.elapsed_time(c1) / 1e3 if way else 0.0
        return (w0.elapsed_time(w1) / 1e3 if with_work else 0.0), copy_s

    results: dict[str, dict[str, float]] = {}
    alone: list[float] = []
    run(None)  # warm-up (kernels, plans)
    for way in ways:
        run(way, with_work=False)
        copies_alone = statistics.median(run(way, False)[1] for _ in range(args.repeats))
        run(way)
        times = [run(way) for _ in range(args.repeats)]
        mine = [run(None)[0] for _ in range(args.repeats)]  # the work alone, right after
        alone += mine
        results[way] = {
            "work_s": statistics.median(t[0] for t in times),
            "work_alone_s": statistics.median(mine),
            "copy_span_s": statistics.median(t[1] for t in times),
            "copy_alone_s": copies_alone,
        }
    base = statistics.median(alone)
    total = layers * nbytes
    lines = [
        f"compute {dev} ({torch.cuda.get_device_name(dev)}), copies to {dst_dev}: {what}; "
        f"{layers} copies of {nbytes / 2**20:.0f} MiB; work alone {1e3 * base:.2f} ms (median of "
        f"{len(alone)}, spread {1e3 * (max(alone) - min(alone)):.2f} ms)",
        "",
        "| copies | work with copies (ms) | slower than alone (ms) | copies alone (GB/s) |",
        "| --- | ---: | ---: | ---: |",
    ]
    for way, r in results.items():
        lines.append(
            f"| {way} | {1e3 * r['work_s']:.2f} | {1e3 * (r['work_s'] - r['work_alone_s']):.2f} | "
            f"{total / r['copy_alone_s'] / 1e9:.0f} |"
        )
    md = "\n".join(lines) + "\n"
    args.out.mkdir(parents=True, exist_ok=True)
    stem = f"copy_overlap_{args.work}_{dev.index}_{dst_dev.index}"
    (args.out / f"{stem}.md").write_text(md)
    (args.out / f"{stem}.json").write_text(
        json.dumps(
            {"date": time.strftime("%Y-%m-%d %H:%M"), "alone_s": alone, "results": results},
            indent=1,
        )
    )
    print(md)


if __name__ == "__main__":
    main()

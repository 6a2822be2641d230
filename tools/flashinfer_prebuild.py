"""Build the FlashInfer kernels a run needs once, before several processes load them.

    python tools/flashinfer_prebuild.py [--models llama-3.1-8b,deepseek-v3,llama-3.1-8b@fa3]

FlashInfer 0.6.0 JIT-compiles each kernel module on first use with ninja in one shared build
directory; two processes building at once (a prefill and a decode server starting together)
overwrite each other's ninja records, and every later process rebuilds. This script builds each
model's modules in a child process with its own FLASHINFER_WORKSPACE_BASE (children in
parallel), running one prefill pass and one CUDA-graph decode pass of a one-layer model of the
same shapes, then copies every built library to FlashInfer's AOT directory, where later
processes load it without ninja.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def warm(model: str, page_size: int) -> None:
    """Child: one prefill and one graph decode pass of a one-layer `model` (builds its kernels).
    `model@a+b` runs only the decode pass, with each of a, b: a decode kernel
    (`--attention flashinfer:KERNEL`) or `fused` (model.FUSED_OPS, on by default: only useful with
    DISAGG_FUSED_OPS=0 in the environment)."""
    from disagg.core.kvcache import pages_for
    from disagg.hw import model as model_mod
    from disagg.hw.batch import Seq
    from disagg.hw.model import Transformer
    from disagg.hw.runner import Runner
    from disagg.models import get_model

    model, _, kernel = model.partition("@")
    choice = "auto"
    for part in kernel.split("+") if kernel else ():
        if part == "fused":
            model_mod.FUSED_OPS = True
        else:
            choice = f"flashinfer:{part}"
    spec = get_model(model).with_layers(1)
    net = Transformer(spec, device="cuda")
    for layout in ("HND", "NHD"):
        if spec.attention == "mla" and layout == "NHD":
            continue
        pages = range(pages_for(49, page_size))  # 40 + 8 + 1 tokens
        cache = net.new_cache(len(pages) + 8, page_size, layout)
        runner = Runner(net, cache, attention=choice, graph_batches=(1,))
        if not kernel:  # a decode kernel alone needs no prefill pass
            runner.step([Seq.of(range(40), 0, pages)])
            runner.step([Seq.of(range(8), 40, pages)])
        runner.step([Seq.of([1], 48, pages)], sample=True)
    print(f"{model}{'@' + kernel if kernel else ''}: kernels built", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--models",
        default="llama-3.1-8b,deepseek-v3",
        help="comma-separated; MODEL@KERNEL also builds that GQA decode kernel (fa2, cuda-cores, "
        "fa3), MODEL@fused FlashInfer's fused norm, activation and RoPE kernels",
    )
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--warm", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.warm:
        warm(args.warm, args.page_size)
        return
    import flashinfer

    aot = Path(flashinfer.__file__).parent / "data" / "aot"
    base = Path(tempfile.mkdtemp(prefix="fi-ws-"))
    start = time.perf_counter()
    children = []
    for model in args.models.split(","):
        env = {**os.environ, "FLASHINFER_WORKSPACE_BASE": str(base / model)}
        cmd = [sys.executable, __file__, "--warm", model, "--page-size", str(args.page_size)]
        children.append((model, subprocess.Popen(cmd, env=env)))
    failed = [m for m, p in children if p.wait() != 0]
    for so in base.rglob("cached_ops/*/*.so"):
        dest = aot / so.parent.name / so.name
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(so, dest)
        print(f"aot: {so.parent.name}")
    print(f"prebuild: {time.perf_counter() - start:.0f} s, failed: {failed or 'none'}")
    if failed:
        sys.exit(1)


if __name__ == "__main__":
    main()

"""A pass with a prompt chunk launched op by op against in pieces (hw.latency.prefill_graphs):
its launch, device and wall time by the pass's tokens, a chunk alone or with decode rows.

    python benchmarks/prefill_pieces.py --device 0 --out DIR
    python benchmarks/prefill_pieces.py --device cpu --model tiny-gqa --tokens 16,64 \
        --decodes 0,3 --repeats 2 --out DIR      # a dry run without a GPU (pieces uncaptured)

Why: an eager Llama-3.1-8B forward takes the host 11-31 ms to launch on an H200, as long as a
chunk of 400 tokens takes the device, so small chunks wait on their launch
(benchmarks/results/2026-12-05b-gpu/). Each mode runs on a runner of its own over the same
weights, without the layer counter, as a colocated server: `eager`, and `pieces` with the
passes' sizes as its own. A pass of T tokens with d decode rows carries a chunk of T - d, as a
server fills its token budget. Launch: the host from the forward's first launch to its last
(`Runner.launched`); device: CUDA events around it (NaN on the CPU); wall: the step, its greedy
tokens read back. Medians of `--repeats` after `--warmup`. The two modes' greedy tokens are
compared on every pass.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from pathlib import Path

import torch

from disagg.core.kvcache import pages_for
from disagg.hw.batch import Seq
from disagg.hw.device import resolve_device
from disagg.hw.model import Transformer
from disagg.hw.profile import _prompt, decode_seqs
from disagg.hw.runner import Runner
from disagg.models import get_model

MODES = ("eager", "pieces")
PAGE = 16
CONTEXT = 1024  # each decode row's cached tokens


def ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v]


def time_pass(runner: Runner, batch: list[Seq]) -> tuple[dict[str, float], list[int]]:
    """One pass of `batch`: launch, device and wall seconds, and its greedy tokens."""
    began = time.perf_counter()
    out = runner.step(batch, sample=True)
    wall = time.perf_counter() - began
    start, end = runner.launched()
    assert out.tokens is not None
    return {"launch": end - start, "device": runner.device_s(), "wall": wall}, out.tokens


def median(values: list[float]) -> float:
    return math.nan if any(math.isnan(v) for v in values) else statistics.median(values)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="0")
    ap.add_argument("--model", default="llama-3.1-8b")
    ap.add_argument("--tokens", type=ints, default=[128, 256, 512, 1024, 2048])
    ap.add_argument("--decodes", type=ints, default=[0, 16], help="decode rows of a pass")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--out", type=Path, default=Path("runs/prefill_pieces"))
    args = ap.parse_args()
    dev = resolve_device(args.device)
    spec = get_model(args.model)
    model = Transformer(spec, seed=0, device=str(dev))
    most = max(args.decodes)
    if most >= min(args.tokens):
        raise SystemExit(f"--decodes {most}: a pass of {min(args.tokens)} tokens holds fewer")
    pages = most * pages_for(CONTEXT + 1, PAGE) + pages_for(max(args.tokens), PAGE)
    # as a colocated server runs its passes (and the profile): no layer counter
    runners = {
        mode: Runner(
            model,
            model.new_cache(pages, PAGE),
            graph_batches=(),
            count_layers=False,
            prefill_graphs=args.tokens if mode == "pieces" else (),
        )
        for mode in MODES
    }
    began = time.perf_counter()
    runners["pieces"].capture_pieces()
    capture_s = time.perf_counter() - began
    rows, differ = [], 0
    for n in args.tokens:
        for d in args.decodes:
            decodes = decode_seqs([CONTEXT] * d, PAGE, spec.vocab)
            first = decodes[-1].pages[-1] + 1 if d else 0
            chunk = _prompt(n - d, 0, PAGE, spec.vocab, first=first)
            batch = [chunk, *decodes]
            times: dict[str, list[dict[str, float]]] = {m: [] for m in MODES}
            for k in range(args.warmup + args.repeats):
                tokens = {}
                for mode in MODES:
                    t, tokens[mode] = time_pass(runners[mode], batch)
                    if k >= args.warmup:
                        times[mode].append(t)
                differ += tokens["eager"] != tokens["pieces"]
            for mode in MODES:
                ms = {p: median([t[p] for t in times[mode]]) * 1e3 for p in times[mode][0]}
                rows.append({"mode": mode, "tokens": n, "decodes": d, **ms})
    in_pieces = runners["pieces"].passes_in_pieces
    args.out.mkdir(parents=True, exist_ok=True)
    lines = [
        "| tokens | decodes | launch eager / pieces | device eager / pieces | "
        "wall eager / pieces | wall pieces/eager |",
        "|---:|---:|---|---|---|---:|",
    ]
    for e, p in zip(rows[::2], rows[1::2], strict=True):
        lines.append(
            f"| {e['tokens']} | {e['decodes']} | {e['launch']:.2f} / {p['launch']:.2f} | "
            f"{e['device']:.2f} / {p['device']:.2f} | {e['wall']:.2f} / {p['wall']:.2f} | "
            f"{p['wall'] / e['wall']:.3f} |"
        )
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    md = (
        f"# prefill_pieces {time.strftime('%Y-%m-%d %H:%M')}\n\n"
        f"- device: {name}; {spec.name}, {spec.layers} layers; decode rows at {CONTEXT} "
        f"tokens of context; medians of {args.repeats} after {args.warmup}, in ms\n"
        f"- pieces: sizes {args.tokens}, captured in {capture_s:.2f} s; {in_pieces} passes "
        f"ran in them; greedy tokens differed on {differ} passes of "
        f"{len(args.tokens) * len(args.decodes) * (args.warmup + args.repeats)}\n\n"
        + "\n".join(lines)
        + "\n"
    )
    (args.out / "prefill_pieces.md").write_text(md)
    summary = {"rows": rows, "capture_s": capture_s, "passes_in_pieces": in_pieces}
    summary["differ"] = differ
    (args.out / "prefill_pieces.json").write_text(json.dumps(summary) + "\n")
    print(md)


if __name__ == "__main__":
    main()

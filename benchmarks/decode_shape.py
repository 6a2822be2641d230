"""Does a decode pass cost what the profile's line says, at the contexts a server sees?

    python benchmarks/decode_shape.py --model llama-3.1-8b --device cuda:0 --out DIR

The profile (`disagg hw profile`) times decode passes of `batch` sequences that all have one
context, at two contexts, and the cost model draws a line through them per batch:
a(batch) + b * total context. A serving run's batches differ from that in three ways, and this
times each beside the profile's own points, in one run, with the same Runner (CUDA graphs):
- `uniform`: every sequence at one context, at the profile's two and between them (is the
  time linear in context?);
- `spread`: contexts drawn evenly between the two (seeded), as prompts of different lengths
  give (does the longest sequence set the time, rather than the total?);
- `scattered`: the same contexts on pages shuffled over the cache, as a pool hands them out
  after a while (does locality matter?).
Batches between powers of two replay the next power's graph (`--batches` mixes both).
Writes decode_shape.csv (batch, shape, context_mean, context_max, device_ms, line_ms) and
decode_shape.md: each pass against the line through that batch's uniform passes at the two
ends (line_ms), and against the line of the next power of two (its graph). `--smoke` runs a
toy model on the CPU (wall time, no graphs).
"""

from __future__ import annotations

import argparse
import random
import statistics
from pathlib import Path

import pandas as pd

from disagg.core.kvcache import pages_for
from disagg.hw.device import resolve_device
from disagg.hw.model import Transformer
from disagg.hw.profile import _time_step, decode_seqs
from disagg.hw.runner import GRAPH_BATCHES, Runner, graph_batch_for
from disagg.models import MODELS, get_model


def contexts(shape: str, batch: int, lo: int, hi: int, rng: random.Random) -> list[int]:
    """Each sequence's cached tokens: `uniform:C` all at C, else drawn evenly in [lo, hi]."""
    if shape.startswith("uniform:"):
        return [int(shape.split(":")[1])] * batch
    return [rng.randint(lo, hi) for _ in range(batch)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default="llama-3.1-8b", choices=sorted(MODELS))
    ap.add_argument("--layers", type=int, default=0, help="0: all of the model's")
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--batches", default="16,25,32,50,64")
    ap.add_argument("--lo", type=int, default=294, help="the profile's shorter context")
    ap.add_argument("--hi", type=int, default=4295, help="the profile's longer context")
    ap.add_argument("--mid", default="1024,2200", help="uniform contexts between lo and hi")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--smoke", action="store_true", help="a toy model on the CPU")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    spec = get_model(args.model)
    layers = args.layers or spec.layers
    if args.smoke:
        args.device, layers, args.repeats = "cpu", 1, 2
        args.batches, args.lo, args.hi, args.mid = "2,3,4", 8, 40, "20"
    batches = [int(b) for b in args.batches.split(",")]
    mids = [int(c) for c in args.mid.split(",") if c]
    dev = resolve_device(args.device)
    page_size, vocab = 16, spec.vocab
    model = Transformer(spec.with_layers(layers), seed=args.seed, device=dev)
    num_pages = max(batches) * pages_for(args.hi + 1, page_size)
    cache = model.new_cache(num_pages, page_size, "HND")
    runner = Runner(model, cache)
    shapes = [f"uniform:{c}" for c in (args.lo, *mids, args.hi)] + ["spread", "scattered"]
    rows = []
    for b in batches:
        rng = random.Random(args.seed * 1000 + b)
        drawn = contexts("spread", b, args.lo, args.hi, rng)
        for shape in shapes:
            ctx = drawn if shape in ("spread", "scattered") else contexts(shape, b, 0, 0, rng)
            pages = list(range(num_pages))
            if shape == "scattered":
                random.Random(args.seed).shuffle(pages)
            device_s, _ = _time_step(
                runner,
                decode_seqs(ctx, page_size, vocab, pages),
                dev,
                3,
                args.repeats,
                statistics.median,
            )
            rows.append((b, shape, sum(ctx) / b, max(ctx), device_s * 1e3))
    df = pd.DataFrame(rows, columns=["batch", "shape", "context_mean", "context_max", "device_ms"])
    df["line_ms"] = [line(df, b, c) for b, c in zip(df.batch, df.context_mean, strict=True)]
    graph = [graph_batch_for(GRAPH_BATCHES, b) for b in df.batch]
    df["graph_line_ms"] = [
        line(df, g, c) if g in set(df.batch) else float("nan")
        for g, c in zip(graph, df.context_mean, strict=True)
    ]
    args.out.mkdir(parents=True, exist_ok=True)
    df.to_csv(args.out / "decode_shape.csv", index=False)
    table = df.assign(
        over_line=df.device_ms / df.line_ms, over_graph_line=df.device_ms / df.graph_line_ms
    ).round(4)
    where = "CPU (wall time)" if dev.type == "cpu" else str(dev)
    (args.out / "decode_shape.md").write_text(
        f"# Decode passes by shape: {args.model}, {layers} layers, {where}\n\n"
        f"Medians of {args.repeats} passes. line: the line through this batch's uniform passes "
        f"at {args.lo} and {args.hi} tokens, at the mean context; graph line: the same for the "
        "batch of the graph it replays.\n\n" + table.to_markdown(index=False) + "\n"
    )
    print(table.to_string(index=False))


def line(df: pd.DataFrame, batch: int, context: float) -> float:
    """The profile's line for `batch`: through its uniform passes at the two end contexts."""
    ends = df[(df.batch == batch) & df["shape"].str.startswith("uniform:")]
    lo, hi = ends.iloc[0], ends.iloc[-1]
    w = (context - lo.context_mean) / (hi.context_mean - lo.context_mean)
    return float(lo.device_ms + w * (hi.device_ms - lo.device_ms))


if __name__ == "__main__":
    main()

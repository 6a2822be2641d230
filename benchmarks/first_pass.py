"""Where a decode pass's host time goes: a request's first pass after the decoder sat idle,
against the passes that follow (one process, one GPU: CUDA graphs and FlashInfer).

    python benchmarks/first_pass.py --device 0 --out DIR
    python benchmarks/first_pass.py --device cpu --model tiny-gqa --prompt 64 --idle-s 0.05 \
        --out DIR        # a dry run without a GPU (no graphs: the parts read n/a)

Why: a request's first decode pass is on TTFT's path, and any host time it spends beyond a
steady pass's (same device time) adds to TTFT. This times a pass's parts (the batch's metadata,
`prepare`: attention plan and inputs, `replay`: the graph's launch, the tail: sampling, which
waits for the device) under three conditions, in turn: a new request after idling (what the
decoder does), the same request after idling, and a new request at once. Each request's KV is
written by a prefill pass on this runner."""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections import defaultdict
from pathlib import Path

import torch

from disagg.core.kvcache import pages_for
from disagg.hw import runner as runner_mod
from disagg.hw.batch import Seq
from disagg.hw.device import resolve_device
from disagg.hw.model import Transformer
from disagg.hw.runner import Runner
from disagg.models import get_model

PARTS = ("prepare", "replay")
CONDITIONS = ("new request after idling", "same request after idling", "new request at once")


def timed(parts: dict[str, float]) -> None:
    """Time the graph's prepare and replay of every step into `parts` (seconds, last call)."""
    graph = runner_mod._DecodeGraph
    for name in PARTS:
        original = getattr(graph, name)

        def wrapper(self, *a, _f=original, _n=name):  # type: ignore[no-untyped-def]
            t = time.perf_counter()
            out = _f(self, *a)
            parts[_n] = time.perf_counter() - t
            return out

        setattr(graph, name, wrapper)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="0")
    ap.add_argument("--model", default="llama-3.1-8b")
    ap.add_argument("--prompt", type=int, default=2048)
    ap.add_argument("--idle-s", type=float, default=0.5)
    ap.add_argument("--repeats", type=int, default=12)
    ap.add_argument("--later", type=int, default=7, help="passes after the first, per request")
    ap.add_argument("--out", type=Path, default=Path("runs/first_pass"))
    args = ap.parse_args()
    dev = resolve_device(args.device)
    spec = get_model(args.model)
    model = Transformer(spec, seed=0, device=str(dev))
    page = 16
    per = pages_for(args.prompt + 2 * (args.later + 1), page)  # same request: twice decoded
    slots = 4  # requests' page sets, used in turn
    runner = Runner(model, model.new_cache(slots * per, page))
    if dev.type == "cuda":
        runner.capture([1])
    parts: dict[str, float] = {}
    timed(parts)
    rows: dict[str, list[dict[str, float]]] = defaultdict(list)
    gen = torch.Generator().manual_seed(0)

    def new_request(k: int) -> list[int]:
        """Prefill request k's prompt into its pages; return its tokens so far."""
        tokens = torch.randint(0, spec.vocab, (args.prompt,), generator=gen).tolist()
        pages = range((k % slots) * per, (k % slots + 1) * per)
        runner.step([Seq.of(tokens, 0, pages)])
        runner.device_s()  # waits for the prefill
        return tokens

    def decode(k: int, tokens: list[int], label: str | None) -> None:
        pages = range((k % slots) * per, (k % slots + 1) * per)
        parts.clear()
        t = time.perf_counter()
        last = tokens[-1]
        out = runner.step([Seq.of([last], len(tokens) - 1, pages)], sample=True)
        wall = time.perf_counter() - t
        assert out.tokens is not None
        tokens.append(out.tokens[0])
        if label is not None:
            device = runner.device_s()
            row = {"wall": wall, "device": device, "host": wall - device}
            row |= {p: parts.get(p, float("nan")) for p in PARTS}
            row["tail and rest"] = wall - sum(parts.get(p, 0.0) for p in PARTS)
            rows[label].append(row)

    k = 0
    for _ in range(args.repeats):
        for cond in CONDITIONS:
            if cond != "same request after idling":
                k += 1
                tokens = new_request(k)
            if cond != "new request at once":
                time.sleep(args.idle_s)
            decode(k, tokens, cond)
            for _ in range(args.later):
                decode(k, tokens, "later passes" if cond == CONDITIONS[0] else None)
    table = {
        label: {part: statistics.median(r[part] for r in rs) * 1e3 for part in rs[0]}
        for label, rs in rows.items()
    }
    args.out.mkdir(parents=True, exist_ok=True)
    head = ["condition", *next(iter(table.values()))]
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for label, ms in table.items():
        lines.append(f"| {label} | " + " | ".join(f"{v:.3f}" for v in ms.values()) + " |")
    md = (
        f"# first_pass {time.strftime('%Y-%m-%d %H:%M')}\n\n"
        f"- device: {torch.cuda.get_device_name(dev) if dev.type == 'cuda' else 'cpu'}; "
        f"{spec.name}, {spec.layers} layers; prompt {args.prompt}; idle {args.idle_s} s; "
        f"{args.repeats} requests per condition; medians in ms\n\n" + "\n".join(lines) + "\n"
    )
    (args.out / "first_pass.md").write_text(md)
    (args.out / "first_pass.json").write_text(json.dumps({"ms": table, "n": args.repeats}) + "\n")
    print(md)


if __name__ == "__main__":
    main()

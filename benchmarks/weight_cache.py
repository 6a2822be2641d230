"""How long a server takes to make its model's weights: drawn, or read from hw.weight_cache.

    python benchmarks/weight_cache.py [--model llama-3.1-8b] [--layers 2] [--dtype bf16]
                                      [--device cpu] [--repeats 3] [--out DIR]

Builds the catalogue model (cut to `--layers` layers, so that it fits this machine's memory)
three ways, each `--repeats` times, in one process: drawn with no cache; drawn and written
to an empty cache directory; read back from that directory (its files in the page cache, as for
a validate's second server onward). Prints the median seconds of each, and their ratio to the
draw; writes weight_cache.csv with `--out`.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import pandas as pd
import torch

from disagg.hw.model import Transformer
from disagg.models import get_model

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def build_s(args: argparse.Namespace, cache: Path | None) -> float:
    began = time.perf_counter()
    model = Transformer(
        get_model(args.model).with_layers(args.layers),
        device=args.device,
        dtype=DTYPES[args.dtype],
        weight_cache=None if cache is None else str(cache),
    )
    if model.device.type == "cuda":
        torch.cuda.synchronize(model.device)
    took = time.perf_counter() - began
    del model
    return took


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default="llama-3.1-8b")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    times: dict[str, list[float]] = {"drawn": [], "drawn and written": [], "read": []}
    root = Path(tempfile.mkdtemp(prefix="weight-cache-"))
    try:
        for _ in range(args.repeats):
            times["drawn"].append(build_s(args, None))
            shutil.rmtree(root / "w", ignore_errors=True)
            times["drawn and written"].append(build_s(args, root / "w"))
            times["read"].append(build_s(args, root / "w"))
        gib = sum(p.stat().st_size for p in (root / "w").glob("*.bin")) / 2**30
    finally:
        shutil.rmtree(root, ignore_errors=True)
    base = statistics.median(times["drawn"])
    rows = [
        {
            "model": args.model,
            "layers": args.layers,
            "dtype": args.dtype,
            "device": args.device,
            "gib": round(gib, 2),
            "how": how,
            "median_s": round(statistics.median(ts), 3),
            "of_drawn": round(statistics.median(ts) / base, 3),
            "repeats": len(ts),
        }
        for how, ts in times.items()
    ]
    df = pd.DataFrame(rows)
    print(df.to_string(index=False))
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        df.to_csv(args.out / "weight_cache.csv", index=False)


if __name__ == "__main__":
    main()

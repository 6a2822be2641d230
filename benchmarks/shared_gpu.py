"""How the two servers of a disaggregated run on one GPU slow each other: each decode pass's
length over the median of its batch size's passes that met no prefill pass, by how much of it a
prefill pass overlapped, and the prefill passes' lengths (and launch) by chunk tokens.

Given run directories (a steps.parquet each) or validate directories (their hw/disagg-* runs),
it reads them. Given `--run EXPERIMENT`, it first runs the experiment's disaggregated twin on
one GPU (`--device`) once for each variant of `--variants` (of `VARIANTS`: the prefill passes
eager or in pieces, the KV sent layer by layer or whole after the pass), each on the same
workload, into `--out`/VARIANT, and reads those:

    python benchmarks/shared_gpu.py /tmp/v/validate-llama8-overlap /tmp/h/validate-pieces8k
    python benchmarks/shared_gpu.py --run experiments/llama8b-h200.toml --device cuda:0 \\
        --rate 5.4 --requests 64 --out runs/shared-gpu

Prints the tables, and writes them to shared_gpu.md under `--out` if given.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import pandas as pd

OVERLAP = [-0.01, 0, 0.5, 0.99, 1.0]  # share of a decode pass that a prefill pass overlapped
OVERLAP_LABELS = ["none", "<= 1/2", "1/2-0.99", "all"]
TOKENS = [0, 512, 1024, 1600, 2047, 2048]
PIECES = "hw.latency.prefill_graphs=[256,512,1024,2048]"
VARIANTS = {  # name: overrides of the disaggregated twin
    "eager-layerwise": [],
    "eager-whole": ["transfer.policy=whole"],
    "pieces-layerwise": [PIECES],
    "pieces-whole": [PIECES, "transfer.policy=whole"],
}


def covered(starts: np.ndarray, ends: np.ndarray, by: pd.DataFrame) -> np.ndarray:
    """Per pass [start, end), the share of it that the passes of `by` overlap."""
    a, b = by.start_s.to_numpy()[None, :], by.end.to_numpy()[None, :]
    inside = np.clip(np.minimum(ends[:, None], b) - np.maximum(starts[:, None], a), 0, None)
    return inside.sum(axis=1) / (ends - starts)


def runs_of(paths: list[Path]) -> list[Path]:
    """The run directories of `paths`: each one itself, or a validate's disaggregated runs."""
    out = []
    for p in paths:
        out += [p] if (p / "steps.parquet").exists() else sorted((p / "hw").glob("disagg-*"))
    return out


def tables(runs: list[Path]) -> str:
    """The two tables of the module doc, in markdown, a row group per run."""
    decode_rows, prefill_rows = [], []
    for run in runs:
        name = f"{run.parent.parent.name}/{run.name}" if run.parent.name == "hw" else run.name
        steps = pd.read_parquet(run / "steps.parquet")
        steps = steps.assign(end=steps.start_s + steps.duration_s)
        chunks = steps[steps.prefill_tokens > 0]
        decodes = steps[(steps.prefill_tokens == 0) & (steps.decode_seqs > 0)]
        share = covered(decodes.start_s.to_numpy(), decodes.end.to_numpy(), chunks)
        alone = decodes[share == 0].groupby("batch_size").duration_s.median()
        slowed = decodes.duration_s / decodes.batch_size.map(alone)
        by = pd.cut(share, OVERLAP, labels=OVERLAP_LABELS)
        for label, group in slowed.groupby(by, observed=True):
            decode_rows.append(
                {"run": name, "prefill overlap": label, "passes": len(group),
                 "length / alone": group.median()}
            )  # fmt: skip
        for label, group in chunks.groupby(pd.cut(chunks.tokens, TOKENS), observed=True):
            prefill_rows.append(
                {"run": name, "chunk tokens": str(label), "passes": len(group),
                 "length ms": 1e3 * group.duration_s.median(),
                 "launch ms": 1e3 * group.launch_s.median()}
            )  # fmt: skip
    return "\n".join(
        [
            "Decode passes: length over their batch's passes alone (median)\n",
            pd.DataFrame(decode_rows).round(2).to_markdown(index=False),
            "\nPrefill passes beside the decode server (median)\n",
            pd.DataFrame(prefill_rows).round(1).to_markdown(index=False),
        ]
    )


def run_variants(args: argparse.Namespace) -> list[Path]:
    """The experiment's disaggregated twin on one GPU, once per variant (module doc)."""
    from disagg.config import load_experiment
    from disagg.hw.driver import hw_experiment, run_hw
    from disagg.validate_plan import other_mode

    exp = load_experiment(args.run)
    twin = exp if exp.cluster.mode == "disagg" else other_mode(exp)
    base = [
        f"workload.rate_per_s={args.rate}",
        f"workload.num_requests={args.requests}",
        f"kv.pages={args.pages}",
        f"hw.prefill_device={args.device}",
        f"hw.decode_device={args.device}",
        "hw.wire=cuda" if args.device.startswith("cuda") else "hw.wire=tcp",
    ]
    out = []
    for name in args.variants.split(","):
        if name not in VARIANTS:
            raise SystemExit(f"--variants: {name!r} is not one of {', '.join(VARIANTS)}")
        where = args.out / name
        run = hw_experiment(twin.updated(*base, *VARIANTS[name]), gpus=1)
        summary, _ = run_hw(run, where)
        print(f"{name}: TTFT p50 {summary['ttft_s_p50'] * 1e3:.1f} ms", flush=True)
        out.append(where)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("dirs", nargs="*", type=Path, help="run or validate directories to read")
    p.add_argument("--run", type=Path, help="an experiment whose disaggregated twin to run")
    p.add_argument("--device", default="cuda:0")
    p.add_argument("--rate", type=float, default=5.4, help="requests/s")
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--pages", type=int, default=8192, help="KV pages a server")
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    if args.run is not None and args.out is None:
        raise SystemExit("--run needs --out")
    runs = runs_of(args.dirs) + (run_variants(args) if args.run is not None else [])
    if not runs:
        raise SystemExit("no runs: give run or validate directories, or --run")
    text = tables(runs)
    print(text)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "shared_gpu.md").write_text(text + "\n")


if __name__ == "__main__":
    main()

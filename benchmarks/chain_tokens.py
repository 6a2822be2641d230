"""Do chained passes (`hw.latency.chain`) give the tokens of passes run one by one, on a GPU,
with the experiment's own model and kernels? Each mode of the experiment (its own, then the
other) runs once without and once with chaining, on the same workload; every request's output
tokens must be the same. Writes `chain_tokens.md` (per mode: requests, those with the same
tokens, chained passes of the decoding servers' passes, their TPOT p50) and each run under
OUT/MODE-chain-{false,true}; exits 1 if any request's tokens differ.

    python benchmarks/chain_tokens.py experiments/qwen3moe-h200-colocated.toml --out runs/chain \\
        --set workload.num_requests=24 --set workload.rate_per_s=8
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pandas as pd

from disagg.config import load_experiment
from disagg.hw.driver import run_hw
from disagg.validate_plan import other_mode


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("experiment", type=Path)
    ap.add_argument("--out", type=Path, default=Path("runs/chain"))
    ap.add_argument("--set", action="append", default=[], dest="sets", metavar="KEY=VALUE")
    args = ap.parse_args()
    base = load_experiment(args.experiment, args.sets)
    lines = [
        "# Chained passes against passes run one by one",
        "",
        "| mode | requests | same tokens | chained passes | TPOT p50 ms, one by one | chained |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    differ = 0
    for exp in (base, other_mode(base)):
        mode = exp.cluster.mode
        tokens, tpot, chained = {}, {}, ""
        for chain in (False, True):
            out = args.out / f"{mode}-chain-{str(chain).lower()}"
            _, state = run_hw(exp.updated(f"hw.latency.chain={str(chain).lower()}"), out)
            tokens[chain] = {i: f.tokens for i, f in state.finished.items()}
            tpot[chain] = pd.read_parquet(out / "requests.parquet").tpot_s.median() * 1e3
            steps = pd.read_parquet(out / "steps.parquet")
            gen = steps[steps.node != "prefill0"]
            chained = f"{int(gen.chained.sum())} of {int(gen.steps.sum())}"
        same = sum(tokens[True].get(i) == t for i, t in tokens[False].items())
        differ += len(tokens[False]) - same + abs(len(tokens[True]) - len(tokens[False]))
        row = f"| {mode} | {len(tokens[False])} | {same} | {chained} | {tpot[False]:.3f} |"
        lines.append(f"{row} {tpot[True]:.3f} |")
    text = "\n".join(lines) + "\n"
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "chain_tokens.md").write_text(text)
    print(text)
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())

"""Where a server's serving loop spends its time, from a py-spy sample of a `disagg hw run`.

    py-spy record --subprocesses --idle --nonblocking --format raw -r 250 -o raw.txt -- \\
        disagg hw run EXP.toml --out RUN
    python benchmarks/pyspy_host.py raw.txt --rate 250 [--run RUN] [--top 30] [--out FILE]

py-spy's raw format is one line per distinct stack: its frames from the outermost, separated by
";", then the number of samples. This keeps the server processes' stacks (those under
`Server.run`) and tables, in milliseconds per pass (samples / rate / the run's passes, from
RUN's steps table; per second of samples without `--run`):
- each function's inclusive time (every sample with it on the stack), and
- each line where a sample was taken (the innermost frame): a line that waits for the device
  (a `.tolist()` of its tokens, an event's synchronize) says so here.
With `--idle` a sample is taken whatever the thread does, so that a loop's samples add up to
its wall time (waits in a poll included). On a GPU, a pass's host time is its wall time less its
device time; these tables say which Python the host time is. Markdown on stdout, or into `--out`.
"""

from __future__ import annotations

import argparse
import re
from collections import Counter
from pathlib import Path

import pandas as pd

SERVER = "Server.run (disagg/hw/node.py"
LINE = re.compile(r":\d+\)$")


def server_samples(lines: list[str]) -> tuple[Counter[str], Counter[str], int]:
    """(inclusive samples by function, samples by innermost line, all server samples)."""
    inclusive: Counter[str] = Counter()
    innermost: Counter[str] = Counter()
    total = 0
    for line in lines:
        stack, _, count = line.rstrip("\n").rpartition(" ")
        if SERVER not in stack or not count.isdigit():
            continue
        n, frames = int(count), stack.split(";")
        total += n
        innermost[frames[-1].strip()] += n
        for fn in {LINE.sub(")", f.strip()) for f in frames[frames_from(frames) :]}:
            inclusive[fn] += n
    return inclusive, innermost, total


def frames_from(frames: list[str]) -> int:
    """The index of the server's own frame (those above it are the process's start)."""
    return next(i for i, f in enumerate(frames) if SERVER in f)


def table(counts: Counter[str], scale: float, total: int, top: int, what: str) -> str:
    rows = [f"| {what} | ms per pass | share |", "|---|---:|---:|"]
    for fn, n in counts.most_common(top):
        rows.append(f"| `{fn}` | {n * scale:.3f} | {n / total:.1%} |")
    return "\n".join(rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("raw", type=Path, help="py-spy record --format raw output")
    ap.add_argument("--rate", type=float, required=True, help="py-spy's samples per second")
    ap.add_argument("--run", type=Path, help="the run's directory (its passes)")
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    inclusive, innermost, total = server_samples(args.raw.read_text().splitlines())
    if not total:
        raise SystemExit(f"{args.raw}: no samples of a server's loop ({SERVER}...)")
    passes = len(pd.read_parquet(args.run / "steps.parquet")) if args.run else 0
    per = f"{passes} passes" if passes else "no run given: per second of samples"
    scale = 1e3 / args.rate / (passes or total / args.rate)
    text = "\n\n".join(
        [
            f"# Server loop by py-spy: {total} samples at {args.rate:g}/s, {per}",
            table(inclusive, scale, total, args.top, "function (inclusive)"),
            table(innermost, scale, total, args.top, "innermost line"),
        ]
    )
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()

"""How fast this machine's cores run one pure host workload, process by process and second by
second, with no GPU: what a server's serving loop gets from its host.

    python benchmarks/process_spread.py --procs 6 --windows 2 --window-s 2 [--cores 0,1] [--out F]

Runs `--procs` processes one after another, each pinned to `--cores` (a server's, by default),
every other one with PYTHONHASHSEED=0 (string hashing fixed; the others each their own, as
servers run). Each times the same work (`work`: objects, dicts, a sort and small torch CPU
tensors, as a batch is built) in `--windows` windows of `--window-s` seconds and reports its
passes per second in each; a line per process as it ends (on stdout and in `--out`), so a run
cut short keeps what it measured. On a lent GPU machine (one H100's host, 2026-12-05k) six
processes ran 27-36% apart and one process up to 46% apart from one window to the next, with no
steal the guest could see; on this project's CPU machine, 1.5%. `gpu_session.sh` runs it with
CPUSPREAD=1 (about a minute).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass


@dataclass
class Seq:
    req: int
    tokens: list[int]
    pages: list[int]
    name: str


def work(step: int) -> int:
    """One pass's worth of host work: build a batch of 48 sequences, its page table and
    positions as tensors, and pick the next."""
    import torch

    seqs = [Seq(i, list(range(i % 7 + 1)), list(range(i, i + 12)), f"req-{i}") for i in range(48)]
    by_name = {s.name: s for s in seqs}
    order = sorted(seqs, key=lambda s: (len(s.tokens), -s.req))
    pages = torch.tensor([p for s in order for p in s.pages], dtype=torch.int32)
    last = int(pages[-1])
    lens = torch.tensor([len(s.pages) for s in order], dtype=torch.int32)
    indptr = torch.cat(
        [torch.zeros(1, dtype=torch.int32), torch.cumsum(lens, 0, dtype=torch.int32)]
    )
    pos = torch.tensor([len(s.tokens) + step for s in order], dtype=torch.int64)
    return int(indptr[-1]) + int(pos.sum()) + len(by_name[f"req-{step % 48}"].pages) + last


def child(windows: int, window_s: float) -> None:
    work(0)  # imports, first allocations
    rates = []
    for _ in range(windows):
        n, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < window_s:
            work(n)
            n += 1
        rates.append(n / (time.perf_counter() - t0))
    print(json.dumps(rates))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--procs", type=int, default=8)
    ap.add_argument("--windows", type=int, default=3)
    ap.add_argument("--window-s", type=float, default=3.0)
    ap.add_argument("--cores", default="0,1")
    ap.add_argument("--out")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        os.sched_setaffinity(0, {int(c) for c in a.cores.split(",")})
        child(a.windows, a.window_s)
        return
    out = open(a.out, "w") if a.out else None  # noqa: SIM115 (written line by line)

    def say(line: str) -> None:
        print(line, flush=True)
        if out:
            out.write(line + "\n")
            out.flush()

    say("| process | PYTHONHASHSEED | passes/s by window | spread within |")
    say("|---:|---|---|---:|")
    means: dict[str, list[float]] = {"0": [], "random": []}
    for i in range(a.procs):
        env = dict(os.environ)
        seed = "0" if i % 2 else "random"
        env.pop("PYTHONHASHSEED", None)
        if seed == "0":
            env["PYTHONHASHSEED"] = "0"
        argv = [sys.executable, __file__, "--child", "--windows", str(a.windows)]
        argv += ["--window-s", str(a.window_s), "--cores", a.cores]
        done = subprocess.run(argv, env=env, capture_output=True, text=True, check=True)
        rates = json.loads(done.stdout)
        means[seed].append(statistics.mean(rates))
        within = max(rates) / min(rates) - 1
        say(f"| {i} | {seed} | {' / '.join(f'{r:.0f}' for r in rates)} | {within:.1%} |")
    for seed, m in means.items():
        if m:
            spread = max(m) / min(m) - 1
            say(
                f"\nPYTHONHASHSEED {seed}: process means {min(m):.0f}-{max(m):.0f} passes/s,"
                f" spread {spread:.1%}"
            )
    if out:
        out.close()


if __name__ == "__main__":
    main()

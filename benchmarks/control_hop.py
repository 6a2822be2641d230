"""One control-plane hop between two processes: how long a request takes to cross it.

    python benchmarks/control_hop.py --out DIR                  # any machine, no GPU
    python benchmarks/control_hop.py --prompts 16,2048 --count 50 --out DIR

gpu_ttft.py's hops table shows a request taking 0.6-0.8 ms to cross one ZeroMQ hop between
the servers on an H200 host, where encoding and decoding a 2k-token prompt take about 70 us.
This times the hop alone: a sender process sends `Submit` messages (the same encoding as the
servers'), spaced so that the receiver idles between them as a server does between requests;
the receiver stamps each on arrival, after decoding it. Both share the host's clock. For each
prompt length, the receiver waits as an idle server does (in its poll, up to 2 ms at a time)
or spins (`DISAGG_SPIN`), with and without a PM QoS request holding the host's cores out of
deep idle states (`DISAGG_CPU_LATENCY_US=0`, if the host allows it). Writes control_hop.md
and control_hop.json into --out: the median and 90th percentile one-way time of each case.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pandas as pd

from disagg.hw.control import Control
from disagg.hw.node import Submit, hold_cpu_latency


def receive(endpoints: Any, results: Any, count: int, spin: bool, latency: bool) -> None:
    if latency:
        hold_cpu_latency(0)
    control = Control("receiver")
    endpoints.put(control.endpoint)
    delays: list[float] = []
    while len(delays) < count:
        got = control.recv(0.0 if spin else 0.002)
        if got is not None:
            delays.append(time.time() - got[1].arrival_s)
    results.put(delays)
    control.close()


def one_case(prompt: int, count: int, spacing_s: float, spin: bool, latency: bool) -> list[float]:
    ctx = mp.get_context("spawn")
    endpoints, results = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=receive, args=(endpoints, results, count + 5, spin, latency))
    proc.start()
    control = Control("sender")
    control.connect("receiver", endpoints.get(timeout=60))
    tokens = tuple(range(prompt))
    for i in range(count + 5):  # the first five warm the path up and are left out
        time.sleep(spacing_s)
        control.send("receiver", Submit(i, time.time(), tokens, 8))
    delays = results.get(timeout=60)[5:]
    proc.join(10)
    control.close()
    return delays


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", default="16,2048,32768")
    ap.add_argument("--count", type=int, default=100)
    ap.add_argument("--spacing-s", type=float, default=0.05)
    ap.add_argument("--out", type=Path, default=Path("runs/control_hop"))
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    rows = []
    for latency in (False, True):
        for spin in (False, True):
            for prompt in (int(p) for p in args.prompts.split(",")):
                d = 1e3 * pd.Series(one_case(prompt, args.count, args.spacing_s, spin, latency))
                rows.append(
                    {
                        "prompt tokens": prompt,
                        "receiver": "spins" if spin else "waits in its poll",
                        "cpu latency held": latency,
                        "median (ms)": statistics.median(d),
                        "p90 (ms)": d.quantile(0.9),
                    }
                )
                print(rows[-1], flush=True)
    held = hold_cpu_latency(0)  # whether this host allows it (this process: stops at exit)
    table = pd.DataFrame(rows).round(3)
    host = subprocess.run(["uname", "-srm"], capture_output=True, text=True).stdout.strip()
    head = (
        f"control_hop.py, {time.strftime('%Y-%m-%d')}, host {host}, python {sys.version.split()[0]}"
        f", {args.count} messages per case {args.spacing_s * 1e3:g} ms apart; cpu latency "
        f"request: {held}\n\n"
    )
    (args.out / "control_hop.md").write_text(head + table.to_markdown(index=False) + "\n")
    (args.out / "control_hop.json").write_text(json.dumps(rows, indent=2) + "\n")
    print(head + table.to_markdown(index=False))


if __name__ == "__main__":
    main()

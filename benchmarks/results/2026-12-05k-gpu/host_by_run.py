"""Each server process of a validate, its serving loop's time per pass beside what its host
took from it during the run (`host_during_run`, from 8cd2050 on): whether a process whose loop
ran slow was one whose cores were taken by interrupts, the hypervisor or another process.

    python host_by_run.py VALIDATE_DIR [--out FILE.md]

Per server process (each run directory under hw*/ and calibration/, each node): its decode
passes' median loop time (wall less device, plus the gap to its next pass while it had work:
disagg.validate.busy_passes; on a shared GPU, of the passes that met no other node's) in three
batch ranges, and per second of the run its main
thread's forced context switches, its cores' time on others' work, interrupts and steal.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path

import pandas as pd

from disagg.validate import busy_passes, shares_gpu

RANGES = ((1, 16), (17, 32), (33, 64))


def rows(validate: Path) -> list[dict]:
    out = []
    for summary in sorted(validate.glob("*/**/summary.json")):
        run, said = summary.parent, json.loads(summary.read_text())
        if said.get("backend") != "hw":  # a replay
            continue
        steps, settings = pd.read_parquet(run / "steps.parquet"), said["node_settings"]
        timed = busy_passes(steps, alone=shares_gpu(run))  # on one GPU: the passes alone
        for node, passes in timed.groupby("node"):
            decode = passes[passes.prefill_tokens == 0]
            row = {"run": f"{run.parent.name}/{run.name}", "node": node}
            for lo, hi in RANGES:
                within = decode[decode.batch_size.between(lo, hi)]
                row[f"loop {lo}-{hi} ms"] = within.loop_s.median() * 1e3
                row[f"n {lo}-{hi}"] = len(within)
            used = settings.get(node, {}).get("host_during_run", {})
            wall = used.get("wall_s", float("nan"))
            row["cores"] = settings.get(node, {}).get("cores", "")
            row["cpu/s"] = (used.get("user_s", float("nan")) + used.get("system_s", 0)) / wall
            row["forced switches/s"] = used.get("main_switches_forced", float("nan")) / wall
            for key in ("others", "irq", "softirq", "steal"):
                row[f"{key} ms/s"] = used.get(f"cores_{key}_s", float("nan")) / wall * 1e3
            out.append(row)
    return out


def report(rows_of: Callable[[Path], list[dict]], doc: str) -> None:
    """A records script's command line: the table of `rows_of` a validate's directory, printed
    and, with --out, written as markdown."""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("validate", type=Path)
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    text = pd.DataFrame(rows_of(a.validate)).to_markdown(index=False, floatfmt=".3g")
    print(text)
    if a.out:
        a.out.write_text(text + "\n")


if __name__ == "__main__":
    report(rows, __doc__)

"""How much a colocated server's host time per pass varies from process to process, with its
threads where the OS puts them and pinned to cores of their own (`hw.latency.cores_per_server`).

Runs the experiment `--runs` times in each setting, alternating, each a fresh server with a
workload of its own seed (the same seeds in both settings), and fits each run's host time per
decode pass (wall less device) as validate's loop calibration does (`loop_costs`). Writes
`host_spread.csv` (a row per run) and `host_spread.md` (the median and spread per setting).

    python benchmarks/host_spread.py experiments/llama8b-h200.toml --device cuda:0 \\
        --runs 4 --rate 4.3 --requests 24 --cores 2 --out runs/host-spread
"""

from __future__ import annotations

import argparse
from pathlib import Path

import pandas as pd

from disagg.config import load_experiment
from disagg.hw.driver import hw_experiment, run_hw
from disagg.validate import loop_costs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("experiment", type=Path)
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--runs", type=int, default=4)
    ap.add_argument("--rate", type=float, default=4.0)
    ap.add_argument("--requests", type=int, default=24)
    ap.add_argument("--cores", type=int, default=2, help="cores per server when pinned")
    ap.add_argument("--out", type=Path, default=Path("runs/host-spread"))
    a = ap.parse_args()
    base = load_experiment(
        a.experiment,
        [
            f"hw.prefill_device={a.device}",
            f"hw.decode_device={a.device}",
            f"workload.rate_per_s={a.rate}",
            f"workload.num_requests={a.requests}",
        ],
    )
    rows: list[dict[str, object]] = []
    df = pd.DataFrame()
    for i in range(a.runs):
        for cores in (0, a.cores):
            exp = hw_experiment(
                base.updated(f"seed={base.seed + 10 + i}", f"hw.latency.cores_per_server={cores}")
            )
            where = a.out / f"run{i}-cores{cores}"
            summary, _ = run_hw(exp, where)
            costs = loop_costs([pd.read_parquet(where / "steps.parquet")])
            rows.append(
                {
                    "run": i,
                    "cores_per_server": cores,
                    "host_s": costs.get("profile_host_s"),
                    "host_per_seq_s": costs.get("profile_host_per_seq_s"),
                    "host_chunk_s": costs.get("profile_host_chunk_s"),
                    "pass_gap_s": costs["profile_pass_overhead_s"],
                    "tpot_p50_s": summary["tpot_s_p50"],
                    "pinned": " ".join(
                        f"{node}:{s['cores']}" for node, s in summary["node_settings"].items()
                    ),
                }
            )
            df = pd.DataFrame(rows)
            df.to_csv(a.out / "host_spread.csv", index=False)  # after each run: a cut call keeps it
            print(df.tail(1).to_string(index=False, header=len(rows) == 1), flush=True)
    ms = df.assign(**{c: df[c] * 1e3 for c in ("host_s", "host_per_seq_s", "host_chunk_s")})
    table = ms.groupby("cores_per_server")[["host_s", "host_per_seq_s", "host_chunk_s"]].agg(
        ["median", "min", "max"]
    )
    text = (
        f"# Host time per pass (ms), {a.runs} runs per setting, {a.requests} requests at "
        f"{a.rate:g} req/s\n\n```\n{table.round(4).to_string()}\n```\n"
    )
    (a.out / "host_spread.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()

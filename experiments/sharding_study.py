"""Sharding study: prefill TP8 -> decode TP8 / TP4 (x2 groups) / DP8, HND vs NHD pages.

    python experiments/sharding_study.py [--duration-s 120] [--out runs/sharding]

Runs the R1 and Qwen3-Coder 1 P : 3 D experiments with each decode sharding and page layout and
writes a markdown table (stdout and OUT/sharding-study.md): writes and bytes per request, bytes
through the busiest NIC, the transfer tail after prefill (ready - prefill end), and TTFT.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import pandas as pd

from disagg.cli import run_simulation

HERE = Path(__file__).parent
MODELS = {
    "deepseek-r1": HERE / "r1-disagg-1p3d.toml",
    "qwen3-coder": HERE / "qwen3coder-disagg-1p3d.toml",
}
DECODE = {"TP8": ("tp=8", "dp=1"), "TP4x2": ("tp=4", "dp=2"), "DP8": ("tp=1", "dp=8")}


def study(duration_s: float, out: Path) -> pd.DataFrame:
    rows = []
    for model, path in MODELS.items():
        for dname, (tp, dp) in DECODE.items():
            for layout in ("HND", "NHD"):
                sets = [
                    f"workload.duration_s={duration_s}",
                    f"cluster.decode.{tp}",
                    f"cluster.decode.{dp}",
                    f"kv.layout={layout}",
                ]
                run_dir = out / f"{model}-{dname}-{layout}"
                _, s = run_simulation(path, sets, run_dir, quiet=True)
                req = pd.read_parquet(run_dir / "requests.parquet")
                tail = (req.ready_s - req.prefill_end_s).median()
                rows.append(
                    {
                        "model": model,
                        "prefill -> decode": f"TP8 -> {dname}",
                        "layout": layout,
                        "writes/request": round(s["transfer_ops_per_request"]),
                        "MB/request": round(s["transfer_bytes_per_request"] / 1e6, 1),
                        "busiest NIC GB": round(s["nic_bytes_max"] / 1e9, 1),
                        "tail after prefill p50 (ms)": round(tail * 1e3, 2),
                        "TTFT p50 (ms)": round(s["ttft_s_p50"] * 1e3, 1),
                    }
                )
    return pd.DataFrame(rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--duration-s", type=float, default=120.0)
    ap.add_argument("--out", type=Path, default=Path("runs/sharding"))
    args = ap.parse_args()
    table = study(args.duration_s, args.out).to_markdown(index=False)
    (args.out / "sharding-study.md").write_text(table + "\n")
    print(table)


if __name__ == "__main__":
    main()

"""Decode TPOT under a steady stream of prefills: disaggregated vs colocated, on real devices.

    python benchmarks/gpu_tpot.py --prefill-device 0 --decode-device 1 --out DIR
    python benchmarks/gpu_tpot.py --prefill-device cpu --decode-device cpu --wire tcp \
        --model tiny-gqa --loads 4,8 --duration-s 3 --prompt 96 --output 24   # dry run, no GPU

The article's claim: a decoder that never runs a prefill decodes at a steady pace, while a
colocated server's decode steps stall whenever a prefill chunk joins them. Poisson arrivals at
each load (requests/s), prompts and outputs of fixed length, the same seed for both modes:
colocated runs on the decode device with chunked prefill (token budget --chunk), disaggregated
runs the prefill on the prefill device and decodes on the decode device. Per run: TPOT and
inter-token latency percentiles (`disagg sim` summary fields). Two figures: gpu_tpot.png, each
request's TPOT over time (by its first token), both modes in one panel per load; and
gpu_tpot_passes.png, every pass of the decoding GPU over time (colocated: the passes that
carried prefill tokens stand out), one panel per run. `--replot` redraws both and the table from
the run directories already under --out. Meant for two GPUs (`nvidia-h200-x2`); on one GPU the
two processes would share it.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np
import pandas as pd

from disagg.config import build_experiment
from disagg.core.metrics import read_results
from disagg.hw.device import resolve_device
from disagg.hw.driver import run_hw

FIELDS = ["tpot_s_p50", "tpot_s_p99", "itl_s_p50", "itl_s_p99", "ttft_s_p50"]  # shown in ms
MODES = ("colocated", "disagg")


def experiment(args: argparse.Namespace, mode: str, load: float) -> dict:
    colocated = {"nodes": 1, "tp": 1, "token_budget": args.chunk, "max_batch": args.max_batch}
    return {
        "name": run_name(mode, load),
        "seed": 0,
        "model": {"name": args.model, "weight_dtype": "bf16"},
        "cluster": {"mode": mode, "colocated": colocated}
        if mode == "colocated"
        else {
            "mode": mode,
            "prefill": {"nodes": 1, "tp": 1, "token_budget": args.prompt, "max_batch": 8},
            "decode": {"nodes": 1, "tp": 1, "max_batch": args.max_batch},
        },
        "kv": {"page_size": 16, "layout": "HND"},
        "workload": {
            "rate_per_s": load,
            "duration_s": args.duration_s,
            "prompt_tokens": {"dist": "fixed", "value": args.prompt},
            "output_tokens": {"dist": "fixed", "value": args.output},
        },
    }


def pass_timeline(ax: plt.Axes, steps: pd.DataFrame, title: str) -> None:
    """Every pass of the decoding node over time; passes that carried prefill tokens in red."""
    node = steps[steps.node.str.startswith(("decode", "colocated"))]
    ms = node.duration_s / node.steps * 1e3  # a row may stand for several identical passes
    plain, mixed = node.prefill_tokens == 0, node.prefill_tokens > 0
    ax.scatter(node.start_s[plain], ms[plain], s=3, label="decode only")
    ax.scatter(node.start_s[mixed], ms[mixed], s=6, c="tab:red", label="with prefill")
    ax.set_title(title, fontsize=9)
    ax.set_ylabel("pass (ms)")
    ax.set_yscale("log")
    ax.legend(fontsize=7, markerscale=3, loc="upper right")


def tpot_timeline(ax: plt.Axes, requests: dict[str, pd.DataFrame], load: float) -> None:
    """Each request's TPOT against the time of its first token, both modes at one load."""
    for mode, colour in zip(MODES, ("tab:red", "tab:blue"), strict=True):
        req = requests[run_name(mode, load)]
        req = req[req.status == "finished"].sort_values("first_token_s")
        ax.plot(req.first_token_s, req.tpot_s * 1e3, ".-", ms=3, lw=0.6, c=colour, label=mode)
    ax.set_title(f"{load:g} requests/s", fontsize=9)
    ax.set_ylabel("TPOT (ms)")
    ax.set_ylim(bottom=0)
    ax.legend(fontsize=7, loc="upper right")


def run_name(mode: str, load: float) -> str:
    return f"{mode}-{load:g}rps"


def measure(args: argparse.Namespace, loads: list[float]) -> None:
    pdev, ddev = (str(resolve_device(a)) for a in (args.prefill_device, args.decode_device))
    for load in loads:
        for mode in MODES:
            t = time.perf_counter()
            hw = [f"hw.wire={args.wire}", f"hw.prefill_device={pdev}", f"hw.decode_device={ddev}"]
            exp = build_experiment(experiment(args, mode, load), [*hw, f"kv.pages={args.pages}"])
            summary, _ = run_hw(exp, args.out / exp.name)
            print(f"{exp.name}: {summary['completed']} requests, {time.perf_counter() - t:.0f} s")


def report(out: Path, loads: list[float]) -> None:
    """The table (gpu_tpot.md) and both figures, from the run directories under `out`."""
    cases = [(load, mode, run_name(mode, load)) for load in loads for mode in MODES]
    names = [name for _, _, name in cases]
    runs = {name: read_results(out / name) for name in names}
    rows = []
    for load, mode, name in cases:
        summary = runs[name][3]
        rows.append(
            {
                "load (req/s)": load,
                "mode": mode,
                "GPUs": summary["gpus"],
                "completed": summary["completed"],
                **{f.replace("_s_", " (ms) "): 1e3 * summary[f] for f in FIELDS},
                "output tok/s per GPU": round(summary["output_tps_per_gpu"]),
            }
        )
    md = pd.DataFrame(rows).round(2).to_markdown(index=False)
    (out / "gpu_tpot.md").write_text(md + "\n")
    print(md)
    fig, axes = plt.subplots(len(loads), 1, figsize=(10, 2.6 * len(loads)), sharex=True)
    requests = {name: r[0] for name, r in runs.items()}
    for ax, load in zip(np.atleast_1d(axes), loads, strict=True):
        tpot_timeline(ax, requests, load)
    np.atleast_1d(axes)[-1].set_xlabel("time of the first token (s)")
    fig.tight_layout()
    fig.savefig(out / "gpu_tpot.png", dpi=110)
    plt.close(fig)
    fig, axes = plt.subplots(len(names), 1, figsize=(10, 2.2 * len(names)), sharex=True)
    for ax, name in zip(axes, names, strict=True):
        pass_timeline(ax, runs[name][1], name)
    axes[-1].set_xlabel("time (s)")
    fig.tight_layout()
    fig.savefig(out / "gpu_tpot_passes.png", dpi=110)
    plt.close(fig)
    print(f"wrote {out / 'gpu_tpot.png'} and {out / 'gpu_tpot_passes.png'}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prefill-device", default="0")
    ap.add_argument("--decode-device", default="1")
    ap.add_argument("--model", default="llama-3.1-8b")
    ap.add_argument("--wire", default="cuda")
    ap.add_argument("--pages", type=int, default=8192)
    ap.add_argument("--loads", default="2,6", help="requests/s, comma-separated")
    ap.add_argument("--duration-s", type=float, default=40.0)
    ap.add_argument("--prompt", type=int, default=4096)
    ap.add_argument("--output", type=int, default=256)
    ap.add_argument("--chunk", type=int, default=2048, help="colocated prefill token budget")
    ap.add_argument("--max-batch", type=int, default=64)
    ap.add_argument("--out", type=Path, default=Path("runs/gpu_tpot"))
    ap.add_argument("--replot", action="store_true", help="only redraw from the runs in --out")
    args = ap.parse_args()
    loads = [float(x) for x in args.loads.split(",")]
    if not args.replot:
        measure(args, loads)
    report(args.out, loads)


if __name__ == "__main__":
    main()

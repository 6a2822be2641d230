"""TTFT of a disaggregated run minus a colocated one, on real GPUs, over the cuda wire.

    python benchmarks/gpu_ttft.py --prefill-device 0 --decode-device 0 --out DIR
    python benchmarks/gpu_ttft.py --prefill-device cpu --decode-device cpu --wire tcp \
        --model tiny-gqa --prompts 64,128,256 --spacing-s 0.5     # a dry run without a GPU

Llama-3.1-8B shapes at full depth (random weights, bf16, FlashInfer, HND pages of 16 tokens).
Four runs of the same requests: colocated (one process), disaggregated with layer-wise
transfer, the same under parallel handoff (the driver sends each request to the prefill server
too, which starts before the decoder's pages are known), and disaggregated with whole-request
transfer (a prefill process and a decode process; on one GPU they share it). Prompts of 2k,
8k and 32k tokens, one request at a time (spaced so they do not overlap), 8 output tokens; the
first request of each run is a warm-up and is left out. TTFT is measured by the driver's wall
clock from arrival to the first token.

The target: layer-wise disaggregated TTFT within one layer's transfer plus
one decode step of colocated. One layer's transfer is that layer's KV bytes at the bandwidth of
a plain copy from the prefill device to the decode device measured here (a peer copy on two
GPUs); the decode step is the colocated run's median batch-1 decode pass at that prompt length
(the KV read grows with the context). The colocated run uses the decode device.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from pathlib import Path

import numpy as np
import pandas as pd

from disagg.config import build_experiment
from disagg.core.metrics import handoff_parts, queue_parts, read_results
from disagg.hw.device import copy_seconds, resolve_device
from disagg.hw.driver import run_hw
from disagg.models import get_model

REPEATS = int(os.environ.get("DISAGG_REPEATS", "3"))
LAYERS = int(os.environ.get("DISAGG_LAYERS", "0"))  # dry runs: cut the depth
PAGE = int(os.environ.get("DISAGG_PAGE", "16"))


def trace(path: Path, prompts: list[int], spacing_s: float) -> Path:
    """Warm-up request, then REPEATS requests of each prompt length (a Mooncake JSONL)."""
    lines, t = [], 0.0
    for n in (prompts[0], *[p for p in prompts for _ in range(REPEATS)]):
        lines.append(json.dumps({"timestamp": t * 1e3, "input_length": n, "output_length": 8}))
        t += spacing_s
    path.write_text("\n".join(lines) + "\n")
    return path


def breakdown(req: pd.DataFrame) -> pd.DataFrame:
    """Median milliseconds of each stage of TTFT, by prompt length: waiting for the prefill,
    the prefill (start to the end of its step), its end to all KV landed on the decoder (ready),
    and ready to the first token (the decoder's first step). "Start to ready" spans the two
    middle stages: where the prefill's end is stamped (after the host posts, with
    DISAGG_META_IN_STREAM=1) moves time between them, not out of it."""
    ends = ["arrival_s", "prefill_start_s", "prefill_end_s", "ready_s", "first_token_s"]
    names = ["queue", "prefill", "end to ready", "ready to token"]
    ms = pd.DataFrame(
        {n: 1e3 * (req[b] - req[a]) for n, a, b in zip(names, ends[:-1], ends[1:], strict=True)}
    )
    ms["start to ready"] = 1e3 * (req.ready_s - req.prefill_start_s)
    ms["ttft"] = 1e3 * req.ttft_s
    return ms.groupby(req.prompt_tokens).median().round(2)


def decode_steps(req: pd.DataFrame, steps: pd.DataFrame, prompts: list[int]) -> dict[int, float]:
    """Median seconds of a batch-1 decode pass at each prompt length: the passes that ran
    while a request of that length was decoding (requests run one at a time); NaN for a
    length with no finished request."""
    one = steps[(steps.kind == "decode") & (steps.decode_seqs == 1)]
    out: dict[int, list[float]] = {n: [] for n in prompts}
    for _, r in req.iterrows():
        during = one[(one.start_s >= r.first_token_s - 1e-3) & (one.start_s < r.finish_s)]
        out[int(r.prompt_tokens)].extend(during.duration_s)
    return {n: _median(np.asarray(v)) for n, v in out.items()}


def first_passes(req: pd.DataFrame, steps: pd.DataFrame) -> pd.DataFrame:
    """Median ms of each request's first batch-1 decode pass and of its later ones, wall and
    device time (the pass's kernels: `device_s`), by prompt length. A disaggregated request's
    first decode pass makes its first token (it starts at ready); a colocated request's first
    token comes from its prefill, so its first decode pass makes the second. Wall minus
    device is the host's share: planning, launching, and waiting for the GPU."""
    one = steps[(steps.kind == "decode") & (steps.decode_seqs == 1)].sort_values("start_s")
    device = one.device_s if "device_s" in one else pd.Series(math.nan, index=one.index)
    rows = []
    for _, r in req.iterrows():
        begin = np.fmin(r.ready_s, r.first_token_s) - 1e-3  # colocated: no ready stamp
        own = (one.start_s >= begin) & (one.start_s < r.finish_s)
        wall, dev = 1e3 * one.duration_s[own].to_numpy(), 1e3 * device[own].to_numpy()
        if len(wall):
            rows.append(
                {
                    "prompt": r.prompt_tokens,
                    "first": wall[0],
                    "first device": dev[0],
                    "later": _median(wall[1:]),
                    "later device": _median(dev[1:]),
                }
            )
    cols = ["first", "first device", "later", "later device"]
    if not rows:
        return pd.DataFrame(columns=cols)
    return pd.DataFrame(rows).groupby("prompt")[cols].median().round(2)


def _median(v: np.ndarray) -> float:
    return float(np.median(v)) if len(v) else float("nan")


def gap_interval(a: np.ndarray, b: np.ndarray, draws: int = 5000) -> tuple[float, float]:
    """90% bootstrap interval of median(b) - median(a), the requests of each run resampled
    (NaN when either run has no request to resample)."""
    if not len(a) or not len(b):
        return float("nan"), float("nan")
    rng = np.random.default_rng(0)
    gaps = [
        np.median(rng.choice(b, len(b))) - np.median(rng.choice(a, len(a))) for _ in range(draws)
    ]
    lo, hi = np.percentile(gaps, [5, 95])
    return float(lo), float(hi)


def verdict(lo: float, hi: float, bound: float) -> str:
    """yes / no when the whole interval is on one side of the bound, else at the line (n/a
    when there is nothing to compare: no finished request of that length)."""
    if math.isnan(lo) or math.isnan(hi) or math.isnan(bound):
        return "n/a"
    return "yes" if hi <= bound else "no" if lo > bound else "at the line"


def experiment(
    model: str, mode: str, policy: str, trace_path: Path, budget: int, handoff: str
) -> dict:
    group = {"nodes": 1, "tp": 1, "token_budget": budget, "max_batch": 8}
    return {
        "name": f"{model}-{mode}-{policy}-{handoff}",
        "seed": 0,
        "model": {"name": model, "weight_dtype": "bf16", **({"layers": LAYERS} if LAYERS else {})},
        "cluster": {"mode": mode, "colocated": group}
        if mode == "colocated"
        else {"mode": mode, "prefill": group, "decode": group},
        "kv": {"page_size": PAGE, "layout": "HND"},
        "transfer": {"policy": policy, "handoff": handoff},
        "workload": {"trace": str(trace_path)},
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prefill-device", default="0")
    ap.add_argument("--decode-device", default="0")
    ap.add_argument("--pages", type=int, default=6144)
    ap.add_argument("--model", default="llama-3.1-8b")
    ap.add_argument("--wire", default="cuda")
    ap.add_argument("--prompts", default="2048,8192,32768")
    ap.add_argument("--spacing-s", type=float, default=6.0)
    ap.add_argument("--out", type=Path, default=Path("runs/gpu_ttft"))
    args = ap.parse_args()
    pdev, ddev = (str(resolve_device(a)) for a in (args.prefill_device, args.decode_device))
    prompts = [int(p) for p in args.prompts.split(",")]
    args.out.mkdir(parents=True, exist_ok=True)
    # kept beside the runs, whose experiments name it: `disagg sim run DIR/LABEL` replays one
    tpath = trace(args.out.resolve() / "ttft.jsonl", prompts, args.spacing_s)
    runs = {
        "colocated": ("colocated", "layerwise", "decode-first"),
        "layerwise": ("disagg", "layerwise", "decode-first"),
        "parallel": ("disagg", "layerwise", "parallel"),
        "whole": ("disagg", "whole", "decode-first"),
    }
    ttft: dict[str, dict[int, float]] = {}
    samples: dict[str, dict[int, np.ndarray]] = {}
    stages: dict[str, pd.DataFrame] = {}
    decode_step: dict[str, dict[int, float]] = {}
    for label, (mode, policy, handoff) in runs.items():
        t = time.perf_counter()
        settings = [
            f"hw.wire={args.wire}",
            f"hw.prefill_device={pdev}",
            f"hw.decode_device={ddev}",
            f"kv.pages={args.pages}",
            "hw.drain_timeout_s=120",  # one request at a time: a lost one is an error, named, soon
        ]
        data = experiment(args.model, mode, policy, tpath, max(prompts), handoff)
        summary, _ = run_hw(build_experiment(data, settings), args.out / label)
        req, steps, _, _ = read_results(args.out / label)
        hops = pd.read_parquet(args.out / label / "hops.parquet")
        req = req.iloc[1:]  # no warm-up
        failed = req[req.status != "finished"]
        for _, r in failed.iterrows():
            print(
                f"{label}: request {r.request_id} ({r.prompt_tokens} tokens) {r.status}: "
                f"{r.fail_reason}; left out",
                flush=True,
            )
        req = req[req.status == "finished"]
        samples[label] = {n: req[req.prompt_tokens == n].ttft_s.to_numpy() for n in prompts}
        ttft[label] = {n: _median(v) for n, v in samples[label].items()}
        firsts = first_passes(req, steps).add_prefix("decode pass: ")
        parts = (
            (1e3 * queue_parts(req, hops, handoff == "parallel"))
            .add_prefix("queue: ")
            .join((1e3 * handoff_parts(req, hops)).add_prefix("handoff: "))
            .join(req.set_index("request_id").prompt_tokens)
        )
        parts = parts.groupby("prompt_tokens").median().round(3)
        stages[label] = breakdown(req).join(firsts).join(parts)
        decode_step[label] = decode_steps(req, steps, prompts)
        print(
            f"{label}: {summary['completed']} requests in {time.perf_counter() - t:.0f} s",
            flush=True,
        )
    kv_layer = get_model(args.model).kv_bytes_per_token_per_layer("bf16")
    nbytes = max(prompts) * kv_layer  # counted once (not read plus write)
    bw = nbytes / copy_seconds(nbytes, resolve_device(pdev), resolve_device(ddev))
    rows = []
    for n in prompts:
        layer_s = n * kv_layer / bw
        bound = layer_s + decode_step["colocated"][n]
        gaps = {
            k: gap_interval(samples["colocated"][n], samples[k][n])
            for k in ("layerwise", "parallel")
        }
        rows.append(
            {
                "prompt tokens": n,
                "colocated TTFT (ms)": 1e3 * ttft["colocated"][n],
                "layer-wise TTFT (ms)": 1e3 * ttft["layerwise"][n],
                "whole TTFT (ms)": 1e3 * ttft["whole"][n],
                "layer-wise - colocated (ms)": 1e3 * (ttft["layerwise"][n] - ttft["colocated"][n]),
                "parallel handoff - colocated (ms)": 1e3
                * (ttft["parallel"][n] - ttft["colocated"][n]),
                "whole - colocated (ms)": 1e3 * (ttft["whole"][n] - ttft["colocated"][n]),
                "bound: 1 layer transfer + 1 decode step (ms)": 1e3 * bound,
                "layer-wise 90% interval (ms)": _ms(gaps["layerwise"]),
                "parallel 90% interval (ms)": _ms(gaps["parallel"]),
                "within bound": verdict(*gaps["layerwise"], bound),
                "within bound (parallel)": verdict(*gaps["parallel"], bound),
            }
        )
    table = pd.DataFrame(rows).round(2)
    md = table.to_markdown(index=False)
    passes = ", ".join(
        f"{n}: {1e3 * decode_step['colocated'][n]:.2f} / {1e3 * decode_step['layerwise'][n]:.2f}"
        for n in prompts
    )
    extra = (
        f"\ncopy bandwidth (bytes copied per second) {bw / 1e9:.0f} GB/s; batch-1 decode pass "
        f"(ms, colocated / disaggregated) by prompt length: {passes}\n"
        "intervals: 90% bootstrap intervals of the median difference (requests resampled); "
        "within bound: yes / no when the whole interval is on one side of the bound\n"
    )
    knobs = {k: v for k, v in sorted(os.environ.items()) if k.startswith("DISAGG_")}
    extra += f"settings from the environment: {knobs or 'none'}\n"
    parts = [f"\n{label} (ms, medians)\n\n{df.to_markdown()}\n" for label, df in stages.items()]
    (args.out / "gpu_ttft.md").write_text(md + "\n" + extra + "".join(parts))
    print(md + "\n" + extra + "".join(parts))


def _ms(interval: tuple[float, float]) -> str:
    return f"[{1e3 * interval[0]:.2f}, {1e3 * interval[1]:.2f}]"


if __name__ == "__main__":
    main()

"""GPU benchmark of the hw backend: correctness first, then measured ceilings and the figures.

    python benchmarks/gpu_bench.py --prefill-device 0 --decode-device 0 --out DIR

Sections (each recorded, even if another fails): FlashInfer vs the float32 reference; bf16 GEMM
ceiling (8192^3) and device copy bandwidth, measured in this run; prefill of 8192 tokens through
Llama-3.1-8B at full depth (FLOP/s vs the GEMM ceiling, target >= 70%); a CUDA-graph decode
step at batch 128 x 4096 context (weights + KV bytes/s vs copy bandwidth, target >= 75%); the
cuda wire moving one request's KV pages between two processes (GB/s vs a plain device copy of
the same bytes, target >= 90%), with the layers of both sides in one allocation as KVCache holds
them, once with the wire's stacked copies (the default) and once one copy per layer (a
driver 2D copy of the same bytes is a third reference). Writes bench.json and bench.md into --out.
DISAGG_WIRE_BY_ADDRESS=1 sends through the wire's driver-mapped path (its two-GPU path) on one GPU;
that path is measured twice, with one driver copy per run and with peer kernels (`peer_kernels`,
the default in the wire).
`--compile KIND` only builds FlashInfer's kernels for KIND (prefill, decode, mla) and exits;
`--smoke` runs the same code on the CPU with toy sizes (no FlashInfer, no cuda wire).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch

from disagg.core.kvcache import pages_for
from disagg.hw import attention
from disagg.hw.attention import (
    FLASHINFER_SHAPES,
    AttnShape,
    error_against_reference,
    make_attention,
)
from disagg.hw.batch import BatchMeta, Seq
from disagg.hw.device import copy_seconds, default_dtype, resolve_device, time_it
from disagg.hw.model import Transformer
from disagg.hw.runner import Runner
from disagg.hw.specs import tiny_gqa
from disagg.models import LLAMA_31_8B, ModelSpec

LENS = {  # (cached, new) tokens per sequence
    "prefill": [(0, 37), (50, 20), (129, 1), (16, 64), (0, 1000)],
    "decode": [(0, 1), (17, 1), (300, 1), (63, 1), (4000, 1)],
}


@dataclass(frozen=True)
class Sizes:
    spec: ModelSpec
    gemm: int
    copy_bytes: int
    prefill_tokens: int
    decode_batch: int
    decode_context: int
    transfer_tokens: tuple[int, ...]
    page_size: int = 16


FULL = Sizes(LLAMA_31_8B, 8192, 2 << 30, 8192, 128, 4096, (4096, 32768))
SMOKE = Sizes(tiny_gqa(layers=4), 256, 1 << 22, 64, 4, 32, ())


# ---- correctness ---------------------------------------------------------------------------
def check(
    kind: str, mode: str, dev: torch.device, seed: int = 0, kernel: str | None = None
) -> dict[str, Any]:
    """Max |FlashInfer - reference| on one random paged problem (bf16 inputs)."""
    err, scale = error_against_reference(FLASHINFER_SHAPES[kind], LENS[mode], dev, seed, kernel)
    ok = math.isfinite(err) and err <= 2e-2 * max(1.0, scale)
    return {"kernel": kind, "mode": mode, "max_abs_err": err, "out_max": scale, "ok": ok}


def correctness(dev: torch.device) -> dict[str, Any]:
    """FlashInfer against the reference for prefill and decode, HND, NHD and MLA."""
    rows = [
        check(k, m, dev, i)
        for i, (k, m) in enumerate((k, m) for k in FLASHINFER_SHAPES for m in LENS)
    ]
    for kernel in (k for k in attention.DECODE_BACKENDS if k != attention.DECODE_BACKEND):
        for k in ("GQA-HND", "GQA-NHD"):  # the other decode kernels
            rows.append(check(k, "decode", dev, 7, kernel) | {"mode": f"decode ({kernel})"})
    return {"rows": rows, "ok": all(r["ok"] for r in rows)}


def compile_kernels(kinds: list[str], dev: torch.device) -> int:
    """Build (JIT) the FlashInfer kernels of `kinds` by running each once."""
    t0 = time.perf_counter()
    table = {
        "prefill": [("GQA-HND", "prefill")],
        "decode": [("GQA-HND", "decode")],
        "mla": [("MLA", "prefill"), ("MLA", "decode")],
    }
    for k, m in [case for kind in kinds for case in table[kind]]:
        print(json.dumps(check(k, m, dev) | {"compile_s": time.perf_counter() - t0}), flush=True)
    return 0


# ---- ceilings ------------------------------------------------------------------------------
def gemm_ceiling(dev: torch.device, sizes: Sizes) -> dict[str, Any]:
    n = sizes.gemm
    dtype = default_dtype(dev)
    a, b = (torch.randn(n, n, device=dev).to(dtype) for _ in range(2))
    c = torch.empty(n, n, device=dev, dtype=dtype)
    t = statistics.median(time_it(lambda: torch.mm(a, b, out=c), dev, warmup=5, repeats=20))
    return {"n": n, "median_s": t, "tflops": 2 * n**3 / t / 1e12}


def copy_bandwidth(dev: torch.device, sizes: Sizes) -> dict[str, Any]:
    t = copy_seconds(sizes.copy_bytes, dev, warmup=3, repeats=20)
    return {
        "device": str(dev),
        "bytes": sizes.copy_bytes,
        "median_s": t,
        "gbps_read_write": 2 * sizes.copy_bytes / t / 1e9,
    }


# ---- prefill -------------------------------------------------------------------------------
def prefill_flops(spec: ModelSpec, tokens: int) -> int:
    """FLOPs of one causal prefill of `tokens` tokens with logits for the last token only:
    every linear layer per token, the LM head once, attention of token i over i + 1 keys."""
    head = 2 * spec.vocab * spec.hidden
    linear = (spec.linear_flops_per_token - head) * tokens + head
    attn = spec.layers * spec.attn_flops(tokens * (tokens + 1) // 2)  # linear in keys
    return linear + attn


def linear_floor(model: Transformer, tokens: int) -> float:
    """Seconds of the layer GEMMs alone (each 2-D weight of a layer) at M = tokens, summed over
    all layers."""
    dev, total = model.device, 0.0
    for shape in model.layer_shapes().values():
        if len(shape) != 2:
            continue  # MLA's per-head absorbed projections are not one GEMM
        n, k = shape
        x = torch.randn(tokens, k, device=dev).to(model.dtype)
        w = torch.randn(n, k, device=dev).to(model.dtype)
        total += statistics.median(
            time_it(partial(torch.nn.functional.linear, x, w), dev, warmup=3, repeats=10)
        )
    return total * model.spec.layers


def prefill(dev: torch.device, sizes: Sizes, state: dict[str, Any]) -> dict[str, Any]:
    spec, n = sizes.spec, sizes.prefill_tokens
    t0 = time.perf_counter()
    model = state["model"] = Transformer(spec, seed=0, device=dev)
    build_s = time.perf_counter() - t0
    cache = model.new_cache(pages_for(n, sizes.page_size), sizes.page_size)
    runner = Runner(model, cache)
    tokens = torch.randint(0, spec.vocab, (n,), generator=torch.Generator().manual_seed(0))
    seq = Seq.of(tokens.tolist(), 0, range(cache.num_pages))
    t = statistics.median(time_it(partial(runner.step, [seq]), dev, warmup=2, repeats=5))
    flops = prefill_flops(spec, n)
    ceiling = state.get("gemm", {}).get("tflops", float("nan"))
    fused = _with_fused_ops(model, dev, lambda: _prefill_fused(runner, seq, dev, flops, ceiling))
    gemm_s = linear_floor(model, n)
    tflops = flops / t / 1e12
    return {
        "fused_ops_default": model.fused_ops,
        **fused,
        "model": spec.name,
        "layers": spec.layers,
        "tokens": n,
        "median_s": t,
        "flops": flops,
        "tflops": tflops,
        "gemm_ceiling_tflops": ceiling,
        "fraction_of_ceiling": tflops / ceiling,
        "target": 0.70,
        "layer_gemms_alone_s": gemm_s,
        "weights_build_s": build_s,
    }


def _with_fused_ops(
    model: Transformer, dev: torch.device, fn: Callable[[], dict[str, Any]]
) -> dict[str, Any]:
    """fn() with the model's fused_ops flipped (CUDA only), its error recorded, not raised."""
    if dev.type != "cuda":
        return {}
    default = model.fused_ops
    model.fused_ops = not default
    try:
        return fn()
    except Exception as e:  # the other setting's figures still stand
        return {"other_ops_error": f"{type(e).__name__}: {e}"}
    finally:
        model.fused_ops = default


def _prefill_fused(
    runner: Runner, seq: Seq, dev: torch.device, flops: int, ceiling: float
) -> dict[str, Any]:
    """The same prefill with the other elementwise ops; same token chosen?"""
    t = statistics.median(time_it(partial(runner.step, [seq]), dev, warmup=2, repeats=5))
    mine = runner.step([seq], sample=True).tokens
    runner.model.fused_ops = not runner.model.fused_ops
    theirs = runner.step([seq], sample=True).tokens
    return {
        "other_ops_median_s": t,
        "other_ops_fraction_of_ceiling": flops / t / 1e12 / ceiling,
        "other_ops_same_token": mine == theirs,
    }


# ---- decode --------------------------------------------------------------------------------
def decode(dev: torch.device, sizes: Sizes, state: dict[str, Any]) -> dict[str, Any]:
    """The CUDA-graph decode step with each FlashInfer decode kernel (`flashinfer:KERNEL`),
    and where its time goes: the weights-only step (1-token contexts), the layer GEMMs alone at
    M = batch, one layer's attention alone (also at larger pages)."""
    spec, b, ctx, ps = sizes.spec, sizes.decode_batch, sizes.decode_context, sizes.page_size
    model = state.get("model")
    if model is None or model.device != dev:
        model = state["model"] = Transformer(spec, seed=0, device=dev)
    per = pages_for(ctx + 1, ps)
    cache = model.new_cache(b * per, ps)
    for layer in cache.layers:
        layer.uniform_(-1, 1)
    seqs = [Seq((i % spec.vocab,), ctx, tuple(range(i * per, (i + 1) * per))) for i in range(b)]
    short = [Seq(s.tokens, 0, s.pages) for s in seqs]
    elem = model.dtype.itemsize
    weights = model.weight_bytes() - spec.vocab * spec.hidden * elem + b * spec.hidden * elem
    kv = b * (ctx + 1) * spec.kv_bytes_per_token("bf16" if elem == 2 else "fp32")
    copy = state.get("copy", {})
    if copy.get("device") != str(dev):  # the decode GPU's own (the copy section ran on another)
        copy = copy_bandwidth(dev, sizes)
    copy_bw = copy.get("gbps_read_write", float("nan"))
    variants: dict[str, dict[str, Any]] = {}
    default = attention.DECODE_BACKEND
    # each FlashInfer decode kernel; CPU (--smoke): the torch reference
    kernels = (
        {k: f"flashinfer:{k}" for k in attention.DECODE_BACKENDS}
        if dev.type == "cuda"
        else {"torch reference": "auto"}
    )
    for kernel, choice in kernels.items():
        try:
            v = _decode_step(model, cache, seqs, dev, choice, short)
            t, t_w = v["median_s"], v["weights_only_step_s"]
            variants[kernel] = v | {
                "gbps": (weights + kv) / t / 1e9,
                "fraction_of_copy": (weights + kv) / t / 1e9 / copy_bw,
                "kv_gbps_beyond_weights": kv / max(t - t_w, 1e-9) / 1e9,
            }
        except Exception as e:  # one kernel failing (say, a JIT build) leaves the others
            variants[kernel] = {"error": f"{type(e).__name__}: {e}"}
    other = _with_fused_ops(model, dev, partial(_decode_step, model, cache, seqs, dev))
    if "median_s" in other:
        name = f"{default}+{'torch' if model.fused_ops else 'fused'} ops"
        variants[name] = other | {
            "gbps": (weights + kv) / other["median_s"] / 1e9,
            "fraction_of_copy": (weights + kv) / other["median_s"] / 1e9 / copy_bw,
        }
    eager = Runner(model, cache, graph_batches=())
    t_eager = statistics.median(time_it(partial(eager.step, seqs), dev, warmup=2, repeats=5))
    del cache, eager
    ok = {k: variants[k] for k in kernels if "median_s" in variants[k]}  # the default ops
    if not ok:
        return {"variants": variants, "error": "every decode kernel failed (see variants)"}
    best = min(ok, key=lambda k: ok[k]["median_s"])
    return {
        "batch": b,
        "context": ctx,
        "weight_bytes": weights,
        "kv_bytes": kv,
        "copy_gbps": copy_bw,
        "target": 0.75,
        "variants": variants,
        "best": best,
        **{k: ok[best][k] for k in ("median_s", "gbps", "fraction_of_copy", "graph")},
        "layer_gemms_alone_s": linear_floor(model, b),
        "lm_head_alone_s": _lm_head_alone(model, b, dev),
        "attention_by_page_size_s": _attention_pages(spec, b, ctx, dev),
        "eager_step_s": t_eager,
    }


def _decode_step(
    model: Transformer,
    cache: Any,
    seqs: list[Seq],
    dev: torch.device,
    attention: str = "auto",
    short: list[Seq] | None = None,
) -> dict[str, Any]:
    """Median seconds of the CUDA-graph decode step (graphs captured afresh) with `attention`;
    given `short` (the same rows at 1-token contexts), also the weights-only step and one
    layer's attention alone."""
    runner = Runner(model, cache, attention=attention, graph_batches=(len(seqs),))
    runner.capture()
    t = statistics.median(time_it(partial(runner.step, seqs), dev, warmup=3, repeats=10))
    out = {"median_s": t, "graph": bool(runner._graphs), "graph_error": runner.graph_error}
    if short is not None:
        step = partial(runner.step, short)
        out["weights_only_step_s"] = statistics.median(time_it(step, dev, warmup=2, repeats=10))
        layer = cache.layers[0]
        out["attention_one_layer_s"] = _attention_alone(runner.shape, seqs, layer, attention)
    return out


def _attention_alone(
    shape: AttnShape, seqs: list[Seq], layer: torch.Tensor, attention: str = "auto"
) -> float:
    """Seconds of one layer's decode attention over `seqs` (planned once, run alone)."""
    dev = layer.device
    attn = make_attention(attention, shape, dev, layer.dtype)
    attn.plan(BatchMeta.of(seqs, shape.page_size, layer.shape[0] - 1))
    q = torch.randn(len(seqs), shape.heads, shape.head_dim, device=dev).to(layer.dtype)
    return statistics.median(time_it(partial(attn.run, layer, q), dev, warmup=3, repeats=20))


def _attention_pages(spec: ModelSpec, b: int, ctx: int, dev: torch.device) -> dict[int, float]:
    """One layer's decode attention (default kernel) at batch b x ctx, by page size."""
    out = {}
    for ps in (16, 32, 64):
        per = pages_for(ctx + 1, ps)
        shape = AttnShape.of(spec, ps, "HND")
        layer = torch.empty(b * per + 1, *shape.page.shape, device=dev)
        layer = layer.uniform_(-1, 1).to(default_dtype(dev))
        seqs = [Seq((0,), ctx, tuple(range(i * per, (i + 1) * per))) for i in range(b)]
        out[ps] = _attention_alone(shape, seqs, layer)
        del layer
    return out


def _lm_head_alone(model: Transformer, rows: int, dev: torch.device) -> float:
    x = torch.randn(rows, model.spec.hidden, device=dev).to(model.dtype)
    fn = partial(torch.nn.functional.linear, x, model.lm_head)
    return statistics.median(time_it(fn, dev, warmup=3, repeats=10))


# ---- the cuda wire -------------------------------------------------------------------------
def _layouts(pages: int, rng: np.random.Generator) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Source and destination page ids: one contiguous run each, or scattered in a 2x pool."""
    return {
        "contiguous": (np.arange(pages), np.arange(pages) + pages // 2),
        "scattered": (rng.permutation(2 * pages)[:pages], rng.permutation(2 * pages)[:pages]),
    }


def _copies(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Plain copies, one per (dst, src) pair: the same bytes as layer-wise sends."""
    for dst, src in pairs:
        dst.copy_(src)


def _copy_2d_seconds(
    layers: int, row: int, pitch: int, dev_p: torch.device, dev_d: torch.device
) -> float:
    """Median seconds of one driver 2D copy: `layers` rows of `row` bytes, `pitch` apart."""
    from disagg.hw.transport import cudadriver

    a = torch.ones((layers, pitch), dtype=torch.uint8, device=dev_p)
    b = torch.empty((layers, pitch), dtype=torch.uint8, device=dev_d)

    def copy() -> None:
        stream = torch.cuda.current_stream(dev_p).cuda_stream
        cudadriver.copy_2d_async(b.data_ptr(), pitch, a.data_ptr(), pitch, row, layers, stream)

    return statistics.median(time_it(copy, dev_p, warmup=3, repeats=10))


def _references(
    dev_p: torch.device, dev_d: torch.device, layers: int, pb: int, pages: int
) -> dict[str, float]:
    """GB/s of the plain copies of one request's bytes that the wire is compared with: one
    copy, one per layer, and one driver 2D copy over layers of a 2x pool."""
    nbytes = pages * pb * layers
    a = torch.empty(nbytes, dtype=torch.uint8, device=dev_p)
    b = torch.empty(nbytes, dtype=torch.uint8, device=dev_d)
    pieces = list(zip(b.chunk(layers), a.chunk(layers), strict=True))
    layer_s = statistics.median(time_it(partial(_copies, pieces), dev_p, warmup=3, repeats=10))
    del a, b, pieces
    return {
        "copy_gbps": nbytes / copy_seconds(nbytes, dev_p, dev_d) / 1e9,
        "per_layer_copy_gbps": nbytes / layer_s / 1e9,
        "copy_2d_gbps": nbytes
        / _copy_2d_seconds(layers, pages * pb, 2 * pages * pb, dev_p, dev_d)
        / 1e9,
    }


def _transfer_one(
    dev_p: torch.device,
    dev_d: torch.device,
    layers: int,
    page_size: int,
    pb: int,
    pages: int,
    refs: dict[str, float],
    by_address: bool,
    peer_kernels: bool = False,
    stack: bool = True,
) -> dict[str, Any]:
    from disagg.hw.transport.base import Unit, WriteArray
    from disagg.hw.transport.cuda import CudaTransport
    from disagg.hw.transport.peer import ReceiverProcess, await_completion

    pool, nbytes = 2 * pages, pages * pb * layers
    # both sides hold their layers in one allocation, as KVCache does
    recv = ReceiverProcess("cuda", [pool * pb] * layers, str(dev_d), "decode", stacked=True)
    wire = CudaTransport(
        endpoint="prefill", by_address=by_address, peer_kernels=peer_kernels, stack=stack
    )
    try:
        src = torch.randint(0, 256, (layers, pool * pb), dtype=torch.uint8, device=dev_p)
        for i in range(layers):
            wire.register(f"s{i}", src[i])
        wire.connect("decode", recv.info, recv.descs)
        copies = "peer kernels" if peer_kernels else "driver, per run"
        copies = copies if by_address or dev_p != dev_d else "torch"
        out: dict[str, Any] = {
            "copies": copies + (", layers stacked" if stack else ""),
            "stack": stack,
            "tokens": pages * page_size,
            "bytes": nbytes,
            **refs,
        }
        torch.cuda.synchronize(dev_p)
        wr, posts = 0, 0
        for name, (sp, dp) in _layouts(pages, np.random.default_rng(0)).items():
            sizes = np.full(pages, pb, dtype=np.int64)
            units = [
                Unit(WriteArray(f"s{i}", f"r{i}", sp * pb, dp * pb, sizes), imm=i)
                for i in range(layers)
            ]
            dev_s: list[float] = []
            e2e_s: list[float] = []
            for rep in range(8):
                wr += 1
                start, end = (
                    torch.cuda.Event(enable_timing=True),
                    torch.cuda.Event(enable_timing=True),
                )
                held = rep % 2 == 0  # even reps: stream held while Python posts -> copy time only
                if held:
                    with torch.cuda.stream(wire.stream):
                        torch.cuda._sleep(100_000_000)
                start.record(wire.stream)
                t0 = time.perf_counter()
                wire.post("decode", units, wr)
                end.record(wire.stream)
                await_completion(wire, wr)
                t1 = time.perf_counter()
                (dev_s if held else e2e_s).append(
                    start.elapsed_time(end) / 1e3 if held else t1 - t0
                )
                posts += 1
            dev_gbps = nbytes / statistics.median(dev_s[1:]) / 1e9
            e2e_gbps = nbytes / statistics.median(e2e_s[1:]) / 1e9
            out[name] = {
                "device_gbps": dev_gbps,
                "end_to_end_gbps": e2e_gbps,
                "device_fraction_of_copy": dev_gbps / out["copy_gbps"],
                "end_to_end_fraction_of_copy": e2e_gbps / out["copy_gbps"],
                "device_fraction_of_per_layer_copy": dev_gbps / out["per_layer_copy_gbps"],
            }
            if pool * pb <= 64 << 20:  # check the bytes of the last layer landed where asked
                got = np.frombuffer(recv.ask("read", layers - 1), dtype=np.uint8).reshape(pool, pb)
                want = src[-1].view(pool, pb).cpu().numpy()
                out[name]["bytes_ok"] = bool((got[dp] == want[sp]).all())
        imms, _ = recv.ask("wait", posts * layers, False, 20)
        out["immediates_ok"] = len(imms) == posts * layers
        return out
    finally:
        wire.close()
        recv.close()


def transfer(
    dev_p: torch.device, dev_d: torch.device, sizes: Sizes, state: dict[str, Any]
) -> dict[str, Any]:
    """One request's KV pages (all layers) prefill -> decode over the cuda wire, two processes."""
    state.pop("model", None)
    torch.cuda.empty_cache()
    spec, ps = sizes.spec, sizes.page_size
    pb = spec.kv_bytes_per_token_per_layer() * ps
    by_address = bool(os.environ.get("DISAGG_WIRE_BY_ADDRESS"))  # driver copies on one GPU too
    ways = [False, True] if by_address or dev_p != dev_d else [False]  # peer kernels too
    refs = {n: _references(dev_p, dev_d, spec.layers, pb, n // ps) for n in sizes.transfer_tokens}
    runs = [
        _transfer_one(dev_p, dev_d, spec.layers, ps, pb, n // ps, refs[n], by_address, k, stack)
        for stack in (True, False)
        for k in ways
        for n in sizes.transfer_tokens
    ]
    return {"page_bytes": pb, "layers": spec.layers, "runs": runs, "target": 0.90}


# ---- report --------------------------------------------------------------------------------
def _row(name: str, measured: str, reference: str, fraction: float, target: float) -> str:
    met = "yes" if fraction >= target else "no"
    return f"| {name} | {measured} | {reference} | {fraction:.0%} | {target:.0%} | {met} |"


def headline(r: dict[str, Any]) -> list[str]:
    s = r["sections"]
    rows = [
        "| figure | measured | reference (same run) | ratio | target | met |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    p, d, t = s.get("prefill", {}), s.get("decode", {}), s.get("transfer", {})
    if "tflops" in p:
        rows.append(
            _row(
                f"prefill {p['tokens']} tok, {p['model']} x{p['layers']}",
                f"{p['tflops']:.0f} TFLOP/s ({p['median_s'] * 1e3:.1f} ms)",
                f"bf16 GEMM {p['gemm_ceiling_tflops']:.0f} TFLOP/s",
                p["fraction_of_ceiling"],
                p["target"],
            )
        )
    if "other_ops_median_s" in p:
        ops = "torch" if p["fused_ops_default"] else "fused"
        rows.append(
            _row(
                f"prefill {p['tokens']} tok, {ops} elementwise ops "
                f"(same token: {p['other_ops_same_token']})",
                f"{p['flops'] / p['other_ops_median_s'] / 1e12:.0f} TFLOP/s "
                f"({p['other_ops_median_s'] * 1e3:.1f} ms)",
                f"bf16 GEMM {p['gemm_ceiling_tflops']:.0f} TFLOP/s",
                p["other_ops_fraction_of_ceiling"],
                p["target"],
            )
        )
    for name, v in d.get("variants", {}).items():
        if "gbps" not in v:
            continue
        rows.append(
            _row(
                f"decode {d['batch']} x {d['context']}, {name} kernel, graph={v['graph']}",
                f"{v['gbps']:.0f} GB/s ({v['median_s'] * 1e3:.2f} ms)",
                f"device copy {d['copy_gbps']:.0f} GB/s",
                v["fraction_of_copy"],
                d["target"],
            )
        )
    for run in t.get("runs", []):
        for lay in ("contiguous", "scattered"):
            for kind in ("device", "end_to_end"):
                g = run[lay][f"{kind}_gbps"]
                rows.append(
                    _row(
                        f"cuda wire {run['tokens']} tok, {lay}, {kind.replace('_', '-')}"
                        f" ({run.get('copies', 'torch')})",
                        f"{g:.0f} GB/s",
                        f"plain copy {run['copy_gbps']:.0f} GB/s (as {t['layers']} per-layer "
                        f"copies {run['per_layer_copy_gbps']:.0f} GB/s; one 2D copy "
                        f"{run.get('copy_2d_gbps', math.nan):.0f} GB/s)",
                        run[lay][f"{kind}_fraction_of_copy"],
                        t["target"],
                    )
                )
    return rows


def write_report(r: dict[str, Any], out: Path) -> None:
    (out / "bench.json").write_text(json.dumps(r, indent=2, default=str))
    lines = [
        f"# gpu_bench {r['date']}",
        "",
        f"- device: {r['device']}",
        f"- command: `{r['command']}`",
        f"- torch {r['torch']}, flashinfer {r['flashinfer']}",
        "",
        *headline(r),
        "",
    ]
    c = r["sections"].get("correctness", {})
    if "rows" in c:
        lines += [
            "| kernel | mode | max abs err | output max | ok |",
            "| --- | --- | --- | --- | --- |",
        ]
        lines += [
            f"| {x['kernel']} | {x['mode']} | {x['max_abs_err']:.2e} | {x['out_max']:.2f} "
            f"| {x['ok']} |"
            for x in c["rows"]
        ]
    for name, sec in r["sections"].items():
        if "error" in sec:
            lines += ["", f"**{name} failed**: `{sec['error']}`"]
    (out / "bench.md").write_text("\n".join(lines) + "\n")


def _flashinfer_version() -> str | None:
    try:
        import flashinfer
    except ImportError:
        return None
    return str(flashinfer.__version__)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prefill-device", type=int, default=0)
    ap.add_argument("--decode-device", type=int, default=0)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--compile", nargs="+", choices=["prefill", "decode", "mla"])
    ap.add_argument("--smoke", action="store_true", help="CPU, toy sizes")
    ap.add_argument("--only", nargs="*", help="run only these sections")
    args = ap.parse_args(argv)
    if args.compile:
        return compile_kernels(args.compile, resolve_device(f"cuda:{args.prefill_device}"))
    sizes = SMOKE if args.smoke else FULL
    dev_p = resolve_device("cpu" if args.smoke else f"cuda:{args.prefill_device}")
    dev_d = resolve_device("cpu" if args.smoke else f"cuda:{args.decode_device}")
    args.out.mkdir(parents=True, exist_ok=True)
    name = torch.cuda.get_device_name(dev_p) if dev_p.type == "cuda" else "cpu"
    report: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "device": name,
        "command": " ".join(sys.argv),
        "torch": torch.__version__,
        "flashinfer": _flashinfer_version(),
        "sections": {},
    }
    sections: dict[str, Callable[[], dict[str, Any]]] = {
        "correctness": lambda: correctness(dev_p),
        "gemm": lambda: gemm_ceiling(dev_p, sizes),
        "copy": lambda: copy_bandwidth(dev_p, sizes),
        "prefill": lambda: prefill(dev_p, sizes, state),
        "decode": lambda: decode(dev_d, sizes, state),
        "transfer": lambda: transfer(dev_p, dev_d, sizes, state),
    }
    if args.smoke:
        del sections["correctness"], sections["transfer"]
    state: dict[str, Any] = {}
    for sec, fn in sections.items():
        if args.only and sec not in args.only:
            continue
        t0 = time.perf_counter()
        try:
            result = fn()
        except Exception as e:  # recorded; the other sections still run
            result = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
        result["wall_s"] = time.perf_counter() - t0
        report["sections"][sec] = state[sec] = result
        print(
            json.dumps({sec: {k: v for k, v in result.items() if k != "traceback"}}, default=str),
            flush=True,
        )
        write_report(report, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Measure step times of the real model: the table the simulator's cost model is calibrated on.

`profile` times prefill steps over (new tokens x cached tokens) for one sequence, and decode
steps over (batch x cached tokens per sequence), each the median (or `reduce`) of `repeats`
runs after `warmup` runs (CUDA events on a GPU, wall clock on the CPU). Durations are for the
model cut to `layers` layers. With `mixed` it also times mixed passes: a prompt chunk of
`tokens` new tokens (no cached ones) beside `batch` decodes of `context` cached tokens each.
With `decode_mix` it also times each decode batch, and each mixed pass, with decodes whose
contexts spread as a server's do: drawn from `decode_mix` (`mix_contexts`), the context
column their mean; and once more drawn from its longest quarter, whose mean a server's small
batches often pass (`long_mixes`: the batches the profile's cache has room for). A server's
batch mixes long and short sequences, and a large one takes longer than one whose sequences
all have its mean context, which a line through uniform batches does not see
(`benchmarks/decode_shape.py`); and a mixed pass reads its decodes' context in the prefill
kernel, more slowly than a decode pass does, which mixed passes at one short context do not
show (docs/calibration.md, "Not the graphs: the mix of contexts").
Columns: kind ("prefill" / "decode" / "mixed"), tokens (new tokens in the step: prefill tokens,
the decode batch, or a mixed pass's chunk), batch, context (cached tokens per decoding or
prefilling sequence; a decode row's mean), duration_s, host_s, graph_batch (the batch of the
CUDA graph a decode row replayed, its other rows padding; 0: it ran eagerly, as prefill and
mixed rows always do).

Each step runs as a serving loop runs it, one at a time: `Runner.step(..., sample=True)` and
its final sync, timed by wall clock. duration_s is its device time as a server records it
(`Runner.device_s`: CUDA events around the forward, after the inputs are staged), host_s the
rest of its wall time (building and planning the batch, staging, sampling), each the `reduce`
of its repeats. So a profile's passes and a hw run's steps table split a pass alike. On the
CPU the step is host work throughout: duration_s is its wall time and host_s is 0.
"""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import pandas as pd
import torch

from disagg.core.kvcache import Layout, pages_for
from disagg.hw.batch import Seq
from disagg.hw.device import release, resolve_device
from disagg.hw.model import Transformer
from disagg.hw.runner import Runner, graph_batch_for
from disagg.models import ModelSpec

COLUMNS = ["kind", "tokens", "batch", "context", "duration_s", "host_s", "graph_batch"]


def mix_contexts(pool: Sequence[int], batch: int, seed: int = 0) -> tuple[int, ...]:
    """`batch` contexts that spread as `pool` does: its quantiles at (i + 1/2) / batch, in an
    order shuffled by `seed` and the batch (a server's batch is not sorted by length)."""
    ranked = sorted(pool)
    picks = [ranked[int((i + 0.5) * len(ranked) / batch)] for i in range(batch)]
    random.Random(seed * 1_000_003 + batch).shuffle(picks)
    return tuple(picks)


def long_mixes(
    pool: Sequence[int], batches: Sequence[int], seed: int
) -> dict[int, tuple[int, ...]]:
    """Per batch, contexts drawn from the longest quarter of `pool` (`mix_contexts`): a server's
    small batches often hold only long sequences, past the whole pool's mean. Only batches whose
    long mix needs no more tokens than the whole pool's mix at the largest batch (the cache the
    profile holds anyway): a large batch's mean stays near the pool's."""
    if not pool or not batches:
        return {}
    ranked = sorted(pool)
    longest = ranked[len(ranked) * 3 // 4 :]
    room = sum(mix_contexts(pool, max(batches), seed))
    mixes = {b: mix_contexts(longest, b, seed) for b in batches}
    return {b: m for b, m in mixes.items() if sum(m) <= room}


def decode_seqs(
    contexts: Sequence[int], page_size: int, vocab: int, pages: Sequence[int] | None = None
) -> list[Seq]:
    """One new token after each of `contexts`, the sequences on consecutive runs of `pages`
    (default: the pages from 0)."""
    seqs, start = [], 0
    for i, c in enumerate(contexts):
        n = pages_for(c + 1, page_size)
        run = range(start, start + n) if pages is None else pages[start : start + n]
        seqs.append(Seq.decode((7919 * i) % vocab, c, run))
        start += n
    return seqs


def _prompt(new: int, context: int, page_size: int, vocab: int, first: int = 0) -> Seq:
    """A sequence of `new` tokens after `context` cached ones, on the pages from `first`."""
    tokens = tuple((7919 * j) % vocab for j in range(new))
    return Seq(tokens, context, tuple(range(first, first + pages_for(context + new, page_size))))


def _time_step(
    runner: Runner,
    seqs: list[Seq],
    device: torch.device,
    warmup: int,
    repeats: int,
    reduce: Callable[[list[float]], float],
) -> tuple[float, float]:
    """(duration_s, host_s) of a step of `seqs` (see the module doc)."""
    walls, devices = [], []
    for i in range(warmup + repeats):
        sync(device)
        t0 = time.perf_counter()
        runner.step(seqs, sample=True)
        sync(device)
        if i >= warmup:
            walls.append(time.perf_counter() - t0)
            devices.append(runner.device_s())
    if device.type != "cuda":
        return reduce(walls), 0.0
    return reduce(devices), max(reduce([w - d for w, d in zip(walls, devices, strict=True)]), 0.0)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def profile(
    spec: ModelSpec,
    layers: int,
    device: str | torch.device = "cuda",
    *,
    prefill_tokens: Sequence[int] = (256, 1024, 4096, 8192),
    prefill_context: Sequence[int] = (0, 4096),
    decode_batch: Sequence[int] = (1, 8, 32, 64, 128),
    decode_context: Sequence[int] = (1024, 4096),
    page_size: int = 16,
    layout: Layout = "HND",
    warmup: int = 2,
    repeats: int = 5,
    seed: int = 0,
    attention: str = "auto",
    reduce: Callable[[list[float]], float] = statistics.median,
    mixed: Sequence[tuple[int, int, int]] = (),
    fused_ops: bool = True,
    decode_mix: Sequence[int] = (),
    weight_cache: str | None = None,
    prefill_graphs: Sequence[int] = (),
) -> pd.DataFrame:
    """Step durations and host times over the grids, each `reduce` (default: the median) of
    its `repeats` times (see the module doc for the columns). `min` suits a shared CPU, where
    a run of the same shape is now and then stalled by other processes. `fused_ops`: the
    model's FlashInfer elementwise kernels on CUDA (as the experiment's hw.latency.fused_ops).
    `weight_cache`: where drawn weights are kept (as the experiment's hw.weight_cache).
    `prefill_graphs`: passes with a prompt chunk in CUDA graphs between their attentions (as
    the experiment's hw.latency.prefill_graphs, captured before the first pass)."""
    dev = resolve_device(device)
    model = Transformer(
        spec.with_layers(layers),
        seed=seed,
        device=dev,
        fused_ops=fused_ops,
        weight_cache=weight_cache,
    )
    prefill = [(n, c) for n in prefill_tokens for c in prefill_context]
    batches = sorted({*decode_batch, *(b for _, b, _ in mixed)}) if decode_mix else []
    mixes = {b: mix_contexts(decode_mix, b, seed) for b in batches}
    mixes_long = long_mixes(decode_mix, batches, seed)
    decode = [(c,) * b for b in decode_batch for c in decode_context]
    for mix in (mixes, mixes_long):
        decode += [mix[b] for b in decode_batch if b in mix]
    beside = [(n, (c,) * b) for n, b, c in mixed]  # a chunk and its decodes' contexts
    for mix in (mixes, mixes_long):
        beside += [(n, mix[b]) for n, b, _ in mixed if b in mix]

    def pages(ctx: Sequence[int]) -> int:  # decodes of these contexts, a new token each
        return sum(pages_for(c + 1, page_size) for c in ctx)

    need = [pages_for(n + c, page_size) for n, c in prefill]
    need += [pages(ctx) for ctx in decode]
    need += [pages_for(n, page_size) + pages(ctx) for n, ctx in beside]
    cache = model.new_cache(max(need, default=1), page_size, layout)
    # as a colocated or decode server runs its passes: no layer counter (a prefill server's
    # two ops a layer are a small part of its long passes)
    runner = Runner(
        model, cache, attention=attention, count_layers=False, prefill_graphs=prefill_graphs
    )
    runner.capture_pieces()
    rows = []
    for n, c in prefill:
        seqs = [_prompt(n, c, page_size, spec.vocab)]
        device_s, host_s = _time_step(runner, seqs, dev, warmup, repeats, reduce)
        rows.append(("prefill", n, 1, c, device_s, host_s, 0))
    for ctx in decode:  # context: the sequences' mean (rounded), which the cost model reads
        seqs = decode_seqs(ctx, page_size, spec.vocab)
        device_s, host_s = _time_step(runner, seqs, dev, warmup, repeats, reduce)
        graph = 0 if runner.graph_error else graph_batch_for(runner.graph_batches, len(ctx)) or 0
        rows.append(("decode", len(ctx), len(ctx), _mean(ctx), device_s, host_s, graph))
    for n, ctx in beside:  # the chunk's pages after the decodes'
        decodes = decode_seqs(ctx, page_size, spec.vocab)
        chunk = _prompt(n, 0, page_size, spec.vocab, first=pages(ctx))
        device_s, host_s = _time_step(runner, [chunk, *decodes], dev, warmup, repeats, reduce)
        rows.append(("mixed", n, len(ctx), _mean(ctx), device_s, host_s, 0))
    del runner, cache, model
    release(dev)  # what the caller runs next (validate: its servers) gets the memory
    return pd.DataFrame(rows, columns=COLUMNS)


def _mean(contexts: Sequence[int]) -> int:
    """A row's context column: its sequences' mean context, rounded (0 for none)."""
    return round(sum(contexts) / len(contexts)) if contexts else 0


def write_csv(df: pd.DataFrame, path: str | Path) -> Path:
    """Write a profile table as CSV (no index column); returns the path."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    df.to_csv(out, index=False)
    return out

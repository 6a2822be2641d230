"""Step time of one forward pass from the batch shape: a roofline with named efficiencies.

A node runs `dp` attention groups of `tp` ranks; a step costs, per GPU of its busiest group,
summed over its parts:
- dense GEMMs: max(FLOPs / (peak * gemm_efficiency), weight bytes / (HBM * memory_efficiency)).
  Every group holds the attention projections, split over its tp ranks, and runs them for its
  own tokens; the other dense weights (dense MLPs, shared experts, routers, LM head) are split
  over all of the node's GPUs and see all of the step's tokens;
- MoE experts (spread over all GPUs): FLOPs of the routed tokens vs. bytes of the distinct
  experts they touch (expected distinct experts E * (1 - (1 - k/E)^T) per layer for T tokens);
- attention: FLOPs by qo_len x kv_len vs. the KV bytes read (MLA's latent is replicated
  under TP, so each rank reads all of it);
- elementwise work (norms, RoPE, residual adds, the MLP activation): HBM traffic in proportion
  to tokens, `elementwise_hidden_passes` reads or writes of each token's hidden state per layer
  on every rank of its group, plus the activation (gate and up read, product written);
- communication: two all-reduces per layer over the group's tp ranks, or with DP attention the
  MoE dispatch/combine all-to-all, each a latency per collective and per peer step plus its
  bytes over NVLink (CostConfig says how the defaults match NCCL);
- fixed overhead per step and per layer (scheduling, sampling, launch gaps);
- with speculative decoding, `draft_tokens` passes of the draft module over the decodes. It is
  assumed to cost one transformer layer of the model (an MoE layer when it has them) plus the
  LM head per draft token, as DeepSeek's MTP module does (its small input projection and norms
  left out); its attention reads the sequences' context for that one layer.
A step's decodes spread evenly over the DP groups; each prompt chunk runs whole on one group
(`RooflineCost.prefill_share` bounds the busiest group's share of the prompt tokens).
Every sum over sequences is precomputed by the caller, so a step costs O(1) here.
`decode_line(batch)` gives (a, b) with step time a + b * total_context for decode-only batches,
which lets a decode node run many identical steps as one event.
"""

from __future__ import annotations

import bisect
import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from disagg.config import CostConfig, Experiment, GroupConfig, SpecConfig
from disagg.errors import ConfigError
from disagg.hardware import GPU
from disagg.models import ModelSpec, dtype_bytes
from disagg.settings import pieces_size

if TYPE_CHECKING:
    import pandas as pd

QUERY_TILE = 128  # query rows per attention tile (keys are re-read once per tile)
ACT = 2  # bytes per activation element (bf16)


@dataclass(slots=True)  # a value, not frozen only because a frozen __init__ costs more
class StepShape:
    """A batch as the cost model sees it.

    prefill_tokens: new prompt tokens in the step; prefill_attn_pairs: sum over chunks of
    (query, key) pairs, i.e. n*c + n*(n+1)/2 for a chunk of n tokens after c cached ones;
    decode_seqs: decoding sequences; decode_context: their cached tokens, summed.
    """

    prefill_tokens: int = 0
    prefill_attn_pairs: float = 0.0
    decode_seqs: int = 0
    decode_context: float = 0.0


class RooflineCost:
    """Roofline step times for one node group (see the module docstring)."""

    def __init__(
        self,
        model: ModelSpec,
        gpu: GPU,
        group: GroupConfig,
        cost: CostConfig,
        spec: SpecConfig,
        weight_dtype: str = "bf16",
        kv_dtype: str = "bf16",
    ) -> None:
        self.model, self.gpu, self.group, self.cost = model, gpu, group, cost
        self.decode_qo = 1 + spec.draft_tokens
        self.wbytes = dtype_bytes(weight_dtype)
        self.flops = gpu.flops(weight_dtype) * cost.gemm_efficiency
        self.attn_flops = gpu.bf16_flops * cost.attention_efficiency
        self.hbm = gpu.hbm_bandwidth_bps * cost.memory_efficiency
        self.nvlink = gpu.nvlink_bandwidth_bps * cost.allreduce_efficiency
        m, tp = model, group.tp
        self.gpus = tp * group.dp
        self.is_moe, self.moe_layers = m.is_moe, m.moe_layers  # read by every step_time
        kv_shards = 1 if m.attention == "mla" else min(tp, m.kv_heads)
        # per GPU of one DP group, for that group's own sequences (heads split over its tp)
        self.kv_read_per_token = m.kv_bytes_per_token(kv_dtype) / kv_shards  # all layers
        self.attn_flops_per_pair = m.layers * m.attn_flops(1) / tp  # decode (absorbed)
        self.prefill_flops_per_pair = m.layers * m.attn_flops(1, absorbed=False) / tp
        # attention projections: every DP group holds them, split over its tp ranks only
        attn_params = m.layers * m.attn_params_per_layer
        self.attn_flops_per_token = 2 * attn_params / tp
        self.attn_bytes = attn_params * self.wbytes / tp
        # the other dense weights (dense MLPs, shared experts, routers, LM head): all GPUs
        routed = m.moe_layers * m.experts_per_token * m.expert_params
        other = m.active_params_per_token - attn_params - routed
        self.dense_flops_per_token = 2 * other / self.gpus
        self.dense_bytes = other * self.wbytes / self.gpus
        # elementwise traffic: the hidden state on every rank of a group, the MLP activation
        # (gate and up read, their product written) split over all GPUs
        self.stream_bytes_per_token = m.layers * cost.elementwise_hidden_passes * m.hidden * ACT
        width = (m.layers - m.moe_layers) * m.intermediate + m.moe_layers * (
            m.experts_per_token + m.shared_experts
        ) * m.moe_intermediate
        self.act_bytes_per_token = 3 * width * ACT / self.gpus
        self.step_fixed_s = cost.step_overhead_s + m.layers * cost.layer_overhead_s
        self.draft_tokens = spec.draft_tokens
        self.draft = (  # the draft module: one layer (an MoE one if the model has them) + LM head
            RooflineCost(
                replace(m, layers=1, dense_layers=0),
                gpu,
                group,
                cost.model_copy(update={"step_overhead_s": 0.0}),
                SpecConfig(),
                weight_dtype,
                kv_dtype,
            )
            if spec.draft_tokens
            else None
        )
        self._lines: dict[int, tuple[float, float]] = {}  # decode_line by batch size

    # ---- parts -------------------------------------------------------------------------
    def _gemm(self, tokens: float, group_tokens: float) -> float:
        """All of the step's `tokens` meet the weights spread over every GPU; the busiest DP
        group's `group_tokens` meet its attention projections."""
        m = self.model
        flops = group_tokens * self.attn_flops_per_token + tokens * self.dense_flops_per_token
        dense = max(flops / self.flops, (self.attn_bytes + self.dense_bytes) / self.hbm)
        if not self.is_moe or tokens == 0:
            return dense
        routed = tokens * m.experts_per_token
        distinct = m.experts * (1 - (1 - m.experts_per_token / m.experts) ** tokens)
        moe_flops = 2 * routed * m.expert_params * self.moe_layers / self.gpus
        moe_bytes = distinct * m.expert_params * self.moe_layers * self.wbytes / self.gpus
        return dense + max(moe_flops / self.flops, moe_bytes / self.hbm)

    def collective_s(self, nbytes: float, steps: int) -> float:
        """One collective of `steps` peer steps moving `nbytes` per GPU over NVLink."""
        c = self.cost
        return c.collective_latency_s + steps * c.collective_step_latency_s + nbytes / self.nvlink

    def allreduce_s(self, nbytes: float) -> float:
        """One all-reduce of an `nbytes` message over the group's tp ranks."""
        p = self.group.tp
        wire = nbytes if self.cost.allreduce_in_switch else 2 * (p - 1) / p * nbytes
        return self.collective_s(wire, 2 * (p - 1))

    def _comm(self, group_tokens: float) -> float:
        m, g = self.model, self.group
        act = group_tokens * m.hidden * ACT  # the busiest DP group's hidden states
        t = 0.0
        if g.tp > 1:  # two all-reduces per layer (attention output, MLP output)
            t += 2 * m.layers * self.allreduce_s(act)
        if g.dp > 1 and self.is_moe:  # dispatch + combine of each token's top-k hidden states
            per_gpu = act * m.experts_per_token / g.tp
            t += self.moe_layers * 2 * self.collective_s(per_gpu, self.gpus - 1)
        return t

    def _elementwise(self, tokens: float, group_tokens: float) -> float:
        traffic = group_tokens * self.stream_bytes_per_token + tokens * self.act_bytes_per_token
        return traffic / self.hbm

    def _attention(self, pairs: float, context: float, flops_per_pair: float) -> float:
        flops = pairs * flops_per_pair
        return max(flops / self.attn_flops, context * self.kv_read_per_token / self.hbm)

    def prefill_share(self, s: StepShape) -> float:
        """The fraction of the step's prompt tokens on its busiest DP group. A chunk runs on
        one group, so that group holds at least the token-weighted mean chunk, sum(n^2)/sum(n)
        (from the pairs: 2 * pairs / tokens - 1 for chunks without cached tokens; cached tokens
        make it larger), and at least 1/dp of the tokens."""
        n, dp = s.prefill_tokens, self.group.dp
        if dp == 1 or n == 0:
            return 1.0
        mean_chunk = 2 * s.prefill_attn_pairs / n - 1
        return min(max(mean_chunk / n, 1 / dp), 1.0)

    # ---- public ------------------------------------------------------------------------
    def step_time(self, s: StepShape) -> float:
        """Seconds for one forward pass of batch shape `s`."""
        tokens = s.prefill_tokens + s.decode_seqs * self.decode_qo
        if tokens == 0:
            return 0.0
        dp, share = self.group.dp, self.prefill_share(s)
        group_tokens = share * s.prefill_tokens + s.decode_seqs * self.decode_qo / dp
        pairs = share * s.prefill_attn_pairs
        t = (
            self.step_fixed_s
            + self._gemm(tokens, group_tokens)
            + self._comm(group_tokens)
            + self._elementwise(tokens, group_tokens)
            # flash attention reads each key once per tile of queries
            + self._attention(pairs, pairs / QUERY_TILE, self.prefill_flops_per_pair)
            # decodes spread evenly over the DP groups
            + self._attention(
                s.decode_context * self.decode_qo / dp,
                s.decode_context / dp,
                self.attn_flops_per_pair,
            )
        )
        if self.draft is not None and s.decode_seqs:
            drafts = StepShape(decode_seqs=s.decode_seqs, decode_context=s.decode_context)
            t += self.draft_tokens * self.draft.step_time(drafts)
        return t

    def host_s(self, prefill: bool, decodes: int) -> float:
        """The host share of a pass's step time: none (the roofline models the device)."""
        return 0.0

    def chain_s(self, decodes: int) -> float:
        """What a chained pass takes beyond its device time: none (ProfileCost.chain_s)."""
        return 0.0

    fades_s = 0.0  # no decode pass runs longer after a chunk pass (ProfileCost.after_chunk)

    def decode_line(self, seqs: int, since_chunk_s: float = math.inf) -> tuple[float, float]:
        """(a, b): a decode-only step of `seqs` sequences with total context K takes a + b*K
        (`since_chunk_s` does not change it)."""
        line = self._lines.get(seqs)
        if line is None:
            line = self._lines[seqs] = self._decode_line(seqs)
        return line

    def _decode_line(self, seqs: int) -> tuple[float, float]:
        a = self.step_time(StepShape(decode_seqs=seqs))  # no context: no attention
        dp = self.group.dp
        b = self._attention(self.decode_qo / dp, 1 / dp, self.attn_flops_per_pair)
        if self.draft is not None:
            b += self.draft_tokens * self.draft.decode_line(seqs)[1]
        return a, b


class ProfileCost:
    """Step times interpolated from a table measured by `disagg hw profile`.

    The CSV has columns kind ("prefill"/"decode"/"mixed"), tokens, batch, context, duration_s.
    Prefill rows give a pass of `tokens` new tokens after `context` cached ones; decode rows a
    pass of `batch` sequences of `context` cached tokens each; mixed rows (optional) a pass of
    a `tokens`-token prompt chunk beside `batch` decodes of `context` cached tokens. Each
    measured curve is made non-decreasing before use (a longer pass never costs less; noise can
    say otherwise). Between grid points times interpolate linearly; below the grid they hold
    the smallest point's time (a pass's fixed costs do not shrink); above it they extrapolate
    the last segment, and `extrapolated` counts those passes. A mixed pass costs its prefill
    and decode parts plus an offset: what the measured mixed passes took beyond their two parts
    (negative: the fixed costs they share), the median at each (decodes, chunk) measured,
    interpolated linearly over the chunk, then between the measured decode batches by the
    decodes' own device time (eager, at no context; by their count where it does not grow),
    and held beyond them (`mixed_offset`; `mixed_offset_s` is the median of all), 0 without
    mixed rows. The offset is mostly the decodes' weights, which the chunk reads anyway: an
    MoE model's decode time rises steeply with its first sequences, each activating experts
    of its own, and then saturates, and so does the part its chunk already paid for (on one
    H100, with the offset linear in the decodes between 11 and 120, the profile costed
    Qwen3-30B-A3B's passes beside 20-60 decodes 4-13% over what they ran; 2026-12-07c). Where a
    (decodes, chunk) was measured at more than one decode context, the offset also grows with
    the decodes' context in all, at `mixed_context_s` per token (the median of those shapes'
    slopes; the offsets are then taken at no context): a mixed pass's attention runs its
    decodes in the prefill kernel, which reads their context more slowly than the decode
    kernel (docs/calibration.md, "Mixed passes read their decodes' context slowly"). The table
    must come from the same model and depth as the experiment.

    The curves above are device time. A pass also costs the host time the serving loop spends
    around it (batch building, planning, sampling, the sync): the optional column host_s (0
    where a table lacks it). Each kind's host time is the median of its rows (a mixed pass
    without mixed rows: the larger of the prefill and decode medians), not a curve: that work
    barely depends on the shape, and host_s is a difference of two timings (wall minus
    device), noisy point by point, so a curve through it would add noise to every pass and
    bend what extrapolation extends. `run_host` (s per decode pass, s per pass with a prompt
    chunk, s per sequence[, s per mixed pass, s per decode beside its chunk]), measured on a
    serving run (`disagg validate` does), replaces those medians: a pass then costs its kind's
    fixed part + per-sequence x its sequences (decodes, plus one for a prompt chunk) of host
    time, which grows with the batch as a server's bookkeeping does; where the last two are
    given, a mixed pass (a chunk beside decodes) costs its own fixed part + per decode instead
    (on one H100 a mixed pass's grows by 20-29 us a decode, a decode pass's by 0-17). On top
    of that, `pass_overhead_s` (default 0): a fixed cost per pass for the serving loop's time
    between passes. `chain` (s, and s per sequence; default none): what a chained decode pass
    (hw.latency.chain) takes beyond its device time, its host time having run during the pass
    before: the GPU's work outside the passes' device events (the pass before's sampling and
    the copy of its tokens out, this pass's inputs), on one H100 0.043-0.050 ms + 0.001 ms a
    sequence for Qwen3-30B-A3B (`disagg validate` measures it). `chunk_offsets` ((chunk
    tokens, s) points, tokens increasing; default none): what a serving run's passes with a
    prompt chunk took on the device beyond this table's cost of them, interpolated over the
    tokens the chunk is costed at (`padded_chunk`) and held beyond the ends, added to every
    pass with a chunk (`disagg validate` measures it: a server's small chunks run longer than
    the profile's, its large ones shorter). `decode_scale` (default 1) multiplies the device
    time of every pass's decodes: a disaggregated decode server's passes alone ran 2-3% faster
    than the profile's at their shape on one H200 (`disagg validate` measures it).
    `after_chunk` ((seconds, fraction) points, seconds increasing; default none): how much
    longer than the table a decode-only pass runs on the device by the time from the end of
    its node's last pass with a prompt chunk to its start (`decode_line`'s `since_chunk_s`),
    interpolated, held before the first point and none from the last (`fades_s`) on: on one
    H200 or H100 a decode pass right after a chunk pass ran 2-4% longer, fading over 150 ms
    (`disagg validate` measures it; docs/calibration.md, "The serving loop").
    `graph_scales` ((batch, factor) points; default none) multiplies the device time of a
    decode-only pass replayed in a CUDA graph (`graph_batch`): the factor interpolated over
    the points whose batch lies in the same graph (above the graph before it), held at their
    ends, 1 in a graph without points. On one H200 or H100 a server's passes of up to 16
    sequences ran as the profile's rows, and those in the graph of 32 up to 8% longer, the
    more the emptier the graph (`disagg validate` measures them; docs/calibration.md).
    With `graphs` (a server that replays decode passes in CUDA graphs, as the hw runner
    does on one GPU), a decode-only pass of b sequences costs the lines of the rows its graph
    ran, interpolated at b (held below the first): its graph is the smallest batch at or above
    b whose row filled it (the optional column graph_batch, which `disagg hw profile` writes;
    none in a table without it), and its rows those of the batches above the graph before it.
    A dense model's pass of 25 sequences costs about what 32's row says, not a point between
    16 and 32 (`benchmarks/decode_shape.py`, docs/calibration.md); an MoE model's graph costs
    more the more of its rows are real, whose experts they pick (Qwen3-30B-A3B on one H100:
    5.0 ms at 11 sequences in the graph of 16, 5.6 at 16). Mixed passes run eagerly and
    interpolate over every batch. With `pieces` (the
    experiment's hw.latency.prefill_graphs, which the profile ran with too), a pass with a prompt
    chunk whose tokens, decodes' included, fit a piece replays that piece's graphs, padded to its
    size (disagg.hw.pieces): its chunk costs what the piece holds besides the decodes
    (`padded_chunk`), at the context that gives it the chunk's own attention pairs (the padding
    takes no attention), so a chunk of 1,235 tokens costs what the 2,048-token piece does, not a
    point between the grid's chunks; the table's own rows are read at their padded sizes.
    """

    def __init__(
        self,
        path: Path,
        decode_qo: int = 1,
        pass_overhead_s: float = 0.0,
        run_host: tuple[float, ...] | None = None,
        chunk_offsets: Sequence[tuple[float, float]] = (),
        decode_scale: float = 1.0,
        graphs: bool = False,
        pieces: Sequence[int] = (),
        after_chunk: Sequence[tuple[float, float]] = (),
        graph_scales: Sequence[tuple[float, float]] = (),
        chain: tuple[float, float] = (0.0, 0.0),
    ) -> None:
        import pandas as pd

        try:
            df = pd.read_csv(path)
        except FileNotFoundError:
            raise ConfigError(f"cost profile {path} not found") from None
        missing = {"kind", "tokens", "batch", "context", "duration_s"} - set(df.columns)
        if missing:
            raise ConfigError(f"cost profile {path}: missing columns {sorted(missing)}")
        self.decode_qo = decode_qo
        self.pieces = sorted(pieces)
        if self.pieces:  # each row with a chunk at the size its pass ran at
            chunk = df.kind.isin(["prefill", "mixed"])
            decodes = np.where(df.kind == "mixed", df.batch, 0)
            padded = [
                padded_chunk(self.pieces, int(n), int(b) * decode_qo)
                for n, b in zip(df.tokens, decodes, strict=True)
            ]
            df = df.assign(tokens=np.where(chunk, padded, df.tokens))
        self.prefill = df[df.kind == "prefill"].groupby(["context", "tokens"]).duration_s.median()
        # per profiled context: its tokens and their non-decreasing times (read by every pass)
        self._contexts = np.array(sorted({c for c, _ in self.prefill.index}), float)
        self._prefill_curves = [
            (row.index.to_numpy(float), np.maximum.accumulate(row.to_numpy(float)))
            for row in (self.prefill.loc[c] for c in self._contexts)
        ]
        self.decode = df[df.kind == "decode"].groupby(["batch", "context"]).duration_s.median()
        if self.prefill.empty or self.decode.empty:
            raise ConfigError(f"cost profile {path}: needs both prefill and decode rows")
        self._batches = np.array(sorted({b for b, _ in self.decode.index}), float)
        # per profiled batch, its line over the batch's cached tokens: intercept, and slope
        self._icepts, self._per_token = np.array(
            [_batch_line(self.decode.loc[int(b)], b) for b in self._batches]
        ).T
        self._lines: dict[tuple[int, bool], tuple[float, float]] = {}  # _device_line's
        self.max_prefill_tokens = int(df[df.kind == "prefill"].tokens.max())
        self.max_prefill_context = float(self._contexts[-1])
        self.max_decode_batch = int(self.decode.index.get_level_values(0).max())
        self.max_decode_context = int(self.decode.index.get_level_values(1).max())
        self.passes = 0  # passes costed
        self.extrapolated = 0  # of which beyond the grid on some axis
        mixed = df[df.kind == "mixed"]
        cached = (mixed.batch * mixed.context).to_numpy(float)  # the decodes' context in all
        parts = zip(mixed.tokens, mixed.batch, cached, mixed.duration_s, strict=True)
        beyond = pd.Series(
            [
                float(t) - self._prefill_time(int(n), 0.0) - self._decode_time(int(b), k)
                for n, b, k, t in parts
            ],
            index=pd.MultiIndex.from_arrays([mixed.batch, mixed.tokens]),
            dtype=float,
        )
        # per (decodes, chunk) measured at two contexts or more: how the part beyond grows
        # with the decodes' context (a mixed pass's attention runs them in the prefill kernel)
        by_shape = pd.DataFrame({"k": cached, "beyond": beyond.to_numpy()}, index=beyond.index)
        slopes = [
            float(np.polyfit(g.k, g.beyond, 1)[0])
            for _, g in by_shape.groupby(level=[0, 1])
            if g.k.nunique() > 1
        ]
        self.mixed_context_s = float(np.median(slopes)) if slopes else 0.0
        beyond -= self.mixed_context_s * cached  # each offset at no context
        self.mixed_offset_s = float(beyond.median()) if len(beyond) else 0.0
        # per measured decode batch: its chunks' tokens and offsets (median of repeats)
        offsets = beyond.groupby(level=[0, 1]).median()
        batches = sorted({b for b, _ in offsets.index})
        self._offset_batches = np.array(batches, float)
        self._offset_times = [self._decode_time(int(b), 0.0) for b in batches]  # eager, no context
        self._offset_rows = [
            (row.index.to_numpy(float), row.to_numpy(float))
            for row in (offsets.loc[b] for b in batches)
        ]
        host = df.host_s.to_numpy(float) if "host_s" in df.columns else np.zeros(len(df))
        bad = ~(np.isfinite(host) & (host >= 0))
        if bad.any():
            raise ConfigError(
                f"cost profile {path}: host_s {float(host[bad][0])!r}: give seconds >= 0"
            )
        if not 0 <= pass_overhead_s < np.inf:
            raise ConfigError(f"pass_overhead_s {pass_overhead_s!r}: give seconds >= 0")
        by_kind = pd.Series(host, index=df.index).groupby(df.kind).median()
        self.prefill_host_s = float(by_kind["prefill"])
        self.decode_host_s = float(by_kind["decode"])
        self.mixed_host_s = float(
            by_kind.get("mixed", max(self.prefill_host_s, self.decode_host_s))
        )
        self.pass_overhead_s = pass_overhead_s
        if run_host is not None and (
            len(run_host) not in (3, 5) or not all(0 <= v < np.inf for v in run_host)
        ):
            raise ConfigError(f"run_host {run_host!r}: give 3 or 5 times, seconds >= 0")
        if run_host is not None and len(run_host) == 3:  # a mixed pass as one with a chunk
            run_host = (*run_host, run_host[1] + run_host[2], run_host[2])
        self.run_host = run_host
        self.chain = chain
        self._chunk_xs, self._chunk_ys = _points(
            "chunk_offsets",
            chunk_offsets,
            0.0,
            -np.inf,
            "(tokens, seconds) points with tokens > 0 increasing and finite seconds",
        )
        if not 0 < decode_scale < np.inf:
            raise ConfigError(f"decode_scale {decode_scale!r}: give a factor > 0")
        self.decode_scale = decode_scale
        self._after_ts, self._after_lifts = _points(
            "after_chunk",
            after_chunk,
            -1.0,
            -1.0,
            "(seconds, fraction) points with seconds >= 0 increasing and fractions > -1",
        )
        # decode passes later than this run as profiled
        self.fades_s = float(self._after_ts[-1]) if len(self._after_ts) else 0.0
        filled = df[(df.kind == "decode") & (df.get("graph_batch", 0) == df.batch)]
        self.graph_batches = sorted({int(b) for b in filled.batch}) if graphs else []
        points = sorted((float(b), float(f)) for b, f in graph_scales)
        if not all(0 < f < np.inf for _, f in points):
            raise ConfigError(f"graph_scales {list(graph_scales)!r}: give factors > 0")
        self._graph_points = points
        self._scales: dict[int, float] = {}  # graph_scale by batch

    def graph_scale(self, seqs: int) -> float:
        """The factor on the device time of a decode-only pass of `seqs` sequences replayed in
        its CUDA graph (`graph_scales`, see the class doc): interpolated over the points of its
        graph's batches, held at their ends; 1 in a graph without points, or eagerly."""
        scale = self._scales.get(seqs)
        if scale is None:
            graph, graphs = self.graph_batch(seqs), self.graph_batches
            own = []
            if graph in graphs:  # else eager: no graphs, or above the largest
                low = graphs[graphs.index(graph) - 1] if graph != graphs[0] else 0
                own = [(b, f) for b, f in self._graph_points if low < b <= graph]
            xs, ys = [b for b, _ in own], [f for _, f in own]
            scale = self._scales[seqs] = float(np.interp(seqs, xs, ys)) if own else 1.0
        return scale

    def graph_batch(self, seqs: int) -> int:
        """The batch whose line a decode-only pass of `seqs` sequences costs (see the class
        doc): `seqs` itself without `graphs` or above the largest graph the table has."""
        i = bisect.bisect_left(self.graph_batches, seqs)
        return self.graph_batches[i] if i < len(self.graph_batches) else seqs

    def chunk_offset(self, tokens: int) -> float:
        """The serving runs' device time beyond the table's for a pass with a `tokens`-token
        prompt chunk (see the class doc); 0 without `chunk_offsets`."""
        if not len(self._chunk_xs):
            return 0.0
        return float(np.interp(tokens, self._chunk_xs, self._chunk_ys))

    def mixed_offset(self, decodes: int, tokens: int) -> float:
        """What a mixed pass of a `tokens`-token chunk beside `decodes` decodes costs beyond its
        two parts (see the class doc)."""
        if not self._offset_rows:
            return 0.0
        at = [np.interp(tokens, xs, ys) for xs, ys in self._offset_rows]
        return float(np.interp(self._among_batches(decodes), range(len(at)), at))

    def _among_batches(self, decodes: int) -> float:
        """Where `decodes` falls among the mixed rows' decode batches, as a fractional index,
        held at the ends: by the decodes' own device time (eager, at no context) between the
        two batches around it, or by their count where that time does not grow between them.
        That time does not fall as decodes are added (`_device_line` takes the intercepts'
        running maximum), so the share lies between 0 and 1."""
        batches = self._offset_batches
        i = int(np.searchsorted(batches, decodes, side="right")) - 1
        if i < 0 or i == len(batches) - 1:
            return float(max(i, 0))
        lo, hi = batches[i], batches[i + 1]
        t_lo, t_hi = self._offset_times[i : i + 2]
        t = self._decode_time(decodes, 0.0)
        rises = t_hi - t_lo > 1e-9 * t_hi  # beyond the lines' rounding
        share = (t - t_lo) / (t_hi - t_lo) if rises else (decodes - lo) / (hi - lo)
        return i + share

    def _prefill_time(self, tokens: int, context: float) -> float:
        per_ctx = [_interp(tokens, xs, ys) for xs, ys in self._prefill_curves]
        return _interp(context, self._contexts, np.maximum.accumulate(per_ctx))

    def after_chunk(self, since_chunk_s: float) -> float:
        """How much longer than the profile a decode-only pass runs on the device
        `since_chunk_s` after its node's last pass with a prompt chunk ended (see the class doc):
        a fraction, interpolated, 0 from `fades_s` on."""
        if since_chunk_s >= self.fades_s:
            return 0.0
        return float(np.interp(since_chunk_s, self._after_ts, self._after_lifts))

    def decode_line(self, seqs: int, since_chunk_s: float = math.inf) -> tuple[float, float]:
        """(a, b): a decode-only pass of `seqs` sequences with total context K, beginning
        `since_chunk_s` after its node's last pass with a prompt chunk ended, costs a + b*K
        (its graph's scale and the lift after a chunk pass in both, its host time and
        `pass_overhead_s` in a)."""
        a, b = self._device_line(seqs, graph=True)
        k = self.decode_scale * (1.0 + self.after_chunk(since_chunk_s)) * self.graph_scale(seqs)
        return k * a + self.host_s(False, seqs), k * b

    def host_s(self, prefill: bool, decodes: int) -> float:
        """The part of a pass's step time that is not device time (its host time and
        `pass_overhead_s`): a pass with a prompt chunk (`prefill`) and `decodes` decodes."""
        if self.run_host is not None:
            decode, chunk, per_seq, mixed, mixed_per_seq = self.run_host
            if not prefill:
                host = decode + per_seq * decodes
            else:  # a chunk beside decodes (a mixed pass), or alone
                host = mixed + mixed_per_seq * decodes if decodes else chunk + per_seq
        elif not prefill:
            host = self.decode_host_s
        else:
            host = self.mixed_host_s if decodes else self.prefill_host_s
        return host + self.pass_overhead_s

    def chain_s(self, decodes: int) -> float:
        """What a chained pass (hw.latency.chain) of `decodes` decodes takes beyond its device
        time: its fixed part + per sequence (`chain`)."""
        fixed, per_seq = self.chain
        return fixed + per_seq * decodes

    def _device_line(self, seqs: int, graph: bool = False) -> tuple[float, float]:
        """(a, b): a decode pass of `seqs` sequences and total context K runs a + b*K on the
        device by the table: eagerly (`graph` False: a mixed pass), interpolated over every
        profiled batch; else over the rows its CUDA graph ran (`graph_rows`)."""
        line = self._lines.get((seqs, graph))
        if line is None:
            rows = self._in_graph(seqs) if graph else np.ones(len(self._batches), bool)
            batches = self._batches[rows]
            a = _interp(seqs, batches, np.maximum.accumulate(self._icepts[rows]))
            per_token = _interp(seqs, batches, self._per_token[rows])
            line = self._lines[seqs, graph] = (a, max(per_token, 0.0))
        return line

    def graph_rows(self, seqs: int) -> np.ndarray:
        """The profiled batches whose rows ran in the CUDA graph a decode-only pass of `seqs`
        sequences replays (`graph_batch`): those above the graph before it, up to it; every
        batch where it runs eagerly."""
        return self._batches[self._in_graph(seqs)]

    def _in_graph(self, seqs: int) -> np.ndarray:
        """`graph_rows` as a mask over the profiled batches."""
        graph, graphs = self.graph_batch(seqs), self.graph_batches
        if graph not in graphs:
            return np.ones(len(self._batches), bool)
        low = graphs[graphs.index(graph) - 1] if graph != graphs[0] else 0
        return (self._batches > low) & (self._batches <= graph)

    def _decode_time(self, seqs: int, context_tokens: float, graph: bool = False) -> float:
        """A decode pass's device time by the table (`decode_scale` not applied): `seqs`
        sequences, `context_tokens` cached tokens in all, in its CUDA graph or eagerly
        (`_device_line`)."""
        a, b = self._device_line(seqs, graph)
        return a + b * context_tokens

    def step_time(self, s: StepShape) -> float:
        self.passes += 1
        real, d = s.prefill_tokens, s.decode_seqs
        n = padded_chunk(self.pieces, real, d * self.decode_qo) if real and self.pieces else real
        # the chunk's cached context (padded: where the piece has the chunk's attention pairs)
        context = max(s.prefill_attn_pairs / n - (n + 1) / 2, 0.0) if n else 0.0
        self.extrapolated += (
            n > self.max_prefill_tokens
            or context > self.max_prefill_context
            or d > self.max_decode_batch
            or (d > 0 and s.decode_context / d > self.max_decode_context)
        )
        if not (n or d):
            return 0.0  # no pass
        k = self.decode_scale * (1.0 if n else self.graph_scale(d))
        t = k * self._decode_time(d, s.decode_context, graph=not n) if d else 0.0  # mixed: eager
        if n:  # the chunk, its serving runs' offset, and beside decodes their shared costs
            offset = self.chunk_offset(n)
            if d:
                offset += self.mixed_offset(d, n) + self.mixed_context_s * s.decode_context
            t = max(self._prefill_time(n, context) + t + offset, 0.0)
        return t + self.host_s(n > 0, d)


def _batch_line(row: pd.Series, batch: float) -> tuple[float, float]:
    """A profiled decode batch's line over its cached tokens in all, from its rows' times by
    context (`row`): the intercept, and the slope per token (0 with one context)."""
    if len(row) == 1:
        return float(row.iloc[0]), 0.0
    slope, icept = np.polyfit(row.index.to_numpy(float), row.to_numpy(float), 1)
    return float(icept), float(slope) / batch


def _points(
    name: str, points: Sequence[tuple[float, float]], below_x: float, below_y: float, give: str
) -> tuple[np.ndarray, np.ndarray]:
    """`points` (x, y) as two arrays; a ConfigError naming `name` and saying what to `give`
    unless each x is above `below_x` and the one before it, and each y above `below_y` and
    finite."""
    xs = np.array([float(x) for x, _ in points], float)
    ys = np.array([float(y) for _, y in points], float)
    increasing = all(a < b for a, b in itertools.pairwise([below_x, *xs]))
    if not increasing or not all(below_y < y < np.inf for y in ys):
        raise ConfigError(f"{name} {list(points)!r}: give {give}")
    return xs, ys


def padded_chunk(pieces: Sequence[int], chunk: int, decode_rows: int) -> int:
    """The tokens a pass's prompt chunk of `chunk` tokens beside `decode_rows` decode tokens
    is costed at: with `pieces` (hw.latency.prefill_graphs), what the piece the pass is padded
    to holds besides the decodes; `chunk` where none holds the pass (it runs eagerly)."""
    size = pieces_size(pieces, chunk + decode_rows)
    return chunk if size is None else size - decode_rows


def _interp(x: float, xs: np.ndarray, ys: np.ndarray) -> float:
    """Piecewise-linear through (xs, ys): the first value below xs[0], the last segment
    extended above xs[-1] (one point: proportional to x above it, or, at 0, the same value:
    a profile of chunks without cached context says nothing of how context adds)."""
    if x <= xs[0] or (len(xs) == 1 and xs[0] <= 0):
        return float(ys[0])
    if len(xs) == 1:
        return float(ys[0]) * x / xs[0]
    i = min(int(np.searchsorted(xs, x)) - 1, len(xs) - 2)
    w = (x - xs[i]) / (xs[i + 1] - xs[i])
    return float(max(ys[i] + w * (ys[i + 1] - ys[i]), 0.0))


CostModel = RooflineCost | ProfileCost


def make_cost_model(exp: Experiment, group: GroupConfig, role: str = "") -> CostModel:
    """The experiment's cost model for one node group (roofline or a measured profile) of
    `role` ("decode": a disaggregated decode node's, with `cost.profile_decode_scale` and its
    own graph scales where it has them, `cost.profile_decode_graph_scales`; any but "prefill"
    on one GPU a rank: its decode passes in CUDA graphs, as a hw server's)."""
    qo = 1 + exp.spec.draft_tokens
    if exp.cost.source.startswith("profile:"):
        path = Path(exp.cost.source.removeprefix("profile:"))
        path = path if path.is_absolute() else Path(exp.base_dir) / path
        c = exp.cost
        run_host: tuple[float, ...] | None = None
        if c.profile_host_s is not None:
            run_host = (c.profile_host_s, c.profile_host_chunk_s, c.profile_host_per_seq_s)
        if run_host is not None and c.profile_host_mixed_s is not None:
            run_host = (*run_host, c.profile_host_mixed_s, c.profile_host_mixed_per_seq_s)
        scale = c.profile_decode_scale if role == "decode" else 1.0
        own = role == "decode" and c.profile_decode_graph_scales
        graph_scales = c.profile_decode_graph_scales if own else c.profile_graph_scales
        graphs = role != "prefill" and group.tp == 1  # as a hw server replays decode passes
        return ProfileCost(
            path,
            qo,
            pass_overhead_s=c.profile_pass_overhead_s,
            run_host=run_host,
            chunk_offsets=c.profile_chunk_offsets,
            decode_scale=scale,
            graphs=graphs,
            pieces=exp.hw.latency.prefill_graphs,
            after_chunk=c.profile_after_chunk,
            graph_scales=graph_scales,
            chain=(c.profile_chain_s, c.profile_chain_per_seq_s),
        )
    return RooflineCost(
        exp.model.spec,
        exp.hardware.gpu_spec,
        group,
        exp.cost,
        exp.spec,
        exp.model.weight_dtype,
        exp.model.kv_dtype,
    )

"""Step time of one forward pass from the batch shape: a roofline with named efficiencies.

Per GPU of a node that runs `dp` attention groups of `tp` ranks (experts spread over all of the
node's GPUs), a step costs, summed over its parts:
- dense GEMMs (attention projections, dense MLPs, shared experts, LM head):
  max(FLOPs / (peak * gemm_efficiency), weight bytes / (HBM * memory_efficiency));
- MoE experts: FLOPs of the routed tokens vs. bytes of the distinct experts they touch
  (expected distinct experts E * (1 - (1 - k/E)^T) per layer for T tokens);
- attention: FLOPs by qo_len x kv_len vs. the KV bytes read (MLA's latent is replicated
  under TP, so each rank reads all of it);
- communication: two TP all-reduces per layer over NVLink (ring), or with DP attention the
  MoE dispatch/combine all-to-all;
- fixed overhead per step and per layer (launches, scheduling, sampling).
Every sum over sequences is precomputed by the caller, so a step costs O(1) here.
`decode_line(batch)` gives (a, b) with step time a + b * total_context for decode-only batches,
which lets a decode node run many identical steps as one event.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from disagg.config import CostConfig, Experiment, GroupConfig, SpecConfig
from disagg.errors import ConfigError
from disagg.hardware import GPU
from disagg.models import ModelSpec, dtype_bytes

QUERY_TILE = 128  # query rows per attention tile (keys are re-read once per tile)


@dataclass(frozen=True)
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


def chunk_attn_pairs(start: int, tokens: int) -> float:
    """(query, key) pairs of a causal chunk of `tokens` tokens after `start` cached tokens."""
    return tokens * start + tokens * (tokens + 1) / 2


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
        self.gpus = group.tp * group.dp
        m = model
        kv_shards = 1 if m.attention == "mla" else min(group.tp, m.kv_heads)
        # KV bytes one GPU reads per cached token (all layers)
        self.kv_read_per_token = m.kv_bytes_per_token(kv_dtype) / kv_shards / group.dp
        per_rank = group.tp * group.dp
        self.attn_flops_per_pair = m.layers * m.attn_flops(1) / per_rank  # decode (absorbed)
        self.prefill_flops_per_pair = m.layers * m.attn_flops(1, absorbed=False) / per_rank
        dense_params = m.active_params_per_token - m.moe_layers * (
            m.experts_per_token * m.expert_params
        )
        self.dense_flops_per_token = 2 * dense_params / self.gpus
        self.dense_bytes = dense_params * self.wbytes / self.gpus
        self.step_fixed_s = cost.step_overhead_s + m.layers * cost.layer_overhead_s
        self._lines: dict[int, tuple[float, float]] = {}  # decode_line by batch size

    # ---- parts -------------------------------------------------------------------------
    def _gemm(self, tokens: int) -> float:
        m = self.model
        dense = max(tokens * self.dense_flops_per_token / self.flops, self.dense_bytes / self.hbm)
        if not m.is_moe or tokens == 0:
            return dense
        routed = tokens * m.experts_per_token
        distinct = m.experts * (1 - (1 - m.experts_per_token / m.experts) ** tokens)
        moe_flops = 2 * routed * m.expert_params * m.moe_layers / self.gpus
        moe_bytes = distinct * m.expert_params * m.moe_layers * self.wbytes / self.gpus
        return dense + max(moe_flops / self.flops, moe_bytes / self.hbm)

    def _comm(self, tokens: int) -> float:
        m, g = self.model, self.group
        act = tokens * m.hidden * 2  # bf16 activations
        nvlink = self.gpu.nvlink_bandwidth_bps * self.cost.allreduce_efficiency
        t = 0.0
        if g.tp > 1:  # two ring all-reduces per layer
            t += 2 * m.layers * 2 * (g.tp - 1) / g.tp * act / nvlink
        if g.dp > 1 and m.is_moe:  # dispatch + combine of each token's top-k hidden states
            t += m.moe_layers * 2 * act * m.experts_per_token / self.gpus / nvlink
        return t

    def _attention(self, pairs: float, context: float, flops_per_pair: float) -> float:
        flops = pairs * flops_per_pair
        return max(flops / self.attn_flops, context * self.kv_read_per_token / self.hbm)

    # ---- public ------------------------------------------------------------------------
    def step_time(self, s: StepShape) -> float:
        """Seconds for one forward pass of batch shape `s`."""
        tokens = s.prefill_tokens + s.decode_seqs * self.decode_qo
        if tokens == 0:
            return 0.0
        return (
            self.step_fixed_s
            + self._gemm(tokens)
            + self._comm(tokens)
            # flash attention reads each key once per tile of queries
            + self._attention(
                s.prefill_attn_pairs, s.prefill_attn_pairs / QUERY_TILE, self.prefill_flops_per_pair
            )
            + self._attention(
                s.decode_context * self.decode_qo, s.decode_context, self.attn_flops_per_pair
            )
        )

    def decode_line(self, seqs: int) -> tuple[float, float]:
        """(a, b): a decode-only step of `seqs` sequences with total context K takes a + b*K."""
        line = self._lines.get(seqs)
        if line is None:
            line = self._lines[seqs] = self._decode_line(seqs)
        return line

    def _decode_line(self, seqs: int) -> tuple[float, float]:
        tokens = seqs * self.decode_qo
        a = self.step_fixed_s + self._gemm(tokens) + self._comm(tokens)
        b = max(
            self.decode_qo * self.attn_flops_per_pair / self.attn_flops,
            self.kv_read_per_token / self.hbm,
        )
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
    and decode parts plus `mixed_offset_s`: the median, over the mixed rows, of what a measured
    mixed pass took beyond its two parts (negative: the fixed costs they share), or 0 without
    mixed rows. The table must come from the same model and depth as the experiment.
    """

    def __init__(self, path: Path, decode_qo: int = 1) -> None:
        import pandas as pd

        try:
            df = pd.read_csv(path)
        except FileNotFoundError:
            raise ConfigError(f"cost profile {path} not found") from None
        missing = {"kind", "tokens", "batch", "context", "duration_s"} - set(df.columns)
        if missing:
            raise ConfigError(f"cost profile {path}: missing columns {sorted(missing)}")
        self.decode_qo = decode_qo
        self.prefill = df[df.kind == "prefill"].groupby(["context", "tokens"]).duration_s.median()
        self.decode = df[df.kind == "decode"].groupby(["batch", "context"]).duration_s.median()
        if self.prefill.empty or self.decode.empty:
            raise ConfigError(f"cost profile {path}: needs both prefill and decode rows")
        self._lines: dict[int, tuple[float, float]] = {}  # decode_line by batch size
        self.max_prefill_tokens = int(df[df.kind == "prefill"].tokens.max())
        self.max_decode_batch = int(self.decode.index.get_level_values(0).max())
        self.max_decode_context = int(self.decode.index.get_level_values(1).max())
        self.passes = 0  # passes costed
        self.extrapolated = 0  # of which beyond the grid on some axis
        mixed = df[df.kind == "mixed"]
        beyond_parts = [
            float(t) - self._prefill_time(int(n), 0.0) - self._decode_time(int(b), b * float(c))
            for n, b, c, t in zip(
                mixed.tokens, mixed.batch, mixed.context, mixed.duration_s, strict=True
            )
        ]
        self.mixed_offset_s = float(np.median(beyond_parts)) if beyond_parts else 0.0

    def _prefill_time(self, tokens: int, context: float) -> float:
        contexts = sorted({c for c, _ in self.prefill.index})
        per_ctx = []
        for c in contexts:
            row = self.prefill.loc[c]
            xs, ys = row.index.to_numpy(float), np.maximum.accumulate(row.to_numpy(float))
            per_ctx.append(_interp(tokens, xs, ys))
        return _interp(context, np.array(contexts, float), np.maximum.accumulate(per_ctx))

    def decode_line(self, seqs: int) -> tuple[float, float]:
        line = self._lines.get(seqs)
        if line is None:
            line = self._lines[seqs] = self._decode_line(seqs)
        return line

    def _decode_line(self, seqs: int) -> tuple[float, float]:
        batches = np.array(sorted({b for b, _ in self.decode.index}), float)
        lines = []
        for b in batches:
            row = self.decode.loc[int(b)]
            slope, icept = (
                np.polyfit(row.index.to_numpy(float), row.to_numpy(float), 1)
                if len(row) > 1
                else (0.0, float(row.iloc[0]))
            )
            lines.append((icept, slope / b))
        a = _interp(seqs, batches, np.maximum.accumulate([x for x, _ in lines]))
        per_token = _interp(seqs, batches, np.array([y for _, y in lines]))
        return a, max(per_token, 0.0)

    def _decode_time(self, seqs: int, context_tokens: float) -> float:
        """A decode pass of `seqs` sequences holding `context_tokens` cached tokens in all."""
        a, b = self.decode_line(seqs)
        return a + b * context_tokens

    def step_time(self, s: StepShape) -> float:
        self.passes += 1
        beyond = s.prefill_tokens > self.max_prefill_tokens or s.decode_seqs > (
            self.max_decode_batch
        )
        if s.decode_seqs and s.decode_context / s.decode_seqs > self.max_decode_context:
            beyond = True
        self.extrapolated += beyond
        t = 0.0
        if s.prefill_tokens:
            n = s.prefill_tokens
            context = max(s.prefill_attn_pairs / n - (n + 1) / 2, 0.0)
            t += self._prefill_time(n, context)
        if s.decode_seqs:
            t += self._decode_time(s.decode_seqs, s.decode_context)
        if s.prefill_tokens and s.decode_seqs:
            t = max(t + self.mixed_offset_s, 0.0)
        return t


def _interp(x: float, xs: np.ndarray, ys: np.ndarray) -> float:
    """Piecewise-linear through (xs, ys): the first value below xs[0], the last segment
    extended above xs[-1] (one point: proportional to x above it)."""
    if x <= xs[0]:
        return float(ys[0])
    if len(xs) == 1:
        return float(ys[0]) * x / xs[0]
    i = min(int(np.searchsorted(xs, x)) - 1, len(xs) - 2)
    w = (x - xs[i]) / (xs[i + 1] - xs[i])
    return float(max(ys[i] + w * (ys[i + 1] - ys[i]), 0.0))


CostModel = RooflineCost | ProfileCost


def make_cost_model(exp: Experiment, group: GroupConfig) -> CostModel:
    """The experiment's cost model for one node group (roofline or a measured profile)."""
    qo = 1 + exp.spec.draft_tokens
    if exp.cost.source.startswith("profile:"):
        path = Path(exp.cost.source.removeprefix("profile:"))
        return ProfileCost(path if path.is_absolute() else Path(exp.base_dir) / path, qo)
    return RooflineCost(
        exp.model.spec,
        exp.hardware.gpu_spec,
        group,
        exp.cost,
        exp.spec,
        exp.model.weight_dtype,
        exp.model.kv_dtype,
    )

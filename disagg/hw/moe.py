"""Mixture-of-experts MLP layers at a catalogue model's shapes, with seeded random weights.

Routing (`Routing`, as the model's spec gives it: `routing_for`):
- `softmax` (Qwen3-MoE, Mixtral, DeepSeek-V2): the top `top_k` experts of softmax(router
  logits), their probabilities renormalised to sum to one where the model does so;
- `grouped` (DeepSeek-V3/R1, "noaux_tc"): sigmoid scores plus a per-expert bias choose the
  experts: the experts form `groups` groups, a group scores the sum of its two best, the best
  `topk_groups` groups are kept and the top `top_k` experts among them chosen; each chosen
  expert weighs its sigmoid score (without the bias), renormalised over the k.
Either way the weights are then multiplied by `scale`.

Experts are SwiGLU MLPs of width `moe_intermediate` (`w13`: gate rows then up rows, [E, 2I, H];
`w2`: [E, H, I]); `shared_experts` always-active experts run as one dense SwiGLU of width
shared * moe_intermediate. The routed experts are computed in torch, tokens sorted by expert:
- `experts_grouped`: two grouped GEMMs over all experts at once (`torch._grouped_mm`, bf16 on
  Hopper, any dtype on the CPU); no host sync, so a decode step with it is captured in a CUDA
  graph. Used where it runs and the rank holds every expert;
- `experts_reference`: one GEMM pair per expert that received tokens (the expert counts go to
  the host); the fallback, and the reference the grouped path is tested against.
`moe="reference"` (the experiment's hw.moe, or DISAGG_MOE=reference) forces the fallback.

Under tensor parallelism (`MoE.cuts`) a rank keeps its share of every expert's width (and of
the shared experts'), or with expert parallelism its share of whole experts (the shared ones
still split by width); the router is replicated, so every rank routes every token alike, and
the layer's output on a rank is a partial sum that the model all-reduces once.

FlashInfer's fused MoE is not used: its CUTLASS module did not build within one call of the
lent H200 machine (docs/gpu-runs.md).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import torch
import torch.nn.functional as F

from disagg.hw.tp import Cut, TensorParallel, swiglu_cuts
from disagg.models import ModelSpec

if TYPE_CHECKING:
    from disagg.hw.weights import WeightMaker


@dataclass(frozen=True)
class Routing:
    kind: Literal["softmax", "grouped"]
    top_k: int
    groups: int = 1
    topk_groups: int = 1
    scale: float = 1.0
    normalise: bool = True  # the k weights renormalised to sum to one (before `scale`)


def routing_for(spec: ModelSpec) -> Routing:
    """The routing of the model's family, as its spec gives it (`router` and the fields after
    it)."""
    return Routing(
        spec.router,
        spec.experts_per_token,
        spec.expert_groups,
        spec.topk_groups,
        spec.routed_scale,
        spec.norm_topk,
    )


def route(
    logits: torch.Tensor, routing: Routing, bias: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, k] float32, expert ids [T, k] int32) of router `logits` [T, E]. Ties go
    to the lower expert id (torch.topk is stable on equal values only per device: the tests
    use distinct logits)."""
    logits = logits.float()
    if routing.kind == "softmax":
        weights, ids = logits.softmax(-1).topk(routing.top_k, dim=-1)
        return _weigh(weights, routing), ids.int()
    t, e = logits.shape
    scores = logits.sigmoid()
    choice = scores if bias is None else scores + bias.float()
    per_group = choice.view(t, routing.groups, e // routing.groups)
    group_score = per_group.topk(2, dim=-1).values.sum(-1)  # [T, groups]
    keep = group_score.topk(routing.topk_groups, dim=-1).indices
    mask = torch.zeros_like(group_score, dtype=torch.bool).scatter_(1, keep, True)
    masked = choice.masked_fill(~mask.repeat_interleave(e // routing.groups, dim=1), -math.inf)
    ids = masked.topk(routing.top_k, dim=-1).indices
    return _weigh(scores.gather(1, ids), routing), ids.int()


def _weigh(weights: torch.Tensor, routing: Routing) -> torch.Tensor:
    if routing.normalise:
        weights = weights / weights.sum(-1, keepdim=True)
    return weights * routing.scale


def swiglu(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """down(silu(gate(x)) * up(x)) with w13 = [gate; up] (out, in) and w2 (out, in)."""
    gate, up = F.linear(x, w13).chunk(2, dim=-1)
    return F.linear(F.silu(gate) * up, w2)


def experts_reference(
    x: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    first: int = 0,
) -> torch.Tensor:
    """sum_j weights[t, j] * expert_{ids[t, j]}(x[t]), [T, H] in x's dtype, in torch.

    w13, w2 hold experts first .. first + len(w13) - 1 (expert parallelism); the others count
    as zero."""
    t, k = ids.shape
    flat = ids.reshape(-1).long()
    order = torch.argsort(flat, stable=True)
    held = range(first, first + w13.shape[0])
    counts = torch.bincount(flat, minlength=held.stop).tolist()
    rows = x[order // k]
    every = len(held) == len(counts)
    out = torch.empty_like(rows) if every else torch.zeros_like(rows)
    start = 0
    for e, n in enumerate(counts):
        if n and e in held:
            out[start : start + n] = swiglu(rows[start : start + n], w13[e - first], w2[e - first])
        start += n
    per_slot = torch.empty_like(out)
    per_slot[order] = out  # back to (token, slot) order
    combined = (per_slot.view(t, k, -1).float() * weights[..., None]).sum(1)
    return combined.to(x.dtype)


def experts_grouped(
    x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor
) -> torch.Tensor:
    """`experts_reference` of a rank that holds every expert, as two grouped GEMMs."""
    t, k = ids.shape
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.zeros(w13.shape[0], dtype=torch.int64, device=x.device)
    counts.scatter_add_(0, flat.long(), torch.ones_like(flat, dtype=torch.int64))  # no host sync
    ends = torch.cumsum(counts, 0).to(torch.int32)
    rows = x[order // k]
    gate, up = torch._grouped_mm(rows, w13.transpose(1, 2), offs=ends).chunk(2, dim=-1)
    out = torch._grouped_mm(F.silu(gate) * up, w2.transpose(1, 2), offs=ends)
    per_slot = torch.empty_like(out)
    per_slot[order] = out
    combined = (per_slot.view(t, k, -1).float() * weights[..., None]).sum(1)
    return combined.to(x.dtype)


def grouped_runs(x: torch.Tensor, w2: torch.Tensor, experts: int) -> bool:
    """Whether `experts_grouped` runs for `x` on a rank holding the experts `w2` [E, H, I] of
    `experts`: all of them, and rows of whole 16 bytes (what the grouped GEMM reads)."""
    held, width = w2.shape[0], w2.shape[-1]
    if held != experts or not hasattr(torch, "_grouped_mm"):
        return False
    if (width * x.element_size()) % 16 or (x.shape[-1] * x.element_size()) % 16:
        return False
    return x.device.type == "cpu" or x.dtype == torch.bfloat16


class MoE:
    """One MoE layer's weights and its forward: x [T, H] -> [T, H] (without the residual)."""

    def __init__(
        self,
        spec: ModelSpec,
        make: WeightMaker,
        name: str,
        out_scale: float,
        cuts: dict[str, Cut] | None = None,
        moe: Literal["grouped", "reference"] = "grouped",
    ) -> None:
        """`cuts`: what this rank keeps of each weight (`MoE.cuts`); None keeps everything.
        `moe`: the grouped experts where they run, or always the reference."""
        self.grouped = moe == "grouped"
        e, h, i = spec.experts, spec.hidden, spec.moe_intermediate
        cut = (cuts or {}).get
        self.routing = routing_for(spec)
        self.router = make.uniform(f"{name}.router", (e, h), h**-0.5)
        self.bias = (
            make.uniform(f"{name}.router_bias", (e,), 0.01)
            if self.routing.kind == "grouped"
            else None
        )
        self.w13 = make.uniform(f"{name}.w13", (e, 2 * i, h), h**-0.5, cut("w13"))
        self.w2 = make.uniform(f"{name}.w2", (e, h, i), i**-0.5 * out_scale, cut("w2"))
        w13_cut = cut("w13")
        self.first = w13_cut.keep[0].start if w13_cut and w13_cut.dim == 0 else 0
        s = spec.shared_experts * i
        self.shared = (
            (
                make.uniform(f"{name}.shared13", (2 * s, h), h**-0.5, cut("shared13")),
                make.uniform(f"{name}.shared2", (h, s), s**-0.5 * out_scale, cut("shared2")),
            )
            if s
            else None
        )

    @staticmethod
    def shapes(spec: ModelSpec) -> dict[str, tuple[int, ...]]:
        """Each weight's shape (for the model's byte count)."""
        e, h, i = spec.experts, spec.hidden, spec.moe_intermediate
        s = spec.shared_experts * i
        out = {"router": (e, h), "w13": (e, 2 * i, h), "w2": (e, h, i)}
        return out | ({"shared13": (2 * s, h), "shared2": (h, s)} if s else {})

    @staticmethod
    def cuts(spec: ModelSpec, tp: TensorParallel) -> dict[str, Cut]:
        """What rank `tp.rank` keeps of each weight: its share of every expert's width, or with
        `tp.expert_parallel` its share of the experts; the shared experts' width; no router cut.
        ConfigError naming the width or the expert count that tp does not divide."""
        out: dict[str, Cut] = {}
        if tp.expert_parallel:
            mine = tp.part(spec.experts, f"{spec.name}'s routed experts (expert parallelism)")
            out["w13"], out["w2"] = Cut(0, (mine,)), Cut(0, (mine,))
        else:
            width = f"{spec.name}'s expert width (moe_intermediate)"
            out["w13"], out["w2"] = swiglu_cuts(spec.moe_intermediate, tp, width, dim=1)
        if spec.shared_experts:
            shared = spec.shared_experts * spec.moe_intermediate
            what = f"{spec.name}'s shared-expert width ({spec.shared_experts} x moe_intermediate)"
            out["shared13"], out["shared2"] = swiglu_cuts(shared, tp, what)
        return out

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """The layer's output; under tp, this rank's partial sum (to be all-reduced)."""
        weights, ids = route(F.linear(x, self.router), self.routing, self.bias)
        if self.grouped and grouped_runs(x, self.w2, self.router.shape[0]):
            out = experts_grouped(x, weights, ids, self.w13, self.w2)
        else:
            out = experts_reference(x, weights, ids, self.w13, self.w2, self.first)
        if self.shared is not None:
            out = out + swiglu(x, *self.shared)
        return out

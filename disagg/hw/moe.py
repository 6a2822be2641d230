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
shared * moe_intermediate. The routed experts are computed in torch on any device
(`experts_reference`): tokens sorted by expert, one GEMM pair per expert that received tokens,
outputs combined per token in a fixed order. FlashInfer's fused MoE is not used: its CUTLASS
module did not build within one call of the lent H200 machine (docs/gpu-runs.md).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import torch
import torch.nn.functional as F

from disagg.models import ModelSpec

if TYPE_CHECKING:
    from disagg.hw.model import WeightMaker


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
    x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor
) -> torch.Tensor:
    """sum_j weights[t, j] * expert_{ids[t, j]}(x[t]), [T, H] in x's dtype, in torch."""
    t, k = ids.shape
    flat = ids.reshape(-1).long()
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=w13.shape[0]).tolist()
    rows = x[order // k]
    out = torch.empty_like(rows)
    start = 0
    for e, n in enumerate(counts):
        if n:
            out[start : start + n] = swiglu(rows[start : start + n], w13[e], w2[e])
            start += n
    per_slot = torch.empty_like(out)
    per_slot[order] = out  # back to (token, slot) order
    combined = (per_slot.view(t, k, -1).float() * weights[..., None]).sum(1)
    return combined.to(x.dtype)


class MoE:
    """One MoE layer's weights and its forward: x [T, H] -> [T, H] (without the residual)."""

    def __init__(self, spec: ModelSpec, make: WeightMaker, name: str, out_scale: float) -> None:
        e, h, i = spec.experts, spec.hidden, spec.moe_intermediate
        self.routing = routing_for(spec)
        self.router = make.uniform(f"{name}.router", (e, h), h**-0.5)
        self.bias = (
            make.uniform(f"{name}.router_bias", (e,), 0.01)
            if self.routing.kind == "grouped"
            else None
        )
        self.w13 = make.uniform(f"{name}.w13", (e, 2 * i, h), h**-0.5)
        self.w2 = make.uniform(f"{name}.w2", (e, h, i), i**-0.5 * out_scale)
        s = spec.shared_experts * i
        self.shared = (
            (
                make.uniform(f"{name}.shared13", (2 * s, h), h**-0.5),
                make.uniform(f"{name}.shared2", (h, s), s**-0.5 * out_scale),
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

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = route(F.linear(x, self.router), self.routing, self.bias)
        out = experts_reference(x, weights, ids, self.w13, self.w2)
        if self.shared is not None:
            out = out + swiglu(x, *self.shared)
        return out

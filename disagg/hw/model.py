"""A decoder-only transformer with seeded random weights at a catalogue model's real shapes.

GQA models (Llama-3.1): RoPE on q and k, a fused qkv projection, KV written to the paged cache.
MLA models (DeepSeek-V3): low-rank q (q_lora) and kv (kv_lora) projections; the cache holds the
normalised latent (kv_lora_rank) and the roped key (qk_rope_dim) of each token. Attention is
computed in the absorbed form for prefill and decode alike: q_nope is multiplied by W_UK so
scores are taken against the latent, and W_UV is applied to the attended latent afterwards
(FlashInfer's MLA kernel computes exactly this). The MLP is a dense SwiGLU of width
`intermediate`, except on an MoE model's layers past its `dense_layers`: there it is routed
experts plus shared ones (disagg.hw.moe).

Weights are uniform with std 1/sqrt(fan_in) (output projections further / sqrt(2 layers)), so
activations stay O(1) over any depth; norms are ones. They are drawn on the CPU, identical in
every process (disagg.hw.weights, which can also keep them in a directory for the next one),
then moved to the device (bf16 on CUDA, float32 on CPU). RoPE is the plain rotate-half form
with theta 500000 (no Llama-3.1 frequency scaling).

With `tp` (disagg.hw.tp) the model is one rank of a tensor-parallel group: it draws the same
full tensors and keeps its shard (query heads, its KV heads, its share of every MLP width, its
vocab rows), all-reduces after each row-parallel projection and all-gathers the logits
(docs/architecture.md, "Tensor parallelism in the hw model").

With DP attention (`tp.dp` > 1) the ranks form `dp` attention groups, each holding whole
requests in its own KV cache (the MLA latent replicated on the group's ranks). Every rank holds
every token's hidden state, as under TP; a rank attends only its group's sequences (`GroupRows`)
with its share of the group's heads, and its attention output is zero on the other groups'
rows, so the one all-reduce after `wo`, over the whole node, both completes each group's
attention and hands every rank every token for the MLP or experts, which are cut over all the
node's ranks (SGLang gathers the groups' tokens before the MLP and scatters them after; the sum
with zeros moves the same hidden states in one collective). The step's sequences must name
their group (`Seq.dp_rank`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Literal

import torch
import torch.nn.functional as F

from disagg.core.kvcache import Layout
from disagg.hw.attention import Attention, AttnShape, TorchAttention
from disagg.hw.batch import BatchMeta, GroupRows, Seq, StepTensors
from disagg.hw.cache import KVCache
from disagg.hw.device import check_fits, default_dtype, resolve_device
from disagg.hw.moe import MoE
from disagg.hw.tp import Cut, TensorParallel, attention_cuts, lm_head_cut, swiglu_cuts
from disagg.hw.weights import WeightMaker
from disagg.models import ModelSpec

ROPE_THETA = 500_000.0
NORM_EPS = 1e-6


@dataclass
class ForwardOut:
    """logits [B, vocab] float32 at each sequence's last new token; hidden [B, hidden] (model
    dtype) final hidden state (before the final norm) at each sequence's `hidden_at` token."""

    logits: torch.Tensor
    hidden: torch.Tensor


def rms_norm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return F.rms_norm(x, (x.shape[-1],), weight, NORM_EPS)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE, as written in the papers. x [T, H, d]; cos, sin [T, 1, d/2]."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def inv_freq(rope_dim: int, device: torch.device) -> torch.Tensor:
    """RoPE's inverse frequencies for `rope_dim` rotated dimensions (theta ROPE_THETA, the one
    FlashInfer's fused RoPE is given)."""
    half = rope_dim // 2
    return ROPE_THETA ** (-torch.arange(half, dtype=torch.float32, device=device) / half)


def rope_tables(
    positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin) [T, 1, 2 * len(inv_freq)] for `rotate`: cos twice, sin with the first half
    negated."""
    freqs = positions[:, None].float() * inv_freq[None, :]
    cos, sin = freqs.cos(), freqs.sin()
    full = (torch.cat([cos, cos], -1), torch.cat([-sin, sin], -1))
    return full[0][:, None].to(dtype), full[1][:, None].to(dtype)


Tables = tuple[torch.Tensor, torch.Tensor]


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """`apply_rope` in three kernels instead of seven: x*cos + [x2, x1]*sin, with the tables of
    `rope_tables` (a decode step runs this twice per layer; launches are what it costs)."""
    return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, -1), sin)


class TorchOps:
    """The elementwise steps of a layer in plain torch (any device)."""

    def norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, weight)

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    def rope(
        self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, tables: Tables
    ) -> None:
        """Rotate q and k in place (they are views of the qkv projection, whose k and v rows
        then go to the cache in one write)."""
        q.copy_(rotate(q, *tables))
        k.copy_(rotate(k, *tables))


class FusedOps(TorchOps):
    """The same steps as FlashInfer's fused kernels (CUDA): one pass each."""

    def __init__(self) -> None:
        from disagg.hw.attention import import_flashinfer

        self.fi = import_flashinfer()

    def norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return self.fi.norm.rmsnorm(x, weight, NORM_EPS)

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        return self.fi.activation.silu_and_mul(gate_up)

    def rope(
        self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, tables: Tables
    ) -> None:
        self.fi.rope.apply_rope_pos_ids_inplace(q, k, positions, rope_theta=ROPE_THETA)


def write_kv(cache: torch.Tensor, x: StepTensors, layout: Layout, rows: torch.Tensor) -> None:
    """Store new tokens' entries into one layer's pages at (slot_pages, slot_offsets), in one
    indexed write (one kernel).

    GQA: rows [T, 2, kv_heads, head_dim], K then V. MLA: the latent rows [T, kv_lora + rope].
    """
    p, o = x.slot_pages, x.slot_offsets
    if cache.dim() == 3:  # MLA: [pages, page_size, row]
        cache[p, o] = rows
    elif layout == "HND":  # [pages, 2, kv_heads, page_size, head_dim]
        cache[p, :, :, o] = rows
    else:  # NHD: [pages, 2, page_size, kv_heads, head_dim]
        cache[p, :, o] = rows


class Transformer:
    """Random-weight decoder over a paged KV cache; see the module doc for the architecture."""

    def __init__(
        self,
        spec: ModelSpec,
        *,
        seed: int = 0,
        device: str | torch.device = "cpu",
        dtype: torch.dtype | None = None,
        fused_ops: bool = True,
        tp: TensorParallel | None = None,
        moe: Literal["grouped", "reference"] = "grouped",
        weight_cache: str | None = None,
    ) -> None:
        """`fused_ops`: FlashInfer's fused RMSNorm, SiLU-and-mul and in-place RoPE instead of
        torch's elementwise kernels, on CUDA (GQA models' RoPE; MLA keeps torch's). `moe`: how
        MoE layers compute their experts (disagg.hw.moe). `weight_cache`: a directory that
        keeps drawn weights for the next model of this seed (disagg.hw.weights).

        `tp`: this process is one rank of a tensor-parallel group and holds only its shard of
        the weights (docs/architecture.md, "Tensor parallelism in the hw model"); every rank of
        the group must run the same steps. ConfigError if the group cannot split the model."""
        self.spec = spec
        self.fused_ops, self.moe = fused_ops, moe
        self.tp = tp
        self.device = resolve_device(device)
        self.dtype = dtype or default_dtype(self.device)
        self.mla = spec.attention == "mla"
        self.rope_dim = spec.qk_rope_dim if self.mla else spec.head_dim
        self.cuts = {} if tp is None else rank_cuts(spec, tp)
        size = 1 if tp is None else tp.attention.size
        self.heads = spec.heads // size  # query heads of this rank
        self.kv_heads = spec.kv_heads if tp is None else len(tp.kv_heads(spec))  # (GQA)
        check_fits(self.device, self.weight_bytes(), f"{spec.name} weights ({spec.layers} layers)")
        w = WeightMaker(seed, self.device, self.dtype, weight_cache)
        h = spec.hidden
        self.embed = w.uniform("embed", (spec.vocab, h), 1.0)
        self.moes: dict[int, MoE] = {}  # layer -> its experts (MoE layers only)
        self.layers = [self._make_layer(w, i) for i in range(spec.layers)]
        self.final_norm = w.ones(h)
        lm_cut = self.cuts.get("lm_head")
        self.lm_head = w.uniform("lm_head", (spec.vocab, h), h**-0.5, lm_cut)
        w.close()
        self.weights_read = (w.read, w.read + w.drawn)  # tensors read from the cache, of all
        self.inv_freq = inv_freq(self.rope_dim, self.device)

    # ---- weights ---------------------------------------------------------------------------
    def _attn_shapes(self) -> dict[str, tuple[int, ...]]:
        s = self.spec
        if not self.mla:
            qkv = (s.heads + 2 * s.kv_heads) * s.head_dim
            return {"wqkv": (qkv, s.hidden), "wo": (s.hidden, s.heads * s.head_dim)}
        qk = s.qk_nope_dim + s.qk_rope_dim
        shapes: dict[str, tuple[int, ...]] = {
            "w_dkv": (s.kv_lora_rank + s.qk_rope_dim, s.hidden),
            "w_uk": (s.heads, s.qk_nope_dim, s.kv_lora_rank),
            "w_uv": (s.heads, s.v_head_dim, s.kv_lora_rank),
            "wo": (s.hidden, s.heads * s.v_head_dim),
        }
        if s.q_lora_rank:
            shapes |= {"w_dq": (s.q_lora_rank, s.hidden), "w_uq": (s.heads * qk, s.q_lora_rank)}
        else:
            shapes["w_q"] = (s.heads * qk, s.hidden)
        return shapes

    def is_moe_layer(self, i: int) -> bool:
        return self.spec.is_moe and i >= self.spec.dense_layers

    def layer_shapes(self, i: int = 0) -> dict[str, tuple[int, ...]]:
        """Each weight's shape of layer `i` on this rank (GEMM weights are (out, in); an MoE
        layer's experts are `moe.*`)."""
        return {k: self._local(k, v) for k, v in self._full_shapes(i).items()}

    def _local(self, name: str, full: tuple[int, ...]) -> tuple[int, ...]:
        cut = self.cuts.get(name)
        return full if cut is None else cut.shape(full)

    def _full_shapes(self, i: int) -> dict[str, tuple[int, ...]]:
        """layer_shapes at tp 1: the tensors every rank draws."""
        s = self.spec
        if self.is_moe_layer(i):
            mlp = {f"moe.{k}": v for k, v in MoE.shapes(s).items()}
        else:
            mlp = {
                "w_gate_up": (2 * s.intermediate, s.hidden),
                "w_down": (s.hidden, s.intermediate),
            }
        return self._attn_shapes() | mlp

    def weight_bytes(self) -> int:
        """Bytes of every weight this model (this rank) allocates (norms excluded)."""
        layers = sum(
            math.prod(v) for i in range(self.spec.layers) for v in self.layer_shapes(i).values()
        )
        table = (self.spec.vocab, self.spec.hidden)
        total = layers + math.prod(table) + math.prod(self._local("lm_head", table))
        return total * torch.empty((), dtype=self.dtype).element_size()

    def _make_layer(self, w: WeightMaker, i: int) -> dict[str, torch.Tensor]:
        s = self.spec
        out_scale = (2 * s.layers) ** -0.5
        layer = {"ln1": w.ones(s.hidden), "ln2": w.ones(s.hidden)}
        for name, shape in self._full_shapes(i).items():
            if name.startswith("moe."):
                continue
            std = shape[-1] ** -0.5 * (out_scale if name in ("wo", "w_down") else 1.0)
            layer[name] = w.uniform(f"layer{i}.{name}", shape, std, self.cuts.get(name))
        if self.is_moe_layer(i):
            moe_cuts = {k[4:]: v for k, v in self.cuts.items() if k.startswith("moe.")}
            self.moes[i] = MoE(s, w, f"layer{i}.moe", out_scale, moe_cuts, self.moe)
        if self.mla:
            layer["kv_norm"] = w.ones(s.kv_lora_rank)
            if s.q_lora_rank:
                layer["q_norm"] = w.ones(s.q_lora_rank)
        return layer

    # ---- forward ---------------------------------------------------------------------------
    def new_cache(self, num_pages: int, page_size: int = 16, layout: Layout = "HND") -> KVCache:
        """This rank's KV pool: its KV heads (GQA) or the whole latent (MLA)."""
        tp = 1 if self.tp is None else self.tp.attention.size
        return KVCache.allocate(
            self.spec, num_pages, page_size, self.device, self.dtype, layout, tp=tp
        )

    def attn_shape(self, page_size: int, layout: Layout = "HND") -> AttnShape:
        """The attention this rank computes: its query heads over its KV heads."""
        shape = AttnShape.of(self.spec, page_size, layout)
        return replace(shape, heads=self.heads, kv_heads=1 if self.mla else self.kv_heads)

    def forward(
        self, batch: Sequence[Seq], cache: KVCache, attention: Attention | None = None
    ) -> ForwardOut:
        """Append the batch's new tokens to `cache` and return last-token logits (eager)."""
        attn = attention or TorchAttention(self.attn_shape(cache.page_size, cache.layout.layout))
        group = self.group_rows(batch, cache)
        x = self.planned_inputs(batch, cache, attn, group)
        return self.forward_tensors(x, cache, attn, group=group)

    def planned_inputs(
        self, batch: Sequence[Seq], cache: KVCache, attn: Attention, group: GroupRows | None
    ) -> StepTensors:
        """Plan `attn` for an eager step of `batch` (under DP attention, for this rank's
        `group` of it, which may hold none of it) and build the step's inputs."""
        meta = BatchMeta.of(batch, cache.page_size, cache.num_pages)
        if group is None:
            attn.plan(meta)
        elif group.meta is not None:
            attn.plan(group.meta)
        return StepTensors.build(batch, meta, self.device)

    def group_rows(self, batch: Sequence[Seq], cache: KVCache) -> GroupRows | None:
        """This rank's attention group's part of `batch` under DP attention (None without)."""
        if self.tp is None or self.tp.dp == 1:
            return None
        tp = self.tp
        return GroupRows.of(batch, tp.dp_rank, tp.dp, cache.page_size, cache.num_pages, self.device)

    @torch.inference_mode()
    def forward_tensors(
        self,
        x: StepTensors,
        cache: KVCache,
        attn: Attention,
        on_layer: Callable[[], None] | None = None,
        group: GroupRows | None = None,
    ) -> ForwardOut:
        """The step on device tensors only (CUDA-graph capturable with a graph-mode `attn`).

        `on_layer` is called after each layer's attention output projection. `group`: under DP
        attention, the rows this rank attends (`attn` planned for `group.seqs`); None: all.
        """
        ops = self.ops()
        h = self.embed[x.input_ids]
        cos, sin = self.rope_tables(x.positions)
        for i, layer in enumerate(self.layers):
            a = ops.norm(h, layer["ln1"])
            if group is None:
                o = self._attend(layer, a, (cos, sin), x, cache, i, attn, ops)
                h = self._row_parallel(h, o, layer["wo"])
            else:  # this group's rows; zero on the others': the all-reduce brings theirs
                part = torch.zeros_like(h)
                if group.x is not None:
                    r = group.rows
                    o = self._attend(layer, a[r], (cos[r], sin[r]), group.x, cache, i, attn, ops)
                    part[r] = F.linear(o, layer["wo"])
                h = h + self._reduce(part)
            if on_layer is not None:
                on_layer()
            h = self._mlp(i, h, ops)
        return self.head(h, x)

    @property
    def piecewise(self) -> bool:
        """Whether a pass runs as `piece`s: a GQA model on one rank, its experts (if any)
        grouped (a pass's work then depends on its tokens alone, but for attention, and its
        experts' counts stay on the device)."""
        return not self.mla and self.tp is None and (not self.moes or self.moe == "grouped")

    def piece(
        self,
        i: int,
        h: torch.Tensor | None,
        o: torch.Tensor,
        x: StepTensors,
        cache: KVCache,
        tables: Tables,
        on_layer: Callable[[], None] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """A `piecewise` pass's work between layer i-1's attention and layer i's: layer i-1's
        output projection of its attention `o` (rows of `x`), `on_layer`, and its MLP (before
        layer 0: the embedding), then layer i's norm, qkv, RoPE and KV write. The hidden
        states, and layer i's q to attend (None past the last layer). The pass's steps, in
        `forward_tensors`' order."""
        ops = self.ops()
        if i == 0:
            h = self.embed[x.input_ids]
        else:
            assert h is not None
            h = self._row_parallel(h, o, self.layers[i - 1]["wo"])
            if on_layer is not None:
                on_layer()
            h = self._mlp(i - 1, h, ops)
        if i == len(self.layers):
            return h, None
        layer = self.layers[i]
        return h, self._qkv(layer, ops.norm(h, layer["ln1"]), tables, x, cache, i, ops)

    def rope_tables(self, positions: torch.Tensor) -> Tables:
        """RoPE's (cos, sin) at `positions`."""
        return rope_tables(positions, self.inv_freq, self.dtype)

    def head(self, h: torch.Tensor, x: StepTensors) -> ForwardOut:
        """The pass's outputs from its final hidden states `h` (rows of `x`): each sequence's
        logits at its last row, its hidden state at `hidden_rows`."""
        last = self.ops().norm(h[x.last_rows], self.final_norm)
        logits = F.linear(last, self.lm_head).float()
        if self.tp is not None:
            logits = self.tp.all_gather(logits)
        return ForwardOut(logits, h[x.hidden_rows])

    def _mlp(self, i: int, h: torch.Tensor, ops: TorchOps) -> torch.Tensor:
        """Layer i's MLP block on `h`: its norm, the MLP (or the experts), the residual."""
        layer = self.layers[i]
        m = ops.norm(h, layer["ln2"])
        if i in self.moes:
            return h + self._reduce(self.moes[i](m))
        gate_up = F.linear(m, layer["w_gate_up"])
        return self._row_parallel(h, ops.silu_mul(gate_up), layer["w_down"])

    def _attend(
        self,
        layer: dict[str, torch.Tensor],
        a: torch.Tensor,
        tables: Tables,
        x: StepTensors,
        cache: KVCache,
        i: int,
        attn: Attention,
        ops: TorchOps,
    ) -> torch.Tensor:
        """Layer `i`'s attention of the tokens `a` (rows of `x`), before `wo`."""
        if self.mla:
            return self._mla(layer, a, *tables, x, cache, i, attn)
        q = self._qkv(layer, a, tables, x, cache, i, ops)
        return attn.run(cache.layers[i], q).reshape(a.shape[0], -1)

    def _row_parallel(self, h: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """h + x @ w.T, the product summed over the tp group (w holds this rank's columns)."""
        if self.tp is None:
            return torch.addmm(h, x, w.t())  # residual add in the GEMM's epilogue
        return h + self.tp.all_reduce(F.linear(x, w))

    def _reduce(self, partial: torch.Tensor) -> torch.Tensor:
        return partial if self.tp is None else self.tp.all_reduce(partial)

    def ops(self) -> TorchOps:
        """FusedOps when `fused_ops` is on and the model is on CUDA, else TorchOps."""
        if not (self.fused_ops and self.device.type == "cuda"):
            return TorchOps()
        if not hasattr(self, "_fused"):
            self._fused = FusedOps()
        return self._fused

    def _qkv(
        self,
        layer: dict[str, torch.Tensor],
        a: torch.Tensor,
        tables: Tables,
        x: StepTensors,
        cache: KVCache,
        i: int,
        ops: TorchOps,
    ) -> torch.Tensor:
        """Layer `i`'s q of the tokens `a`, roped, its k roped and written to the cache with
        its v."""
        t, heads = a.shape[0], self.heads
        qkv = F.linear(a, layer["wqkv"]).view(t, -1, self.spec.head_dim)
        q, k = qkv[:, :heads], qkv[:, heads : heads + self.kv_heads]
        ops.rope(q, k, x.positions, tables)
        kv = qkv[:, heads:].view(t, 2, self.kv_heads, self.spec.head_dim)
        write_kv(cache.layers[i], x, cache.layout.layout, kv)
        return q

    def _mla(
        self,
        layer: dict[str, torch.Tensor],
        a: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        x: StepTensors,
        cache: KVCache,
        i: int,
        attn: Attention,
    ) -> torch.Tensor:
        s, t = self.spec, a.shape[0]
        if s.q_lora_rank:
            q = F.linear(rms_norm(F.linear(a, layer["w_dq"]), layer["q_norm"]), layer["w_uq"])
        else:
            q = F.linear(a, layer["w_q"])
        q_nope, q_pe = q.view(t, self.heads, -1).split([s.qk_nope_dim, s.qk_rope_dim], dim=-1)
        q_pe = rotate(q_pe, cos, sin)
        ckv, kpe = F.linear(a, layer["w_dkv"]).split([s.kv_lora_rank, s.qk_rope_dim], dim=-1)
        latent = torch.cat(
            [rms_norm(ckv, layer["kv_norm"]), rotate(kpe[:, None], cos, sin)[:, 0]], -1
        )
        write_kv(cache.layers[i], x, cache.layout.layout, latent)
        q_abs = torch.einsum("thn,hnc->thc", q_nope, layer["w_uk"]).contiguous()
        o = attn.run(cache.layers[i], q_abs, q_pe.contiguous())
        return torch.einsum("thc,hvc->thv", o, layer["w_uv"]).reshape(t, -1)


def rank_cuts(spec: ModelSpec, tp: TensorParallel) -> dict[str, Cut]:
    """What rank `tp.rank` keeps of each attention, dense-MLP and lm_head weight (and of the MoE
    weights, as `moe.*`): attention within its attention group, the rest over the whole group.
    ConfigError naming the width that `tp` does not divide (no weight is drawn)."""
    cuts = attention_cuts(spec, tp)
    if spec.layers > spec.moe_layers:
        cuts["w_gate_up"], cuts["w_down"] = swiglu_cuts(
            spec.intermediate, tp, f"{spec.name}'s MLP width (intermediate)"
        )
    if spec.is_moe:
        cuts |= {f"moe.{k}": v for k, v in MoE.cuts(spec, tp).items()}
    return cuts | {"lm_head": lm_head_cut(spec, tp)}

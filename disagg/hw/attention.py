"""Paged attention over the KV cache: FlashInfer on CUDA, a float32 torch reference anywhere.

Both follow FlashInfer's split: `plan(meta)` once per step (host index arrays), then
`run(cache, q, q_pe)` once per layer. New tokens sit at the end of each sequence (the cache
already holds their K/V), and masking is causal and bottom-right aligned: new token i of a
sequence with L new and S cached tokens sees cached tokens 0 .. S - L + i.

GQA: q `[T, heads, head_dim]` -> out `[T, heads, head_dim]`; query head h reads KV head
h // (heads / kv_heads). MLA (absorbed, DeepSeek-V3): q = q_nope after absorbing W_UK,
`[T, heads, kv_lora_rank]`, and q_pe `[T, heads, qk_rope_dim]`; scores are
q·ckv + q_pe·kpe against the cached latent, and out `[T, heads, kv_lora_rank]` is the
softmax-weighted latent (W_UV is applied by the caller).
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import numpy as np
import torch

from disagg.core.kvcache import Layout, PageLayout, pages_for
from disagg.errors import ConfigError
from disagg.hw.batch import BatchMeta, Seq
from disagg.models import ModelSpec

WORKSPACE_BYTES = 128 * 2**20
# FlashInfer's MLA backend: "fa2" (SM80 code, runs on Hopper) keeps the JIT build short; "fa3"
# (Hopper only) is the faster kernel once MLA speed matters.
MLA_BACKEND = "fa2"
# GQA decode kernel: "cuda-cores" (FlashInfer's decode kernel), or "fa2" / "fa3": tensor cores,
# FlashInfer's prefill kernel of that backend with a KV group's query heads as rows ("fa3" is
# the module the prefill wrapper builds anyway; "fa2" is one more JIT build). Read when a
# wrapper is made. The default is the fastest of the three on Hopper at the catalogue's GQA
# shapes (the measured figures: docs/results.md).
DECODE_BACKEND = "fa2"
DECODE_BACKENDS = ("cuda-cores", "fa2", "fa3")


ATTENTION_CHOICES = ("auto", "torch", "flashinfer", *(f"flashinfer:{k}" for k in DECODE_BACKENDS))


def parse_attention(kind: str) -> tuple[str, str | None]:
    """("auto" | "torch" | "flashinfer", decode kernel or None) from an attention choice such
    as "flashinfer:cuda-cores"; ConfigError naming the choices for anything else."""
    if kind not in ATTENTION_CHOICES:
        raise ConfigError(f"unknown attention {kind!r}: use one of {', '.join(ATTENTION_CHOICES)}")
    backend, _, kernel = kind.partition(":")
    return backend, kernel or None


def _decode_kernel(kernel: str) -> dict[str, Any]:
    """Keyword arguments that select `kernel` in a FlashInfer decode wrapper."""
    if kernel not in DECODE_BACKENDS:
        raise ConfigError(f"unknown decode kernel {kernel!r}: one of {DECODE_BACKENDS}")
    if kernel == "cuda-cores":
        return {}
    return {"use_tensor_cores": True, "backend": kernel}


def import_flashinfer() -> ModuleType:
    """The flashinfer module, or ConfigError saying how to install it."""
    try:
        import flashinfer
    except ImportError as e:
        raise ConfigError("FlashInfer is not installed: pip install disagg[gpu]") from e
    return flashinfer


@dataclass(frozen=True)
class AttnShape:
    """What an attention backend must know about the model and the pages.

    GQA: head_dim is the q/k/v head size. MLA: kv_heads is 1, head_dim is kv_lora_rank (the
    latent, also the output size) and rope_dim is qk_rope_dim.
    """

    heads: int
    kv_heads: int
    head_dim: int
    page_size: int
    sm_scale: float
    layout: Layout = "HND"
    mla: bool = False
    rope_dim: int = 0

    @property
    def page(self) -> PageLayout:
        """One page of one layer as these kernels read it (`.shape` without the page index)."""
        latent = self.head_dim + self.rope_dim if self.mla else self.head_dim
        return PageLayout(self.page_size, self.kv_heads, latent, layout=self.layout, mla=self.mla)

    @staticmethod
    def of(spec: ModelSpec, page_size: int, layout: Layout = "HND") -> AttnShape:
        if spec.attention == "mla":
            scale = 1.0 / math.sqrt(spec.qk_nope_dim + spec.qk_rope_dim)
            return AttnShape(
                spec.heads, 1, spec.kv_lora_rank, page_size, scale, layout, True, spec.qk_rope_dim
            )
        scale = 1.0 / math.sqrt(spec.head_dim)
        return AttnShape(spec.heads, spec.kv_heads, spec.head_dim, page_size, scale, layout)


class Attention(ABC):
    """Paged attention for one step: plan once, run per layer."""

    def __init__(self, shape: AttnShape) -> None:
        self.shape = shape

    @abstractmethod
    def plan(self, meta: BatchMeta, staged: bool = False) -> None:
        """Prepare for a step described by `meta` (host-side work only). `staged`: a pass may be
        running on the device, which no copy of the plan's may wait for."""

    @abstractmethod
    def run(
        self, cache: torch.Tensor, q: torch.Tensor, q_pe: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Attention of the planned step's new tokens over one layer's pages (see module doc)."""


def dense_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
) -> torch.Tensor:
    """Causal attention, float32, bottom-right aligned.

    q [L, Hq, D], k [S, Hkv, D], v [S, Hkv, Dv] with S >= L -> out [L, Hq, Dv] float32.
    """
    q, k, v = q.float(), k.float(), v.float()
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    scores = torch.einsum("lhd,shd->hls", q, k) * scale
    s, n = k.shape[0], q.shape[0]
    pos = torch.arange(s - n, s, device=q.device)
    mask = torch.arange(s, device=q.device)[None, :] > pos[:, None]
    scores = scores.masked_fill(mask, float("-inf"))
    return torch.einsum("hls,shd->lhd", scores.softmax(-1), v)


def gather_pages(
    cache: torch.Tensor, pages: torch.Tensor, kv_len: int, shape: AttnShape
) -> torch.Tensor:
    """The first `kv_len` cached tokens of a sequence, contiguous.

    GQA -> [2, kv_len, kv_heads, head_dim] (K, V). MLA -> [kv_len, head_dim + rope_dim].
    """
    x = cache[pages]
    if shape.mla:
        return x.reshape(-1, x.shape[-1])[:kv_len]
    # HND [n, 2, H, page, D] and NHD [n, 2, page, H, D] both -> [2, n, page, H, D]
    x = x.permute(1, 0, 3, 2, 4) if shape.layout == "HND" else x.permute(1, 0, 2, 3, 4)
    return x.reshape(2, -1, x.shape[-2], x.shape[-1])[:, :kv_len]


Problem = tuple[list[Seq], torch.Tensor, torch.Tensor, torch.Tensor | None]


def random_problem(shape: AttnShape, lens: list[tuple[int, int]], seed: int = 0) -> Problem:
    """A random paged step for tests and benchmarks: (sequences, pages, q, q_pe), float32 on the
    CPU. lens holds (cached, new) tokens per sequence; the sequences sit on shuffled pages, and
    three more pages hold garbage (as do page slots past each sequence's tokens), so a kernel
    that reads outside its pages shows it."""
    gen = torch.Generator().manual_seed(seed)
    need = [pages_for(c + n, shape.page_size) for c, n in lens]
    perm = torch.randperm(sum(need) + 3, generator=gen).tolist()
    seqs, at = [], 0
    for (c, n), k in zip(lens, need, strict=True):
        seqs.append(Seq.of([1] * n, c, perm[at : at + k]))
        at += k
    cache = torch.randn((len(perm), *shape.page.shape), generator=gen)
    t = sum(n for _, n in lens)
    q = torch.randn(t, shape.heads, shape.head_dim, generator=gen)
    q_pe = torch.randn(t, shape.heads, shape.rope_dim, generator=gen) if shape.mla else None
    return seqs, cache, q, q_pe


# the sizes FlashInfer builds kernels for, as the GPU tests and benchmarks check them: GQA
# head_dim 128 with group 4, HND and NHD; MLA latent 512 + rope 64, DeepSeek-V3's 1/sqrt(192)
FLASHINFER_SHAPES = {
    "GQA-HND": AttnShape(8, 2, 128, 16, 128**-0.5, layout="HND"),
    "GQA-NHD": AttnShape(8, 2, 128, 16, 128**-0.5, layout="NHD"),
    "MLA": AttnShape(16, 1, 512, 16, 192**-0.5, mla=True, rope_dim=64),
}


def error_against_reference(
    shape: AttnShape,
    lens: list[tuple[int, int]],
    device: torch.device,
    seed: int = 0,
    kernel: str | None = None,
) -> tuple[float, float]:
    """(max |FlashInfer - reference|, max |reference|) on one random paged problem with bf16
    inputs (`random_problem`); FlashInfer's decode kernel `kernel` (default DECODE_BACKEND)."""
    seqs, cache, q, q_pe = random_problem(shape, lens, seed)
    cache, q = cache.to(device, torch.bfloat16), q.to(device, torch.bfloat16)
    q_pe = q_pe.to(device, torch.bfloat16) if q_pe is not None else None
    meta = BatchMeta.of(seqs, shape.page_size, cache.shape[0])
    choice = "flashinfer" if kernel is None else f"flashinfer:{kernel}"
    fi, ref = make_attention(choice, shape, device), TorchAttention(shape)
    fi.plan(meta)
    ref.plan(meta)
    got, want = fi.run(cache, q, q_pe).float(), ref.run(cache, q, q_pe).float()
    return (got - want).abs().max().item(), want.abs().max().item()


class TorchAttention(Attention):
    """The float32 reference: gathers each sequence's pages and runs dense causal attention."""

    def plan(self, meta: BatchMeta, staged: bool = False) -> None:
        self._meta = meta
        self._pages: list[torch.Tensor] = []
        self._device: torch.device | None = None

    def run(
        self, cache: torch.Tensor, q: torch.Tensor, q_pe: torch.Tensor | None = None
    ) -> torch.Tensor:
        m, sh = self._meta, self.shape
        if self._device != cache.device:
            self._device = cache.device
            idx = torch.from_numpy(m.kv_indices.astype(np.int64))
            self._pages = list(idx.to(cache.device).split(np.diff(m.kv_indptr).tolist()))
        out = torch.empty_like(q)
        qo, lens = m.qo_indptr.tolist(), m.kv_lens.tolist()
        for i, pages in enumerate(self._pages):
            rows = slice(qo[i], qo[i + 1])
            kv = gather_pages(cache, pages, lens[i], sh)
            if sh.mla:
                if q_pe is None:
                    raise ConfigError("MLA attention needs q_pe")
                qq = torch.cat([q[rows], q_pe[rows]], dim=-1)
                o = dense_attention(qq, kv[:, None, :], kv[:, None, : sh.head_dim], sh.sm_scale)
            else:
                o = dense_attention(q[rows], kv[0], kv[1], sh.sm_scale)
            out[rows] = o.to(q.dtype)
        return out


def plan_tensors(meta: BatchMeta) -> tuple[torch.Tensor, ...]:
    """`meta`'s arrays as the host int32 tensors FlashInfer's plan() takes, sharing their
    memory: qo_indptr, kv_indptr, kv_indices, kv_lens and last_page_len."""
    arrays = (meta.qo_indptr, meta.kv_indptr, meta.kv_indices, meta.kv_lens, meta.last_page_len)
    return tuple(torch.from_numpy(np.ascontiguousarray(a, np.int32)) for a in arrays)


class FlashInferAttention(Attention):
    """FlashInfer paged attention on one CUDA device.

    GQA: BatchPrefillWithPagedKVCacheWrapper for steps with any prefill chunk,
    BatchDecodeWithPagedKVCacheWrapper for pure decode steps. MLA: BatchMLAPagedAttentionWrapper
    for both. With `graph_batch` set, the wrappers use fixed buffers for exactly that many
    sequences and at most `max_pages` pages, and only decode steps may be planned (CUDA graphs).
    """

    def __init__(
        self,
        shape: AttnShape,
        device: torch.device,
        *,
        graph_batch: int | None = None,
        max_pages: int = 0,
        workspace: torch.Tensor | None = None,
        dtype: torch.dtype = torch.bfloat16,
        decode_kernel: str | None = None,
    ) -> None:
        super().__init__(shape)
        self.decode_kernel = decode_kernel or DECODE_BACKEND  # GQA decode steps only
        self._fi = import_flashinfer()
        self.device = device
        self.dtype = dtype
        self.graph_batch = graph_batch
        self.workspace = (
            workspace
            if workspace is not None
            else torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        )
        self._prefill: Any = None
        self._decode: Any = None
        self._mla: Any = None
        self._active: Any = None
        if shape.mla:
            self._mla = self._make_mla(max_pages)
        elif graph_batch is not None:
            self._decode = self._make_graph_decode(max_pages)
        else:
            wrappers = self._fi
            self._prefill = wrappers.BatchPrefillWithPagedKVCacheWrapper(
                self.workspace, shape.layout
            )
            self._decode = wrappers.BatchDecodeWithPagedKVCacheWrapper(
                self.workspace, shape.layout, **_decode_kernel(self.decode_kernel)
            )

    def _buf(self, n: int) -> torch.Tensor:
        return torch.zeros(n, dtype=torch.int32, device=self.device)

    def _make_graph_decode(self, max_pages: int) -> Any:
        b = int(self.graph_batch or 0)
        return self._fi.BatchDecodeWithPagedKVCacheWrapper(
            self.workspace,
            self.shape.layout,
            use_cuda_graph=True,
            **_decode_kernel(self.decode_kernel),
            paged_kv_indptr_buffer=self._buf(b + 1),
            paged_kv_indices_buffer=self._buf(max_pages),
            paged_kv_last_page_len_buffer=self._buf(b),
        )

    def _make_mla(self, max_pages: int) -> Any:
        mla = self._fi.mla.BatchMLAPagedAttentionWrapper
        if self.graph_batch is None:
            return mla(self.workspace, backend=MLA_BACKEND)
        b = self.graph_batch
        return mla(
            self.workspace,
            backend=MLA_BACKEND,
            use_cuda_graph=True,
            qo_indptr=self._buf(b + 1),
            kv_indptr=self._buf(b + 1),
            kv_indices=self._buf(max_pages),
            kv_len_arr=self._buf(b),
        )

    def plan(self, meta: BatchMeta, staged: bool = False) -> None:
        sh = self.shape
        if self.graph_batch is not None and (not meta.is_decode or meta.batch != self.graph_batch):
            raise ConfigError(f"graph attention is planned for {self.graph_batch} decode rows only")
        qo, kv_ptr, idx, kv_lens, last_page_len = plan_tensors(meta)

        def host(t: torch.Tensor) -> torch.Tensor:
            # staged: a copy from pageable memory waits for the stream, a pinned one does not
            return t.pin_memory() if staged else t

        if staged:  # FlashInfer copies the page list without waiting only from the device
            idx = idx.pin_memory().to(self.device, non_blocking=True)
        dtype = self.dtype
        if sh.mla:
            self._mla.plan(
                host(qo),
                host(kv_ptr),
                idx,
                host(kv_lens),
                sh.heads,
                sh.head_dim,
                sh.rope_dim,
                sh.page_size,
                True,
                sh.sm_scale,
                dtype,
                dtype,
            )
            return
        pages = (host(kv_ptr), idx, host(last_page_len))
        heads = (sh.heads, sh.kv_heads, sh.head_dim, sh.page_size)
        types = {"q_data_type": dtype, "kv_data_type": dtype, "sm_scale": sh.sm_scale}
        if meta.is_decode:
            self._decode.plan(*pages, *heads, **types)
            self._active = self._decode
        else:
            self._prefill.plan(qo, *pages, *heads, causal=True, **types)
            self._active = self._prefill

    def run(
        self, cache: torch.Tensor, q: torch.Tensor, q_pe: torch.Tensor | None = None
    ) -> torch.Tensor:
        if not self.shape.mla:
            return self._active.run(q, cache)
        if q_pe is None:
            raise ConfigError("MLA attention needs q_pe")
        c = self.shape.head_dim
        return self._mla.run(q, q_pe, cache[..., :c], cache[..., c:])


def make_attention(
    kind: str, shape: AttnShape, device: torch.device, dtype: torch.dtype = torch.bfloat16
) -> Attention:
    """ "torch" (reference), "flashinfer" (CUDA only) or "auto" (flashinfer on CUDA, else torch);
    "flashinfer:KERNEL" also names the GQA decode kernel (default DECODE_BACKEND).

    `dtype` is the q and KV dtype FlashInfer plans for (the reference takes any).
    """
    backend, kernel = parse_attention(kind)
    if backend == "auto":
        backend = "flashinfer" if device.type == "cuda" else "torch"
    if backend == "torch":
        return TorchAttention(shape)
    if device.type != "cuda":
        raise ConfigError(f"FlashInfer attention needs a CUDA device, got {device}")
    return FlashInferAttention(shape, device, dtype=dtype, decode_kernel=kernel)

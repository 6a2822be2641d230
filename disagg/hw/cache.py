"""The paged KV cache on a device: one tensor per layer, laid out as PageLayout says.

The layer tensors are views of one allocation, `[layers, num_pages + 1, ...]`, so a page of
layer l+1 lies a fixed distance after the same page of layer l: a wire can send one run of
pages in every layer as one strided (2D) copy (the cuda wire does, for posts that carry several
layers).

GQA layer tensor: `[num_pages + 1, 2, kv_heads, page_size, head_dim]` (HND) or
`[num_pages + 1, 2, page_size, kv_heads, head_dim]` (NHD), K then V, as FlashInfer's paged
wrappers take it. MLA layer tensor: `[num_pages + 1, page_size, kv_lora_rank + qk_rope_dim]`, the
compressed latent then the rope key of each token. Page p of a layer starts at byte
`p * layout.page_bytes`; the extra last page (id `num_pages`) is the runner's scratch page for
padded CUDA-graph rows and is never handed out by a PagePool of `num_pages` pages.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from disagg.core.kvcache import Layout, PageLayout
from disagg.core.sharding import shard_layout
from disagg.errors import ConfigError
from disagg.hw.device import check_fits
from disagg.models import ModelSpec


def page_layout(
    spec: ModelSpec, page_size: int, layout: Layout, elem_bytes: int, tp: int = 1
) -> PageLayout:
    """The PageLayout of one page of one layer of `spec` on one rank of a TP group of `tp`:
    its KV heads as the transfer planner places them (GQA), or the whole latent (MLA)."""
    if spec.attention == "mla":
        dim = spec.kv_lora_rank + spec.qk_rope_dim
        return PageLayout(page_size, 1, dim, elem_bytes, layout, mla=True)
    heads = shard_layout(spec, tp).heads_per_rank
    return PageLayout(page_size, heads, spec.head_dim, elem_bytes, layout)


@dataclass
class KVCache:
    """Per-layer page tensors plus their layout; build with `KVCache.allocate`."""

    layers: list[torch.Tensor]
    layout: PageLayout
    num_pages: int

    @property
    def page_size(self) -> int:
        return self.layout.page_size

    @property
    def scratch_page(self) -> int:
        return self.num_pages

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.layers)

    def layer_bytes(self, layer: int) -> torch.Tensor:
        """Flat uint8 view of a layer's first `num_pages` pages (what a wire registers)."""
        flat = self.layers[layer].view(-1).view(torch.uint8)
        return flat[: self.num_pages * self.layout.page_bytes]

    @staticmethod
    def allocate(
        spec: ModelSpec,
        num_pages: int,
        page_size: int,
        device: torch.device,
        dtype: torch.dtype,
        layout: Layout = "HND",
        tp: int = 1,
    ) -> KVCache:
        """Zeroed pages for every layer of `spec` (one rank's shard under TP `tp`); ConfigError
        if the device cannot hold them or `tp` cannot shard the model."""
        if num_pages < 1:
            raise ConfigError(f"a KV cache needs at least one page, got {num_pages}")
        elem = torch.empty((), dtype=dtype).element_size()
        pl = page_layout(spec, page_size, layout, elem, tp)
        shape = (num_pages + 1, *pl.shape)
        check_fits(
            device,
            spec.layers * shape[0] * pl.page_bytes,
            f"a KV cache of {num_pages} pages x {spec.layers} layers",
        )
        whole = torch.zeros((spec.layers, *shape), dtype=dtype, device=device)
        return KVCache(list(whole.unbind(0)), pl, num_pages)

"""Small shapes of catalogue models, for tests and CPU runs (dataclasses.replace on the real ones).

`tiny_*` use toy head sizes (CPU only). `small_*` keep the head sizes FlashInfer's kernels are
built for (GQA head_dim 128; MLA kv_lora_rank 512 + qk_rope_dim 64) with few heads and layers,
so GPU tests compile the same kernels as the full-size runs.
"""

from __future__ import annotations

from dataclasses import replace

from disagg.models import (
    DEEPSEEK_V3,
    LLAMA_31_8B,
    TINY_GQA,
    TINY_MLA,
    TINY_MLA_MOE,
    TINY_MOE,
    ModelSpec,
    dense,
)


def tiny_gqa(layers: int = 2) -> ModelSpec:
    """Llama-3.1-8B's structure at hidden 64: 4 query heads, 2 KV heads of 16 (the catalogue's
    tiny-gqa, at any depth)."""
    return replace(TINY_GQA, layers=layers)


def tiny_mla(layers: int = 2) -> ModelSpec:
    """DeepSeek-V3's MLA structure at hidden 64: latent 32 + rope 8, 4 heads, dense MLP (the
    catalogue's tiny-mla, at any depth)."""
    return replace(TINY_MLA, layers=layers)


def tiny_moe(layers: int = 2) -> ModelSpec:
    """The catalogue's tiny-moe (tiny-gqa with 8 routed experts, 2 per token), at any depth."""
    return replace(TINY_MOE, layers=layers)


def tiny_mla_moe(layers: int = 3) -> ModelSpec:
    """The catalogue's tiny-mla-moe (a dense layer, then 16 experts in 8 groups and a shared
    one), at any depth."""
    return replace(TINY_MLA_MOE, layers=layers)


def small_gqa(layers: int = 2) -> ModelSpec:
    """GQA with Llama's head size 128 and group size 4: 8 query heads, 2 KV heads."""
    return replace(
        LLAMA_31_8B,
        name="small-gqa",
        hidden=256,
        layers=layers,
        heads=8,
        kv_heads=2,
        head_dim=128,
        vocab=512,
        intermediate=512,
    )


def small_mla(layers: int = 2) -> ModelSpec:
    """MLA with DeepSeek-V3's latent 512 + rope 64 and 16 heads (one TP8 rank's share)."""
    return replace(
        dense(DEEPSEEK_V3),
        name="small-mla",
        hidden=256,
        layers=layers,
        heads=16,
        head_dim=192,
        vocab=512,
        intermediate=512,
        q_lora_rank=128,
    )


def small_moe(layers: int = 2) -> ModelSpec:
    """`small_gqa` with Qwen3-30B-A3B's routing at small widths: 16 experts, 4 per token."""
    return replace(
        small_gqa(layers), name="small-moe", experts=16, experts_per_token=4, moe_intermediate=128
    )

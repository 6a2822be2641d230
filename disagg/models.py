"""Model catalogue: public shapes and the figures derived from them.

Every derived figure (parameters, KV bytes, FLOPs) is a property so that a test can check it
against hand arithmetic. Counts are in elements or bytes; FLOPs count a multiply-add as two.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal

from disagg.errors import ConfigError

Attention = Literal["gqa", "mla"]
Router = Literal["softmax", "grouped"]

DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp8": 1, "fp32": 4}


def dtype_bytes(dtype: str) -> int:
    """Bytes per element of a dtype name (bf16, fp16, fp8, fp32)."""
    if dtype not in DTYPE_BYTES:
        raise ConfigError(f"unknown dtype {dtype!r}; known: {', '.join(DTYPE_BYTES)}")
    return DTYPE_BYTES[dtype]


@dataclass(frozen=True)
class ModelSpec:
    """Shapes of a decoder-only transformer.

    GQA models use `heads`, `kv_heads`, `head_dim`. MLA models (DeepSeek-V3/R1) cache one latent
    vector of `kv_lora_rank + qk_rope_dim` elements per token and layer, shared by all heads.
    MoE layers hold `experts` routed experts of width `moe_intermediate`, `experts_per_token` of
    them active, plus `shared_experts` always-active ones; the first `dense_layers` layers use a
    dense MLP of width `intermediate`. `max_context` is the most tokens (prompt + output) one
    request may hold; None: unknown, not checked. Biases and norms are not counted.
    """

    name: str
    hidden: int
    layers: int
    heads: int
    head_dim: int
    vocab: int
    intermediate: int
    attention: Attention = "gqa"
    kv_heads: int = 0
    # MLA
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    qk_nope_dim: int = 0
    qk_rope_dim: int = 0
    v_head_dim: int = 0
    # MoE
    experts: int = 0
    experts_per_token: int = 0
    shared_experts: int = 0
    moe_intermediate: int = 0
    dense_layers: int = 0
    # how tokens pick experts (disagg.hw.moe): "softmax" top-k, or DeepSeek-V3's "grouped"
    # (sigmoid scores, `expert_groups` groups of which `topk_groups` are kept); `norm_topk`: the
    # k weights are renormalised to sum to one; `routed_scale` multiplies them
    router: Router = "softmax"
    expert_groups: int = 1
    topk_groups: int = 1
    norm_topk: bool = True
    routed_scale: float = 1.0
    # multi-token prediction modules (DeepSeek-V3's MTP)
    mtp_layers: int = 0
    max_context: int | None = None  # tokens of prompt + output per request
    tied_embeddings: bool = False  # the LM head shares the input embedding's weights

    # ---- structure -------------------------------------------------------------------
    @property
    def is_moe(self) -> bool:
        return self.experts > 0

    @property
    def moe_layers(self) -> int:
        return self.layers - self.dense_layers if self.is_moe else 0

    @property
    def kv_shardable_heads(self) -> int:
        """Heads a TP group can split the KV cache over (1 for MLA: the latent is replicated)."""
        return 1 if self.attention == "mla" else self.kv_heads

    # ---- KV cache --------------------------------------------------------------------
    @property
    def kv_elems_per_token_per_layer(self) -> int:
        """Cached elements per token per layer: 2*kv_heads*head_dim (K and V) or the MLA latent."""
        if self.attention == "mla":
            return self.kv_lora_rank + self.qk_rope_dim
        return 2 * self.kv_heads * self.head_dim

    def kv_bytes_per_token_per_layer(self, kv_dtype: str = "bf16") -> int:
        return self.kv_elems_per_token_per_layer * dtype_bytes(kv_dtype)

    def kv_bytes_per_token(self, kv_dtype: str = "bf16") -> int:
        """KV bytes per token over all layers (one full replica)."""
        return self.layers * self.kv_bytes_per_token_per_layer(kv_dtype)

    # ---- parameters ------------------------------------------------------------------
    @property
    def attn_params_per_layer(self) -> int:
        h = self.hidden
        if self.attention == "mla":
            qk = self.qk_nope_dim + self.qk_rope_dim
            q = (
                h * self.q_lora_rank + self.q_lora_rank * self.heads * qk
                if self.q_lora_rank
                else h * self.heads * qk
            )
            kv_a = h * (self.kv_lora_rank + self.qk_rope_dim)
            kv_b = self.kv_lora_rank * self.heads * (self.qk_nope_dim + self.v_head_dim)
            o = self.heads * self.v_head_dim * h
            return q + kv_a + kv_b + o
        return h * self.heads * self.head_dim * 2 + h * self.kv_heads * self.head_dim * 2

    @property
    def dense_mlp_params(self) -> int:
        """SwiGLU: gate, up and down projections."""
        return 3 * self.hidden * self.intermediate

    @property
    def expert_params(self) -> int:
        return 3 * self.hidden * self.moe_intermediate

    @property
    def mlp_params_per_moe_layer(self) -> int:
        router = self.hidden * self.experts
        return (self.experts + self.shared_experts) * self.expert_params + router

    @property
    def embedding_params(self) -> int:
        """Input embedding plus the LM head (one matrix when they are tied)."""
        return (1 if self.tied_embeddings else 2) * self.vocab * self.hidden

    @property
    def params(self) -> int:
        """All parameters (MTP modules excluded)."""
        dense = self.layers - self.moe_layers
        return (
            self.layers * self.attn_params_per_layer
            + dense * self.dense_mlp_params
            + self.moe_layers * self.mlp_params_per_moe_layer
            + self.embedding_params
        )

    @property
    def active_params_per_token(self) -> int:
        """Parameters one token multiplies through (the LM head, not the embedding lookup)."""
        dense = self.layers - self.moe_layers
        active_moe = (self.experts_per_token + self.shared_experts) * self.expert_params
        return (
            self.layers * self.attn_params_per_layer
            + dense * self.dense_mlp_params
            + self.moe_layers * (active_moe + self.hidden * self.experts)
            + self.vocab * self.hidden
        )

    def weight_bytes(self, dtype: str = "bf16") -> int:
        return self.params * dtype_bytes(dtype)

    # ---- FLOPs -----------------------------------------------------------------------
    @property
    def linear_flops_per_token(self) -> int:
        """FLOPs of every matrix multiply one token goes through (2 per parameter)."""
        return 2 * self.active_params_per_token

    def attn_score_dims(self, absorbed: bool = True) -> tuple[int, int]:
        """(qk dim, v dim) per head of the attention inner products.

        MLA decodes in absorbed form (queries meet the 512-wide latent plus the rope key) and
        prefills in plain form (qk_nope + qk_rope against decompressed keys, v_head_dim values).
        """
        if self.attention != "mla":
            return self.head_dim, self.head_dim
        if absorbed:
            return self.kv_lora_rank + self.qk_rope_dim, self.kv_lora_rank
        return self.qk_nope_dim + self.qk_rope_dim, self.v_head_dim

    def attn_flops(self, kv_len: int, absorbed: bool = True) -> int:
        """Attention FLOPs per layer for one query token attending to `kv_len` cached tokens."""
        qk, v = self.attn_score_dims(absorbed)
        return 2 * self.heads * kv_len * (qk + v)

    def with_layers(self, layers: int) -> ModelSpec:
        """The same shapes cut to `layers` layers (for small hardware runs)."""
        if not 1 <= layers <= self.layers:
            raise ConfigError(f"layers={layers} must be in 1..{self.layers} for {self.name}")
        return replace(self, layers=layers, dense_layers=min(self.dense_layers, layers))

    def check_context(self, tokens: int, what: str) -> None:
        """Raise ConfigError if `tokens` (a request's prompt + output, which `what` names)
        exceed this model's context."""
        if self.max_context is not None and tokens > self.max_context:
            raise ConfigError(
                f"{what} = {tokens:,} tokens exceed {self.name}'s context of "
                f"{self.max_context:,} tokens"
            )

    def check_tp(self, tp: int) -> None:
        """Raise ConfigError if tensor parallelism `tp` cannot shard this model's heads."""
        if tp < 1:
            raise ConfigError(f"tp={tp} must be >= 1")
        if self.heads % tp:
            raise ConfigError(f"tp={tp} does not divide {self.name}'s {self.heads} query heads")
        kv = self.kv_shardable_heads
        if self.attention == "gqa" and kv % tp and tp % kv:
            raise ConfigError(
                f"tp={tp} and {self.name}'s {kv} KV heads: one must divide the other "
                "(heads are split, or replicated when tp > kv_heads)"
            )


LLAMA_31_8B = ModelSpec(
    name="llama-3.1-8b",
    hidden=4096,
    layers=32,
    heads=32,
    kv_heads=8,
    head_dim=128,
    vocab=128256,
    intermediate=14336,
    max_context=131072,  # max_position_embeddings, meta-llama/Llama-3.1-8B config.json
)
LLAMA_31_70B = ModelSpec(
    name="llama-3.1-70b",
    hidden=8192,
    layers=80,
    heads=64,
    kv_heads=8,
    head_dim=128,
    vocab=128256,
    intermediate=28672,
    max_context=131072,  # max_position_embeddings, meta-llama/Llama-3.1-70B config.json
)
QWEN3_CODER_480B = ModelSpec(
    name="qwen3-coder-480b-a35b",
    hidden=6144,
    layers=62,
    heads=96,
    kv_heads=8,
    head_dim=128,
    vocab=151936,
    intermediate=8192,
    experts=160,
    experts_per_token=8,
    moe_intermediate=2560,
    # max_position_embeddings, Qwen/Qwen3-Coder-480B-A35B-Instruct config.json (256k native)
    max_context=262144,
)
DEEPSEEK_V3 = ModelSpec(
    name="deepseek-v3",
    hidden=7168,
    layers=61,
    heads=128,
    head_dim=192,
    vocab=129280,
    intermediate=18432,
    attention="mla",
    q_lora_rank=1536,
    kv_lora_rank=512,
    qk_nope_dim=128,
    qk_rope_dim=64,
    v_head_dim=128,
    experts=256,
    experts_per_token=8,
    shared_experts=1,
    moe_intermediate=2048,
    dense_layers=3,
    router="grouped",  # its config.json: topk_method noaux_tc, n_group 8, topk_group 4
    expert_groups=8,
    topk_groups=4,
    routed_scale=2.5,
    mtp_layers=1,
    # max_position_embeddings, deepseek-ai/DeepSeek-V3 (and -R1) config.json: 160k, YaRN from 4k
    max_context=163840,
)


# Llama 2 and Llama 3: the shapes and max_position_embeddings of each model's config.json on
# Hugging Face (meta-llama/Llama-2-7b-hf, meta-llama/Llama-2-70b-hf, meta-llama/Meta-Llama-3-8B);
# the Llama 2 paper (Touvron et al. 2023, table 1) gives the same 4k context and GQA for 70B only
LLAMA_2_7B = ModelSpec(
    name="llama-2-7b",
    hidden=4096,
    layers=32,
    heads=32,
    kv_heads=32,  # multi-head attention: one KV head per query head
    head_dim=128,
    vocab=32000,
    intermediate=11008,
    max_context=4096,
)
LLAMA_2_70B = ModelSpec(
    name="llama-2-70b",
    hidden=8192,
    layers=80,
    heads=64,
    kv_heads=8,
    head_dim=128,
    vocab=32000,
    intermediate=28672,
    max_context=4096,
)
LLAMA_3_8B = replace(LLAMA_31_8B, name="llama-3-8b", max_context=8192)  # 8k; 3.1 went to 128k


def dense(spec: ModelSpec) -> ModelSpec:
    """`spec` without MoE layers or MTP modules (the real backend runs a dense MLP)."""
    return replace(
        spec,
        experts=0,
        experts_per_token=0,
        shared_experts=0,
        moe_intermediate=0,
        dense_layers=0,
        mtp_layers=0,
    )


# toy shapes of the same structures, for CPU runs of the real backend and for tests; their
# context is a made-up 32k: above the tests' prompts and the default workload's longest request
TINY_GQA = replace(
    LLAMA_31_8B,
    name="tiny-gqa",
    hidden=64,
    layers=2,
    heads=4,
    kv_heads=2,
    head_dim=16,
    vocab=256,
    intermediate=128,
    max_context=32768,
)
TINY_MLA = replace(
    dense(DEEPSEEK_V3),
    name="tiny-mla",
    hidden=64,
    layers=2,
    heads=4,
    head_dim=24,
    vocab=256,
    intermediate=128,
    q_lora_rank=32,
    kv_lora_rank=32,
    qk_nope_dim=16,
    qk_rope_dim=8,
    v_head_dim=16,
    max_context=32768,
)

# mid-size MoE models that fit one H200 at full depth in bf16 (the shapes and
# max_position_embeddings of Qwen/Qwen3-30B-A3B's and deepseek-ai/DeepSeek-V2-Lite's
# config.json; 30.5B and 15.7B parameters)
QWEN3_30B_A3B = ModelSpec(
    name="qwen3-30b-a3b",
    hidden=2048,
    layers=48,
    heads=32,
    kv_heads=4,
    head_dim=128,
    vocab=151936,
    intermediate=6144,
    experts=128,
    experts_per_token=8,
    moe_intermediate=768,
    max_context=40960,
)
DEEPSEEK_V2_LITE = ModelSpec(
    name="deepseek-v2-lite",
    hidden=2048,
    layers=27,
    heads=16,
    head_dim=192,
    vocab=102400,
    intermediate=10944,
    attention="mla",
    kv_lora_rank=512,
    qk_nope_dim=128,
    qk_rope_dim=64,
    v_head_dim=128,
    experts=64,
    experts_per_token=6,
    shared_experts=2,
    moe_intermediate=1408,
    dense_layers=1,
    norm_topk=False,  # topk_method greedy, norm_topk_prob false, routed_scaling_factor 1
    max_context=163840,
)
# toy MoE models for CPU runs: tiny-gqa with 8 experts of 32, 2 per token (softmax routing);
# tiny-mla with a dense first layer, then 16 experts in 8 groups (grouped routing: 4 groups
# kept, 4 experts per token) and one shared expert
TINY_MOE = replace(TINY_GQA, name="tiny-moe", experts=8, experts_per_token=2, moe_intermediate=32)
TINY_MLA_MOE = replace(
    TINY_MLA,
    name="tiny-mla-moe",
    layers=3,
    experts=16,
    experts_per_token=4,
    shared_experts=1,
    moe_intermediate=32,
    dense_layers=1,
    router="grouped",
    expert_groups=8,
    topk_groups=4,
    routed_scale=2.5,
)

MODELS: dict[str, ModelSpec] = {
    m.name: m
    for m in (
        LLAMA_2_7B,
        LLAMA_2_70B,
        LLAMA_3_8B,
        LLAMA_31_8B,
        LLAMA_31_70B,
        QWEN3_CODER_480B,
        DEEPSEEK_V3,
        QWEN3_30B_A3B,
        DEEPSEEK_V2_LITE,
        TINY_GQA,
        TINY_MLA,
        TINY_MOE,
        TINY_MLA_MOE,
    )
}
MODELS["deepseek-r1"] = replace(DEEPSEEK_V3, name="deepseek-r1")  # same architecture


def get_model(name: str) -> ModelSpec:
    """Look a model up by catalogue name (case-insensitive)."""
    key = name.lower()
    if key not in MODELS:
        raise ConfigError(f"unknown model {name!r}; known: {', '.join(sorted(MODELS))}")
    return MODELS[key]

"""Catalogue figures against hand arithmetic."""

import pytest

from disagg.errors import ConfigError
from disagg.hardware import CONNECTX_7, H100_SXM, H200_SXM, Node, get_gpu, get_nic
from disagg.models import (
    DEEPSEEK_V3,
    LLAMA_2_7B,
    LLAMA_2_70B,
    LLAMA_3_8B,
    LLAMA_31_8B,
    LLAMA_31_70B,
    QWEN3_CODER_480B,
    get_model,
)


def test_llama_8b_kv_bytes_per_token() -> None:
    # K and V, 8 KV heads of 128 dims, 2 bytes (bf16) or 1 byte (fp8)
    assert LLAMA_31_8B.kv_bytes_per_token_per_layer("bf16") == 2 * 8 * 128 * 2 == 4096
    assert LLAMA_31_8B.kv_bytes_per_token_per_layer("fp8") == 2048
    assert LLAMA_31_8B.kv_bytes_per_token("bf16") == 32 * 4096


def test_llama_8b_parameters() -> None:
    attn = 4096 * 4096 * 2 + 4096 * 1024 * 2  # q, o + k, v
    mlp = 3 * 4096 * 14336
    emb = 2 * 128256 * 4096
    assert LLAMA_31_8B.params == 32 * (attn + mlp) + emb
    assert 8.0e9 < LLAMA_31_8B.params < 8.1e9
    assert LLAMA_31_8B.weight_bytes("bf16") == 2 * LLAMA_31_8B.params
    # FLOPs per token: 2 per multiplied parameter (LM head, not the embedding lookup)
    assert LLAMA_31_8B.linear_flops_per_token == 2 * (32 * (attn + mlp) + 128256 * 4096)


def test_llama_70b_is_70b() -> None:
    assert 70.0e9 < LLAMA_31_70B.params < 71.0e9


def test_deepseek_v3_mla_and_moe_figures() -> None:
    m = DEEPSEEK_V3
    assert m.kv_bytes_per_token_per_layer("bf16") == (512 + 64) * 2
    assert m.kv_shardable_heads == 1
    assert m.moe_layers == 58
    assert m.expert_params == 3 * 7168 * 2048
    assert 665e9 < m.params < 675e9  # "671B"
    assert 36e9 < m.active_params_per_token < 39e9  # "37B activated"
    assert get_model("DeepSeek-R1").params == m.params


def test_qwen3_coder_shapes() -> None:
    m = QWEN3_CODER_480B
    assert m.kv_bytes_per_token_per_layer("bf16") == 2 * 8 * 128 * 2
    assert 470e9 < m.params < 490e9
    assert 33e9 < m.active_params_per_token < 37e9


def test_attention_flops_mla_absorbed_vs_plain() -> None:
    m = DEEPSEEK_V3
    assert m.attn_flops(1000) == 2 * 128 * 1000 * (576 + 512)
    assert m.attn_flops(1000, absorbed=False) == 2 * 128 * 1000 * (192 + 128)
    assert LLAMA_31_8B.attn_flops(10) == 2 * 32 * 10 * 256


def test_tp_checks() -> None:
    LLAMA_31_8B.check_tp(8)
    LLAMA_31_8B.check_tp(16 // 2)
    with pytest.raises(ConfigError, match="tp=3 does not divide"):
        LLAMA_31_8B.check_tp(3)
    with pytest.raises(ConfigError, match="tp=0"):
        LLAMA_31_8B.check_tp(0)
    DEEPSEEK_V3.check_tp(8)  # MLA: the latent is replicated


def test_unknown_names_are_clear_errors() -> None:
    with pytest.raises(ConfigError, match="unknown model 'gpt-9'"):
        get_model("gpt-9")
    with pytest.raises(ConfigError, match="unknown GPU 'B300'"):
        get_gpu("B300")
    with pytest.raises(ConfigError, match="unknown NIC"):
        get_nic("token-ring")


def test_hardware_figures() -> None:
    assert CONNECTX_7.bandwidth_bps == 50e9  # 400 Gbit/s
    assert H200_SXM.hbm_bandwidth_bps > H100_SXM.hbm_bandwidth_bps
    assert H200_SXM.flops("fp8") == pytest.approx(2 * H200_SXM.flops("bf16"), rel=1e-3)
    node = Node(H200_SXM, CONNECTX_7, gpus=8, nics=4)
    assert [node.nic_of_gpu(g) for g in range(8)] == [0, 0, 1, 1, 2, 2, 3, 3]
    with pytest.raises(ConfigError):
        node.nic_of_gpu(8)


def test_with_layers_cuts_depth() -> None:
    small = DEEPSEEK_V3.with_layers(2)
    assert small.layers == 2 and small.dense_layers == 2 and small.moe_layers == 0
    with pytest.raises(ConfigError):
        LLAMA_31_8B.with_layers(33)


def test_every_model_has_its_published_context_and_checks_requests_against_it() -> None:
    """max_position_embeddings of each model's config.json (the tiny models: a made-up 32k)."""
    from disagg.models import MODELS

    contexts = {name: spec.max_context for name, spec in MODELS.items()}
    assert contexts == {
        "llama-2-7b": 4096,
        "llama-2-70b": 4096,
        "llama-3-8b": 8192,
        "llama-3.1-8b": 131072,
        "llama-3.1-70b": 131072,
        "qwen3-coder-480b-a35b": 262144,
        "deepseek-v3": 163840,
        "deepseek-r1": 163840,
        "qwen3-30b-a3b": 40960,
        "deepseek-v2-lite": 163840,
        "tiny-gqa": 32768,
        "tiny-mla": 32768,
        "tiny-moe": 32768,
        "tiny-mla-moe": 32768,
    }
    LLAMA_31_8B.check_context(131072, "request 0")  # exactly the context: fits
    with pytest.raises(ConfigError) as err:
        LLAMA_31_8B.check_context(131073, "request 0")
    assert str(err.value) == (
        "request 0 = 131,073 tokens exceed llama-3.1-8b's context of 131,072 tokens"
    )
    assert LLAMA_31_8B.with_layers(2).max_context == 131072  # a cut model keeps its context


def test_llama_2_7b_is_multi_head_and_6_74b() -> None:
    m = LLAMA_2_7B
    attn = 4 * 4096 * 4096  # q, k, v, o: 32 KV heads of 128 = the hidden size
    mlp = 3 * 4096 * 11008
    assert m.params == 32 * (attn + mlp) + 2 * 32000 * 4096
    # the checkpoint's 6,738,415,616 parameters less its RMSNorm weights (2 per layer + final)
    assert m.params == 6_738_415_616 - (2 * 32 + 1) * 4096
    assert m.kv_bytes_per_token("bf16") == 32 * 2 * 32 * 128 * 2 == 524_288  # 512 KiB per token
    m.check_tp(8)


def test_llama_2_70b_is_gqa_and_68_98b() -> None:
    m = LLAMA_2_70B
    attn = 2 * 8192 * 8192 + 2 * 8192 * 8 * 128
    mlp = 3 * 8192 * 28672
    assert m.params == 80 * (attn + mlp) + 2 * 32000 * 8192
    assert m.params == 68_976_648_192 - (2 * 80 + 1) * 8192  # the checkpoint's, less its norms
    assert m.kv_bytes_per_token("bf16") == 80 * 2 * 8 * 128 * 2


def test_llama_3_8b_is_llama_31_8b_with_an_8k_context() -> None:
    assert LLAMA_3_8B.params == LLAMA_31_8B.params
    assert LLAMA_3_8B.max_context == 8192
    assert get_model("Llama-3-8B") is LLAMA_3_8B


def test_tied_embeddings_count_one_matrix() -> None:
    from dataclasses import replace

    tied = replace(LLAMA_31_8B, tied_embeddings=True)
    assert LLAMA_31_8B.params - tied.params == 128256 * 4096
    assert tied.active_params_per_token == LLAMA_31_8B.active_params_per_token  # the head runs

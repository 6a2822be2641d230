"""The roofline cost model in the regimes where it must be, and the profile loader."""

from pathlib import Path

import pytest

from disagg.config import CostConfig, GroupConfig, SpecConfig
from disagg.errors import ConfigError
from disagg.hardware import H200_SXM
from disagg.models import DEEPSEEK_V3, LLAMA_31_8B, LLAMA_31_70B
from disagg.sim.costmodel import ProfileCost, RooflineCost, StepShape, chunk_attn_pairs

COST = CostConfig()


def roofline(model=LLAMA_31_70B, tp: int = 8, dp: int = 1, draft: int = 0) -> RooflineCost:
    return RooflineCost(
        model,
        H200_SXM,
        GroupConfig(tp=tp, dp=dp),
        COST,
        SpecConfig(draft_tokens=draft, accepted_tokens_per_step=1.0),
    )


def test_prefill_is_compute_bound_at_8k_tokens() -> None:
    c = roofline()
    n = 8192
    flops_s = n * c.dense_flops_per_token / c.flops
    bytes_s = c.dense_bytes / c.hbm
    assert flops_s > 20 * bytes_s
    # doubling the tokens roughly doubles the GEMM time
    assert c._gemm(2 * n) == pytest.approx(2 * c._gemm(n), rel=0.01)


def test_decode_is_memory_bound_at_small_batches() -> None:
    c = roofline()
    for batch in (1, 8, 64):
        flops_s = batch * c.dense_flops_per_token / c.flops
        assert c.dense_bytes / c.hbm > 3 * flops_s
    # so a batch of 64 costs far less than 64 batches of one
    one = c.step_time(StepShape(decode_seqs=1, decode_context=1000))
    many = c.step_time(StepShape(decode_seqs=64, decode_context=64 * 1000))
    assert many < 3 * one


def test_decode_line_equals_step_time() -> None:
    for model in (LLAMA_31_8B, DEEPSEEK_V3):
        c = roofline(model, draft=1)
        a, b = c.decode_line(32)
        for ctx in (0, 1e4, 3e5):
            assert c.step_time(StepShape(decode_seqs=32, decode_context=ctx)) == pytest.approx(
                a + b * ctx
            )


def test_mla_reads_the_whole_latent_on_every_tp_rank() -> None:
    tp8, tp1 = roofline(DEEPSEEK_V3, tp=8), roofline(DEEPSEEK_V3, tp=1)
    assert tp8.kv_read_per_token == tp1.kv_read_per_token  # replicated latent
    gqa8, gqa1 = roofline(LLAMA_31_70B, tp=8), roofline(LLAMA_31_70B, tp=1)
    assert gqa1.kv_read_per_token == 8 * gqa8.kv_read_per_token  # heads split


def test_moe_expert_reads_grow_with_distinct_experts_then_saturate() -> None:
    c = roofline(DEEPSEEK_V3)
    t1, t64, t4k, t8k = (c._gemm(n) for n in (1, 64, 4096, 8192))
    assert t1 < t64 < t4k < t8k
    # at 1 token, 8 of 256 experts are read: far from reading them all
    assert t64 > 5 * t1


def test_tp_allreduce_and_overheads_add_time() -> None:
    assert roofline(tp=1)._comm(1024) == 0
    assert roofline(tp=8)._comm(1024) > 0
    assert roofline(DEEPSEEK_V3, tp=1, dp=8)._comm(1024) > 0  # MoE all-to-all


def test_chunk_attention_pairs() -> None:
    assert chunk_attn_pairs(0, 4) == 1 + 2 + 3 + 4
    assert chunk_attn_pairs(10, 2) == 11 + 12


def test_profile_cost_interpolates(tmp_path: Path) -> None:
    rows = ["kind,tokens,batch,context,duration_s"]
    for ctx in (0, 4096):
        for n in (512, 1024):
            rows.append(f"prefill,{n},1,{ctx},{0.001 * n / 512 + ctx * 1e-6}")
    for b in (1, 8):
        for ctx in (1000, 3000):
            rows.append(f"decode,{b},{b},{ctx},{0.01 + b * ctx * 1e-7}")
    path = tmp_path / "p.csv"
    path.write_text("\n".join(rows) + "\n")
    c = ProfileCost(path)
    assert c.step_time(
        StepShape(prefill_tokens=768, prefill_attn_pairs=768 * 769 / 2)
    ) == pytest.approx(0.0015)
    a, b = c.decode_line(8)
    assert a == pytest.approx(0.01) and b == pytest.approx(1e-7)
    assert c.step_time(StepShape(decode_seqs=8, decode_context=16000)) == pytest.approx(0.0116)


def test_profile_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="not found"):
        ProfileCost(tmp_path / "none.csv")
    bad = tmp_path / "bad.csv"
    bad.write_text("kind,tokens\nprefill,3\n")
    with pytest.raises(ConfigError, match="missing columns"):
        ProfileCost(bad)

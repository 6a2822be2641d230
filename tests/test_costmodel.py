"""The roofline cost model in the regimes where it must be, and the profile loader."""

from pathlib import Path

import pytest

from disagg.config import CostConfig, GroupConfig, SpecConfig
from disagg.core.metrics import steps_table
from disagg.core.scheduler import chunk_attn_pairs
from disagg.errors import ConfigError
from disagg.hardware import H200_SXM
from disagg.models import DEEPSEEK_V3, LLAMA_31_8B, LLAMA_31_70B, ModelSpec
from disagg.sim.costmodel import ProfileCost, RooflineCost, StepShape

COST = CostConfig()


def roofline(
    model: ModelSpec = LLAMA_31_70B, tp: int = 8, dp: int = 1, draft: int = 0
) -> RooflineCost:
    return RooflineCost(
        model,
        H200_SXM,
        GroupConfig(tp=tp, dp=dp),
        COST,
        SpecConfig(draft_tokens=draft, accepted_tokens_per_step=1.0),
    )


# Hand arithmetic from published shapes and datasheet figures (H200: 989e12 bf16 FLOP/s,
# 4.8e12 B/s HBM, 450e9 B/s NVLink) and CostConfig's default efficiencies.
GEMM_FLOPS = 989e12 * 0.7  # 692.3e12 FLOP/s
ATTN_FLOPS = 989e12 * 0.6
HBM = 4.8e12 * 0.7  # 3.36e12 B/s
NVLINK = 450e9 * 0.8  # 360e9 B/s

# Llama 3.1 70B: hidden 8192, 80 layers, 64 heads, 8 KV heads of 128, MLP 28672, vocab 128256.
# Per layer: q and o 8192*8192 each, k and v 8192*1024 each, MLP 3*8192*28672.
L70_ATTN = 2 * 8192 * 8192 + 2 * 8192 * 1024  # 150,994,944
L70_MLP = 3 * 8192 * 28672  # 704,643,072
L70_ACTIVE = 80 * (L70_ATTN + L70_MLP) + 128256 * 8192  # + LM head = 69,501,714,432


def test_prefill_is_compute_bound_at_8k_tokens() -> None:
    c = roofline()  # TP 8
    n = 8192
    flops_s = n * 2 * L70_ACTIVE / 8 / GEMM_FLOPS  # 0.2056 s
    bytes_s = L70_ACTIVE * 2 / 8 / HBM  # bf16 weights: 5.17 ms
    assert flops_s > 20 * bytes_s
    assert c._gemm(n, n) == pytest.approx(flops_s, rel=1e-9)
    assert c._gemm(2 * n, 2 * n) == pytest.approx(2 * flops_s, rel=1e-9)


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


# DeepSeek-V3 (hidden 7168, 61 layers, 3 dense, 58 MoE layers of 256 experts, top 8, width 2048).
DSV3_EXPERT = 3 * 7168 * 2048  # 44,040,192 parameters
DSV3_ATTN = (  # MLA per layer: q down/up, kv down (latent + rope), kv up, o
    7168 * 1536 + 1536 * 128 * 192 + 7168 * 576 + 512 * 128 * 256 + 128 * 128 * 7168
)  # 187,105,280
DSV3_DENSE = (  # every parameter a token meets outside the routed experts
    61 * DSV3_ATTN
    + 3 * 3 * 7168 * 18432  # dense MLPs
    + 58 * (DSV3_EXPERT + 7168 * 256)  # shared expert and router
    + 129280 * 7168  # LM head
)  # 16,189,947,904
# All 256 routed experts of 58 layers read once, bf16, spread over 8 GPUs: 48.65 ms
DSV3_ALL_EXPERTS_S = 256 * DSV3_EXPERT * 58 * 2 / 8 / HBM


def test_moe_expert_reads_grow_with_distinct_experts_then_saturate() -> None:
    c = roofline(DEEPSEEK_V3)  # TP 8
    dense_bytes_s = DSV3_DENSE * 2 / 8 / HBM  # 1.20 ms, memory-bound at 1 token
    dense_flops_s_per_token = 2 * DSV3_DENSE / 8 / GEMM_FLOPS  # 5.85 us
    # one token reads exactly its 8 of 256 experts
    assert c._gemm(1, 1) == pytest.approx(dense_bytes_s + 8 / 256 * DSV3_ALL_EXPERTS_S, rel=1e-9)
    # 64 tokens touch 256 * (1 - (31/32)^64) = 256 * (1 - 0.1311) = 222.44 distinct experts
    distinct_64 = 256 * (1 - (1 - 8 / 256) ** 64)
    assert distinct_64 == pytest.approx(222.44, abs=0.005)
    assert c._gemm(64, 64) == pytest.approx(
        dense_bytes_s + distinct_64 / 256 * DSV3_ALL_EXPERTS_S, rel=1e-9
    )
    # by 1024 tokens every expert is read: the expert term is at its ceiling and stays there
    # while the tokens double (expert FLOPs at 2048 tokens, 15 ms, are still under the reads)
    assert c._gemm(1024, 1024) == pytest.approx(
        1024 * dense_flops_s_per_token + DSV3_ALL_EXPERTS_S, rel=1e-9
    )
    assert c._gemm(2048, 2048) - c._gemm(1024, 1024) == pytest.approx(
        1024 * dense_flops_s_per_token, rel=1e-6
    )
    # at 8192 tokens the routed FLOPs (2 * 8192 * 8 experts * 58 layers / 8 GPUs) pass the reads
    expert_flops_s = 2 * 8192 * 8 * DSV3_EXPERT * 58 / 8 / GEMM_FLOPS  # 60.4 ms
    assert expert_flops_s > DSV3_ALL_EXPERTS_S
    assert c._gemm(8192, 8192) == pytest.approx(
        8192 * dense_flops_s_per_token + expert_flops_s, rel=1e-9
    )


def cost_with(
    model: ModelSpec = LLAMA_31_70B, tp: int = 8, dp: int = 1, **cost: float
) -> RooflineCost:
    return RooflineCost(
        model, H200_SXM, GroupConfig(tp=tp, dp=dp), CostConfig.model_validate(cost), SpecConfig()
    )


SHAPES = [
    StepShape(prefill_tokens=1024, prefill_attn_pairs=chunk_attn_pairs(0, 1024)),
    StepShape(decode_seqs=16, decode_context=16 * 2000),
    StepShape(prefill_tokens=100, prefill_attn_pairs=chunk_attn_pairs(50, 100), decode_seqs=3),
]


@pytest.mark.parametrize("shape", SHAPES)
def test_overheads_add_step_plus_layers_times_layer_overhead(shape: StepShape) -> None:
    bare = cost_with(step_overhead_s=0.0, layer_overhead_s=0.0)
    step_only = cost_with(step_overhead_s=0.002, layer_overhead_s=0.0)
    both = cost_with(step_overhead_s=0.002, layer_overhead_s=10e-6)
    base = bare.step_time(shape)
    assert step_only.step_time(shape) - base == pytest.approx(0.002, rel=1e-9)
    # 0.002 + 80 layers * 10 us = 2.8 ms
    assert both.step_time(shape) - base == pytest.approx(0.0028, rel=1e-9)
    assert both.step_time(StepShape()) == 0.0  # an empty step costs nothing, overheads included


def test_decode_line_intercept_carries_the_overheads() -> None:
    a_bare, b_bare = cost_with(step_overhead_s=0.0, layer_overhead_s=0.0).decode_line(16)
    a, b = cost_with(step_overhead_s=0.002, layer_overhead_s=10e-6).decode_line(16)
    assert a - a_bare == pytest.approx(0.0028, rel=1e-9)
    assert b == b_bare


def test_tp_allreduce_is_two_allreduces_per_layer() -> None:
    # 1024 tokens of 8192 bf16 activations = 16,777,216 B, reduced in the NVSwitch (each GPU
    # sends and receives it once), after 8 us + 14 ring steps of 1 us; two per layer, 80 layers
    one_s = 8e-6 + 14 * 1e-6 + 1024 * 8192 * 2 / NVLINK  # 68.6 us
    expected_s = 160 * one_s  # 10.98 ms
    assert roofline(tp=8)._comm(1024) == pytest.approx(expected_s, rel=1e-9)
    assert roofline(tp=1)._comm(1024) == 0.0
    # and it is in the step time: only the all-reduce's bytes depend on allreduce_efficiency, so
    # halving the efficiency adds their time once more
    shape = SHAPES[0]
    slow = cost_with(allreduce_efficiency=0.4).step_time(shape)
    wire_s = 160 * 1024 * 8192 * 2 / NVLINK
    assert slow - cost_with().step_time(shape) == pytest.approx(wire_s, rel=1e-9)


def test_dp_attention_moe_all_to_all_is_dispatch_plus_combine() -> None:
    # DeepSeek-V3 on 8 GPUs of DP attention, 1024 decodes spread over them: each GPU sends its
    # 128 tokens' top-8 hidden states (7168 bf16) out and back over 58 MoE layers, each
    # collective after 8 us + 7 peer steps of 1 us
    one_s = 8e-6 + 7 * 1e-6 + (128 * 7168 * 2) * 8 / NVLINK
    assert roofline(DEEPSEEK_V3, tp=1, dp=8)._comm(128) == pytest.approx(58 * 2 * one_s, rel=1e-9)


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
    a, slope = c.decode_line(8)
    assert a == pytest.approx(0.01) and slope == pytest.approx(1e-7)
    assert c.step_time(StepShape(decode_seqs=8, decode_context=16000)) == pytest.approx(0.0116)


def test_a_profile_of_chunks_without_context_holds_their_time_for_later_chunks(
    tmp_path: Path,
) -> None:
    """Prefill rows at context 0 only (every prompt fit one chunk when it was profiled): a
    chunk after cached tokens costs what the same chunk costs alone, and is counted as beyond
    the grid, not divided by the zero context."""
    rows = ["kind,tokens,batch,context,duration_s"]
    rows += [f"prefill,{n},1,0,{0.001 * n / 512}" for n in (512, 1024)]
    rows += [f"decode,{b},{b},1000,{0.01 * b}" for b in (1, 8)]
    path = tmp_path / "p.csv"
    path.write_text("\n".join(rows) + "\n")
    c = ProfileCost(path)
    alone = StepShape(prefill_tokens=768, prefill_attn_pairs=768 * 769 / 2)
    later = StepShape(prefill_tokens=768, prefill_attn_pairs=768 * 769 / 2 + 768 * 2000)
    assert c.step_time(alone) == pytest.approx(0.0015)
    assert c.extrapolated == 0
    assert c.step_time(later) == pytest.approx(0.0015)
    assert c.extrapolated == 1


def test_profile_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="not found"):
        ProfileCost(tmp_path / "none.csv")
    bad = tmp_path / "bad.csv"
    bad.write_text("kind,tokens\nprefill,3\n")
    with pytest.raises(ConfigError, match="missing columns"):
        ProfileCost(bad)


def write_profile(tmp_path: Path, extra: list[str] | None = None) -> Path:
    """Prefill: 1 ms per 512 tokens (+1 us per cached token), with a noisy dip at 2048;
    decode: 10 ms + 0.1 us per cached token of the batch."""
    rows = ["kind,tokens,batch,context,duration_s"]
    for ctx in (0, 4096):
        for n, t in ((512, 0.001), (1024, 0.002), (2048, 0.0019), (4096, 0.008)):
            rows.append(f"prefill,{n},1,{ctx},{t + ctx * 1e-6}")
    for b in (1, 8):
        for ctx in (1000, 3000):
            rows.append(f"decode,{b},{b},{ctx},{0.01 + b * ctx * 1e-7}")
    path = tmp_path / "p.csv"
    path.write_text("\n".join(rows + (extra or [])) + "\n")
    return path


def prefill(n: int) -> StepShape:
    return StepShape(prefill_tokens=n, prefill_attn_pairs=n * (n + 1) / 2)


def test_profile_curves_hold_below_the_grid_and_never_fall(tmp_path: Path) -> None:
    c = ProfileCost(write_profile(tmp_path))
    assert c.step_time(prefill(64)) == pytest.approx(0.001)  # below 512: the 512 pass's time
    # the dip at 2048 (1.9 ms < 2 ms at 1024) is measurement noise: the curve is held at 2 ms
    assert c.step_time(prefill(2048)) == pytest.approx(0.002)
    assert c.step_time(prefill(1536)) == pytest.approx(0.002)
    assert c.step_time(prefill(3072)) == pytest.approx(0.005)  # halfway from 2 to 8 ms
    assert (c.passes, c.extrapolated) == (4, 0)


def test_passes_beyond_the_grid_extrapolate_and_are_counted(tmp_path: Path) -> None:
    c = ProfileCost(write_profile(tmp_path))
    assert c.step_time(prefill(8192)) == pytest.approx(0.008 + 4096 * 0.006 / 2048)
    c.step_time(StepShape(decode_seqs=16, decode_context=16 * 1000))  # batch beyond 8
    c.step_time(StepShape(decode_seqs=8, decode_context=8 * 5000))  # context beyond 3000
    c.step_time(StepShape(decode_seqs=8, decode_context=8 * 2000))  # inside
    assert (c.passes, c.extrapolated) == (4, 3)


def test_mixed_rows_give_the_fixed_cost_a_mixed_pass_shares(tmp_path: Path) -> None:
    # measured mixed passes: 4 ms less than their prefill and decode parts
    parts = 0.002 + (0.01 + 8 * 2000 * 1e-7)
    extra = [f"mixed,1024,8,2000,{parts - 0.004}", f"mixed,1024,8,2000,{parts - 0.004}"]
    c = ProfileCost(write_profile(tmp_path, extra))
    assert c.mixed_offset_s == pytest.approx(-0.004)
    shape = StepShape(
        prefill_tokens=512, prefill_attn_pairs=512 * 513 / 2, decode_seqs=1, decode_context=1000
    )
    assert c.step_time(shape) == pytest.approx(0.001 + 0.0101 - 0.004)
    without = ProfileCost(write_profile(tmp_path))  # no mixed rows: the parts' sum
    assert without.mixed_offset_s == 0.0
    assert without.step_time(shape) == pytest.approx(0.001 + 0.0101)


def test_a_simulation_on_a_profile_counts_its_extrapolated_passes(tmp_path: Path) -> None:
    """The summary flags passes the profile costed beyond its grid: 512-4096-token prefills
    and decode batches of at most 8 cannot cover a 32-batch decode."""
    from disagg.config import build_experiment
    from disagg.sim.cluster import Sim

    path = write_profile(tmp_path)
    data = {
        "model": {"name": "tiny-gqa"},
        "cluster": {"mode": "colocated", "colocated": {"nodes": 1, "tp": 1, "max_batch": 32}},
        "cost": {"source": f"profile:{path}"},
        "workload": {
            "rate_per_s": 50,
            "num_requests": 60,
            "prompt_tokens": {"dist": "fixed", "value": 600},
            "output_tokens": {"dist": "fixed", "value": 40},
        },
    }
    sim = Sim(build_experiment(data))
    sim.run()
    flags = sim.cost_summary(steps_table(sim.rec))
    node = sim.nodes[0].cost
    assert isinstance(node, ProfileCost) and flags["profile_passes"] == node.passes > 0
    assert 0 < flags["profile_passes_extrapolated"] == node.extrapolated < node.passes
    roofline = Sim(build_experiment({k: v for k, v in data.items() if k != "cost"}))
    assert roofline.cost_summary(steps_table(roofline.rec)) == {}

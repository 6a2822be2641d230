"""The roofline's collectives, elementwise work, DP attention, draft module and context limit,
each against hand arithmetic from published shapes and datasheet figures (H200: 989e12 bf16
FLOP/s, 4.8e12 B/s HBM, 450e9 B/s NVLink per direction) and CostConfig's defaults."""

from pathlib import Path

import pytest

from disagg.config import CostConfig, GroupConfig, SpecConfig
from disagg.core.scheduler import chunk_attn_pairs
from disagg.core.workload import LengthDist, WorkloadConfig, generate
from disagg.errors import ConfigError
from disagg.hardware import H200_SXM
from disagg.models import DEEPSEEK_V3, LLAMA_31_8B, LLAMA_31_70B, ModelSpec
from disagg.sim.costmodel import RooflineCost, StepShape

GEMM = 989e12 * 0.7
ATTN = 989e12 * 0.6
HBM = 4.8e12 * 0.7
NVLINK = 450e9 * 0.8
FIXED_8B = 0.003 + 32 * 15e-6  # step overhead + 32 layers of launch gaps

# Llama 3.1 8B: hidden 4096, 32 layers, 32 heads and 8 KV heads of 128, MLP 14336, vocab 128256
L8_ATTN = 4096 * 32 * 128 * 2 + 4096 * 8 * 128 * 2  # q, o; k, v: 41,943,040 per layer
L8_MLP = 3 * 4096 * 14336  # 176,160,768 per layer
L8_HEAD = 128256 * 4096  # LM head: 525,336,576
L8_ACTIVE = 32 * (L8_ATTN + L8_MLP) + L8_HEAD  # 7,504,658,432
L8_KV = 2 * 8 * 128 * 2  # K and V bytes per token per layer (bf16): 4096
L8_PAIR = 2 * 32 * (128 + 128)  # attention FLOPs per (query, key) pair per layer: 16,384
# elementwise bytes per token per layer: 12 passes over the hidden state, gate/up/product
L8_STREAM = 12 * 4096 * 2  # 98,304
L8_ACT = 3 * 14336 * 2  # 86,016

# DeepSeek-V3: MLA attention per layer, and what a token meets outside its routed experts
DSV3_ATTN = 7168 * 1536 + 1536 * 128 * 192 + 7168 * 576 + 512 * 128 * 256 + 128 * 128 * 7168
DSV3_DENSE = 61 * DSV3_ATTN + 3 * 3 * 7168 * 18432 + 58 * (3 * 7168 * 2048 + 7168 * 256)
DSV3_DENSE += 129280 * 7168  # LM head: 16,189,947,904 in all


def cost(
    model: ModelSpec = LLAMA_31_8B, tp: int = 1, dp: int = 1, draft: int = 0, **fields: object
) -> RooflineCost:
    return RooflineCost(
        model,
        H200_SXM,
        GroupConfig(tp=tp, dp=dp),
        CostConfig.model_validate(fields),
        SpecConfig(draft_tokens=draft),
    )


def prefill(n: int, cached: int = 0) -> StepShape:
    return StepShape(prefill_tokens=n, prefill_attn_pairs=chunk_attn_pairs(cached, n))


# ---- all-reduce: alpha-beta by message size ----------------------------------------------
def test_an_allreduce_is_a_latency_per_collective_and_step_plus_its_bytes() -> None:
    # in the switch: 8 us + 2 * 7 ring steps of 1 us, then 64 MB once over 360 GB/s
    assert cost(LLAMA_31_70B, tp=8).allreduce_s(64e6) == pytest.approx(
        8e-6 + 14e-6 + 64e6 / NVLINK, rel=1e-12
    )
    # a ring over 4 GPUs: 6 steps, and each GPU sends 2 * 3/4 of the message
    ring = cost(LLAMA_31_70B, tp=4, allreduce_in_switch=False)
    assert ring.allreduce_s(1e6) == pytest.approx(8e-6 + 6e-6 + 1.5e6 / NVLINK, rel=1e-12)


def test_the_allreduce_defaults_land_near_nccl_on_h200() -> None:
    c = cost(LLAMA_31_70B, tp=8)
    assert c.allreduce_s(64e6) == pytest.approx(0.2e-3, rel=0.05)  # NCCL: about 0.2 ms
    for nbytes in (0.1e6, 1e6, 2e6):  # a decode batch's hidden states; NCCL: 20-40 us
        assert 20e-6 <= c.allreduce_s(nbytes) <= 40e-6
    assert c.allreduce_s(1e6) == pytest.approx(24.8e-6, abs=0.05e-6)


def test_a_decode_step_pays_the_latency_of_every_allreduce() -> None:
    # Llama 70B TP8, one token: 160 all-reduces of 8192 bf16 values, each at least 22 us
    one_s = 22e-6 + 8192 * 2 / NVLINK
    assert cost(LLAMA_31_70B, tp=8)._comm(1) == pytest.approx(160 * one_s, rel=1e-12)


# ---- non-GEMM work per layer -----------------------------------------------------------
def test_elementwise_traffic_is_in_proportion_to_tokens() -> None:
    c = cost()
    assert c.step_fixed_s == pytest.approx(FIXED_8B, rel=1e-12)
    assert c._elementwise(1000, 1000) == pytest.approx(
        1000 * 32 * (L8_STREAM + L8_ACT) / HBM, rel=1e-12
    )
    # the hidden-state passes are the only change when they are switched off
    none = cost(elementwise_hidden_passes=0)
    shape = prefill(2048)
    assert c.step_time(shape) - none.step_time(shape) == pytest.approx(
        2048 * 32 * L8_STREAM / HBM, rel=1e-9
    )
    # under TP8 every rank carries the whole hidden state and an eighth of the MLP activation
    t8 = cost(LLAMA_31_70B, tp=8)
    assert t8._elementwise(100, 100) == pytest.approx(
        100 * 80 * (12 * 8192 * 2 + 3 * 28672 * 2 / 8) / HBM, rel=1e-12
    )


def test_a_prefill_step_by_hand() -> None:
    n = 4096
    pairs = n * (n + 1) / 2
    expected = (
        FIXED_8B
        + n * 2 * L8_ACTIVE / GEMM  # compute-bound GEMMs
        + n * 32 * (L8_STREAM + L8_ACT) / HBM
        + max(pairs * 32 * L8_PAIR / ATTN, pairs / 128 * 32 * L8_KV / HBM)
    )
    assert cost().step_time(prefill(n)) == pytest.approx(expected, rel=1e-12)


# ---- DP attention ------------------------------------------------------------------------
def test_every_dp_group_holds_the_attention_weights() -> None:
    dp8, tp8 = cost(DEEPSEEK_V3, tp=1, dp=8), cost(DEEPSEEK_V3, tp=8)
    assert dp8.attn_bytes == 61 * DSV3_ATTN * 2  # all of them on each GPU
    assert tp8.attn_bytes == 61 * DSV3_ATTN * 2 / 8
    other = (DSV3_DENSE - 61 * DSV3_ATTN) * 2 / 8  # the rest is split over all 8 GPUs
    assert dp8.dense_bytes == pytest.approx(other, rel=1e-12)
    assert tp8.dense_bytes == pytest.approx(other, rel=1e-12)


def test_the_busiest_dp_group_holds_a_whole_chunk() -> None:
    c = cost(dp=8)
    assert c.prefill_share(prefill(4096)) == 1.0  # one prompt: one group
    assert c.prefill_share(prefill(1000, cached=3000)) == 1.0
    four = StepShape(prefill_tokens=4096, prefill_attn_pairs=4 * chunk_attn_pairs(0, 1024))
    assert c.prefill_share(four) == pytest.approx(1024 / 4096, rel=1e-12)
    many = StepShape(prefill_tokens=4096, prefill_attn_pairs=64 * chunk_attn_pairs(0, 64))
    assert c.prefill_share(many) == 1 / 8  # 64 chunks of 64: at least an eighth
    assert cost().prefill_share(four) == 1.0  # one group holds everything


def test_one_prompt_runs_on_one_dp_group() -> None:
    # Llama 8B on 2 GPUs of DP attention: the prompt's projections, attention and hidden-state
    # traffic on one GPU; the MLPs and LM head split over both
    n = 4096
    pairs = n * (n + 1) / 2
    other = L8_ACTIVE - 32 * L8_ATTN
    gemm = max(
        (n * 2 * 32 * L8_ATTN + n * 2 * other / 2) / GEMM,
        (32 * L8_ATTN * 2 + other * 2 / 2) / HBM,
    )
    expected = (
        FIXED_8B
        + gemm
        + n * 32 * (L8_STREAM + L8_ACT / 2) / HBM
        + max(pairs * 32 * L8_PAIR / ATTN, pairs / 128 * 32 * L8_KV / HBM)
    )
    assert cost(dp=2).step_time(prefill(n)) == pytest.approx(expected, rel=1e-12)


def test_decodes_spread_over_the_dp_groups() -> None:
    # 16 decodes of 2,000 cached tokens on 2 DP groups: 8 on each GPU, memory-bound
    seqs, ctx = 16, 16 * 2000
    other = L8_ACTIVE - 32 * L8_ATTN
    expected = (
        FIXED_8B
        + (32 * L8_ATTN * 2 + other * 2 / 2) / HBM
        + 32 * (8 * L8_STREAM + 16 * L8_ACT / 2) / HBM
        + max(ctx / 2 * 32 * L8_PAIR / ATTN, ctx / 2 * 32 * L8_KV / HBM)
    )
    shape = StepShape(decode_seqs=seqs, decode_context=ctx)
    assert cost(dp=2).step_time(shape) == pytest.approx(expected, rel=1e-12)


# ---- the draft module of speculative decoding ---------------------------------------------
def test_each_draft_token_costs_one_layer_and_the_lm_head() -> None:
    seqs, ctx = 8, 8 * 2000
    shape = StepShape(decode_seqs=seqs, decode_context=ctx)
    layer = L8_ATTN + L8_MLP + L8_HEAD  # memory-bound at 8 tokens
    draft = (
        15e-6  # one layer's launch gaps; the step's own overhead is paid once
        + layer * 2 / HBM
        + seqs * (L8_STREAM + L8_ACT) / HBM
        + max(ctx * L8_PAIR / ATTN, ctx * L8_KV / HBM)
    )
    for d in (1, 2):
        tokens = seqs * (1 + d)  # the target verifies d drafts and the next token
        target = (
            FIXED_8B
            + L8_ACTIVE * 2 / HBM
            + tokens * 32 * (L8_STREAM + L8_ACT) / HBM
            + max((1 + d) * ctx * 32 * L8_PAIR / ATTN, ctx * 32 * L8_KV / HBM)
        )
        assert cost(draft=d).step_time(shape) == pytest.approx(target + d * draft, rel=1e-12)


def test_deepseeks_draft_module_is_one_moe_layer() -> None:
    c = cost(DEEPSEEK_V3, tp=8, draft=1)
    assert c.draft is not None
    assert (c.draft.model.layers, c.draft.model.moe_layers) == (1, 1)


@pytest.mark.parametrize(("model", "tp", "dp"), [(LLAMA_31_8B, 1, 2), (DEEPSEEK_V3, 1, 8)])
def test_decode_line_equals_step_time_with_dp_and_drafts(
    model: ModelSpec, tp: int, dp: int
) -> None:
    c = cost(model, tp=tp, dp=dp, draft=1)
    a, b = c.decode_line(32)
    for ctx in (0.0, 1e4, 3e5):
        shape = StepShape(decode_seqs=32, decode_context=ctx)
        assert c.step_time(shape) == pytest.approx(a + b * ctx, rel=1e-12)


# ---- the context limit -------------------------------------------------------------------
def test_a_request_longer_than_the_context_is_refused(tmp_path: Path) -> None:
    trace = tmp_path / "t.jsonl"
    trace.write_text(
        '{"timestamp": 0, "input_length": 100, "output_length": 5}\n'
        '{"timestamp": 250, "input_length": 131000, "output_length": 100}\n'
    )
    cfg = WorkloadConfig(trace=str(trace))
    with pytest.raises(ConfigError) as err:
        generate(cfg, 0, max_context=131072, model="llama-3.1-8b")
    assert str(err.value) == (
        f"workload.trace={str(trace)!r}: request 1 (1 of 2 too long): 131,000 prompt + 100 "
        "output = 131,100 tokens exceed llama-3.1-8b's context of 131,072 tokens"
    )
    assert len(generate(cfg, 0, max_context=131100)) == 2  # exactly the context: fits
    unbounded = WorkloadConfig(
        num_requests=50,
        prompt_tokens=LengthDist(dist="lognormal", mean=30000, sigma=0.5),
        output_tokens=LengthDist(dist="fixed", value=10),
    )
    with pytest.raises(ConfigError, match=r"^workload: request \d+ \(\d+ of 50 too long\)"):
        generate(unbounded, 0, max_context=32768, model="tiny-gqa")

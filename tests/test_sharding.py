"""Shard layouts and transfer plans: every destination byte is written once, from the right source.

The property tests fill each prefill rank's pages with byte identities (the layer, K/V plane,
global head, request token and dim of the element, and the byte inside it), run the planned
writes on numpy arrays, and compare every decode rank's bytes with the identities its own layout
must hold there.
"""

from __future__ import annotations

import doctest
import random
import re
from collections import Counter
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from disagg.core.kvcache import PageLayout
from disagg.core.sharding import (
    PlannedWrite,
    ShardLayout,
    TransferPlan,
    metadata_bytes,
    parse_shard_layout,
    plan_transfer,
    shard_layout,
)
from disagg.errors import ConfigError
from disagg.models import DEEPSEEK_V3, LLAMA_31_8B, QWEN3_CODER_480B, get_model

GQA_KV8 = replace(LLAMA_31_8B, name="gqa-kv8", kv_heads=8, head_dim=4)
GQA_KV2 = replace(LLAMA_31_8B, name="gqa-kv2", kv_heads=2, head_dim=4)  # heads replicated on TP>2
MLA = replace(DEEPSEEK_V3, name="mla-small", kv_lora_rank=8, qk_rope_dim=4)
SMALL_MODELS = [GQA_KV8, GQA_KV2, MLA]
TPS = [1, 2, 4, 8]
SIDES = [(1, 1), (2, 1), (4, 1), (8, 1), (1, 2), (1, 4), (2, 2)]  # (tp, dp)
AXES = {"NHD": ("kv", "token", "head", "dim"), "HND": ("kv", "head", "token", "dim")}
R1 = get_model("deepseek-r1")


# ---- the byte-level simulator ----------------------------------------------------------------
def page_identities(page: PageLayout, heads: range, first_token: int, layer: int) -> np.ndarray:
    """Identity of every byte of one page of one layer on a rank holding `heads`."""
    axes = ("token", "dim") if page.mla else AXES[page.layout]
    values = {
        "kv": np.arange(page.kv_planes),
        "head": np.asarray(heads),
        "token": first_token + np.arange(page.page_size),
        "dim": np.arange(page.head_dim),
    }
    grid = dict(zip(axes, np.meshgrid(*(values[a] for a in axes), indexing="ij"), strict=True))
    kv, head = grid.get("kv", 0), grid.get("head", 0)
    code = (((layer * 2 + kv) * 64 + head) * 4096 + grid["token"]) * 1024 + grid["dim"]
    assert code.shape == page.shape
    eb = page.elem_bytes
    return (code.reshape(-1, 1) * eb + np.arange(eb)).ravel()


def fill(
    shard: ShardLayout, page: PageLayout, group: int, pages: list[int], pool: int, layers: int
):
    """Per-rank buffers (all layers, `pool` pages each); the request's pages hold identities."""
    bufs = {r: np.full(layers * pool * page.page_bytes, -1, np.int64) for r in range(shard.ranks)}
    for r in shard.group(group):
        for layer in range(layers):
            for i, p in enumerate(pages):
                at = (layer * pool + p) * page.page_bytes
                ids = page_identities(page, shard.heads_of(r), i * page.page_size, layer)
                bufs[r][at : at + page.page_bytes] = ids
    return bufs


def post(plan: TransferPlan, pairs: list[tuple[int, int]], pool: int, layers: int, chunks: int):
    """Writes of every layer, the pages handed to `writes` in `chunks` slices (like a prefill)."""
    cuts = sorted(random.Random(chunks).sample(range(1, len(pairs) + 1), chunks - 1))
    slices = [pairs[a:b] for a, b in zip([0, *cuts], [*cuts, len(pairs)], strict=True)]
    out: list[tuple[int, PlannedWrite]] = []
    for layer in range(layers):
        for part in slices:
            sb, db = layer * pool * plan.src_page_bytes, layer * pool * plan.dst_page_bytes
            out += [(layer, w) for w in plan.writes(part, sb, db)]
    return out


def check_immediates(plan: TransferPlan, posted: list[tuple[int, PlannedWrite]], pages: int):
    """The last write of each (src, dst, page, layer) unit, and only it, carries an immediate."""
    units: dict[tuple[int, ...], list[bool]] = {}
    for layer, w in posted:
        page = (w.dst_offset // plan.dst_page_bytes, w.src_offset // plan.src_page_bytes)
        units.setdefault((w.src_rank, w.dst_rank, layer, *page), []).append(w.imm)
    assert all(flags == [False] * (len(flags) - 1) + [True] for flags in units.values())
    received = Counter(w.dst_rank for _, w in posted if w.imm)
    layers = 1 + max(layer for layer, _ in posted)
    expected = plan.expected_immediates(pages, layers)
    assert {d: n for d, n in expected.items() if n} == dict(received)


def run_case(src, dst, src_layout, dst_layout, kv_dtype, page_size, pages, seed):
    """Plan, post and check one transfer of `pages` = (src ids, dst ids, pool size)."""
    src_ids, dst_ids, pool = pages
    plan = plan_transfer(src, dst, page_size, src_layout, kv_dtype, seed, dst_layout=dst_layout)
    layers = 2
    srcbuf = fill(src, plan.src_page, plan.src_dp_rank, src_ids, pool, layers)
    want = fill(dst, plan.dst_page, plan.dst_dp_rank, dst_ids, pool, layers)
    got = {r: np.full_like(b, -1) for r, b in want.items()}
    count = {r: np.zeros_like(b) for r, b in want.items()}
    chunks = 1 + seed % len(src_ids)  # how the prefill happened to hand pages over
    posted = post(plan, list(zip(src_ids, dst_ids, strict=True)), pool, layers, chunks)
    for _, w in posted:
        assert w.src_offset + w.nbytes <= srcbuf[w.src_rank].size
        assert w.dst_offset + w.nbytes <= got[w.dst_rank].size
        got[w.dst_rank][w.dst_offset : w.dst_offset + w.nbytes] = srcbuf[w.src_rank][
            w.src_offset : w.src_offset + w.nbytes
        ]
        count[w.dst_rank][w.dst_offset : w.dst_offset + w.nbytes] += 1
    for r in want:
        np.testing.assert_array_equal(count[r], (want[r] >= 0).astype(np.int64))
        np.testing.assert_array_equal(got[r], want[r])
    check_immediates(plan, posted, len(src_ids))
    return plan


@st.composite
def request_pages(draw: st.DrawFn) -> tuple[list[int], list[int], int]:
    """(prefill page ids, decode page ids, pool size): a request's pages in random pool slots."""
    n = draw(st.integers(1, 3))
    pool = n + draw(st.integers(0, 3))
    src = draw(st.permutations(range(pool)))[:n]
    dst = draw(st.permutations(range(pool)))[:n]
    return list(src), list(dst), pool


# ---- property tests --------------------------------------------------------------------------
@pytest.mark.parametrize("model", SMALL_MODELS, ids=lambda m: m.name)
@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("src_tp", TPS)
@pytest.mark.parametrize("dst_tp", TPS)
@settings(max_examples=15, deadline=None)
@given(pages=request_pages(), page_size=st.integers(1, 4), seed=st.integers(0, 2**16))
def test_every_decode_byte_written_once_from_the_right_source_for_all_tp_pairs(
    model, layout, src_tp, dst_tp, pages, page_size, seed
):
    src, dst = shard_layout(model, src_tp), shard_layout(model, dst_tp)
    plan = run_case(src, dst, layout, layout, "bf16", page_size, pages, seed)
    assert sum(plan.bytes_by_src_rank().values()) == dst_tp * plan.dst_page_bytes
    if dst.replication >= src.replication:  # at least as many decode as prefill replica sets
        assert set(plan.ops_by_src_rank()) == set(range(src_tp))


@settings(max_examples=300, deadline=None)
@given(
    model=st.sampled_from(SMALL_MODELS),
    src=st.sampled_from(SIDES),
    dst=st.sampled_from(SIDES),
    layouts=st.tuples(st.sampled_from(["NHD", "HND"]), st.sampled_from(["NHD", "HND"])),
    kv_dtype=st.sampled_from(["fp8", "bf16", "fp32"]),
    pages=request_pages(),
    page_size=st.integers(1, 4),
    seed=st.integers(0, 2**16),
)
def test_every_decode_byte_written_once_with_dp_mixed_layouts_and_dtypes(
    model, src, dst, layouts, kv_dtype, pages, page_size, seed
):
    src_shard, dst_shard = shard_layout(model, *src), shard_layout(model, *dst)
    run_case(src_shard, dst_shard, *layouts, kv_dtype, page_size, pages, seed)


# ---- shard layouts and page layouts ----------------------------------------------------------
def test_tp_splits_kv_heads_into_contiguous_ranges():
    qwen = shard_layout(QWEN3_CODER_480B, 4)
    assert [qwen.heads_of(r) for r in range(4)] == [range(2 * r, 2 * r + 2) for r in range(4)]
    assert qwen.replica_sets() == ((0, 1, 2, 3),)


def test_tp_above_kv_heads_replicates_each_head_on_consecutive_ranks():
    tp16 = shard_layout(LLAMA_31_8B, 16)  # 8 KV heads: each on 2 ranks
    assert [tp16.heads_of(r).start for r in range(16)] == [r // 2 for r in range(16)]
    assert tp16.replica_sets() == (tuple(range(0, 16, 2)), tuple(range(1, 16, 2)))


def test_mla_latent_is_replicated_on_every_rank():
    tp8 = shard_layout(R1, 8)
    assert all(tp8.heads_of(r) == range(1) for r in range(8))
    assert tp8.replica_sets() == tuple((r,) for r in range(8))


def test_dp_groups_hold_whole_caches():
    dp8 = shard_layout(R1, 1, 8)
    assert (str(dp8), dp8.ranks, dp8.group(3)) == ("DP8", 8, range(3, 4))
    assert dp8.replica_sets(3) == ((3,),)
    qwen = shard_layout(QWEN3_CODER_480B, 4, 2)  # two groups of TP4
    assert (str(qwen), qwen.heads_of(5)) == ("DP2xTP4", range(2, 4))
    assert qwen.replica_sets(1) == ((4, 5, 6, 7),)


@pytest.mark.parametrize("label", ["TP8", "DP8", "DP2xTP4", "TP1"])
def test_shard_labels_round_trip(label):
    assert str(parse_shard_layout(QWEN3_CODER_480B, label)) == label


def test_rank_page_layouts():
    qwen = shard_layout(QWEN3_CODER_480B, 4).page_layout(16, "HND", "bf16")
    assert qwen == PageLayout(16, 2, 128, 2, "HND")
    assert qwen.page_bytes == 2 * 16 * 2 * 128 * 2  # K,V x tokens x 2 heads x dim x bf16
    r1 = shard_layout(R1, 8).page_layout(64, "NHD", "fp8")
    assert (r1.mla, r1.heads, r1.head_dim, r1.page_bytes) == (True, 1, 576, 64 * 576)


@pytest.mark.parametrize("model", [GQA_KV8, MLA], ids=lambda m: m.name)
@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("tp", TPS)
def test_identical_sharding_moves_whole_pages_one_write_per_rank_pair(model, layout, tp):
    plan = plan_transfer(shard_layout(model, tp), shard_layout(model, tp), 16, layout, rng=tp)
    assert plan.ops_per_page_layer == len(plan.pairs) == tp
    assert {s.nbytes for s in plan.segments} == {plan.src_page_bytes}


# ---- the article's deployments, counted by hand ----------------------------------------------
# Page size 16, bf16. Qwen3-Coder: 8 KV heads of 128; on TP8 a rank's page is [2, 16, 1, 128]
# (8192 bytes), on TP4 [2, 16, 2, 128] or [2, 2, 16, 128] (16384 bytes). R1: a 576-wide latent,
# 16 * 576 * 2 = 18432 bytes per page on every rank.
QWEN = QWEN3_CODER_480B


def each(ranks: int, n: int) -> dict[int, int]:
    return dict.fromkeys(range(ranks), n)


ARTICLE_CASES = [
    # model, prefill (tp, dp), decode (tp, dp), layout, writes, {src: writes}, {dst: immediates}
    # R1 TP8 -> TP8: 8 singleton replica sets each side, a random one-to-one pairing, 1 write each.
    (R1, (8, 1), (8, 1), "HND", 8, each(8, 1), each(8, 1)),
    # R1 DP8 -> DP8 (groups 2 -> 5): the whole page from one rank to one rank.
    (R1, (1, 8), (1, 8), "HND", 1, {2: 1}, {5: 1}),
    # R1 TP8 -> DP8: the decode rank takes its latent from one prefill replica (rank 6 at seed 0).
    (R1, (8, 1), (1, 8), "HND", 1, {6: 1}, {5: 1}),
    # R1 DP8 -> TP8: the one prefill rank holding the request feeds all 8 decode replicas.
    (R1, (1, 8), (8, 1), "HND", 8, {2: 8}, each(8, 1)),
    # Qwen TP8 -> TP8: one head per rank, the page is whole on both sides: 1 write per rank pair.
    (QWEN, (8, 1), (8, 1), "HND", 8, each(8, 1), each(8, 1)),
    (QWEN, (8, 1), (8, 1), "NHD", 8, each(8, 1), each(8, 1)),
    # TP8 -> TP4 HND: decode rank d rebuilds [K: h0 h1 | V: h0 h1] from prefill ranks 2d, 2d+1;
    # each sends its K run and V run: 2 writes x 8 prefill ranks = 16; 2 immediates per decode rank.
    (QWEN, (8, 1), (4, 1), "HND", 16, each(8, 2), each(4, 2)),
    # TP8 -> TP4 NHD: a prefill head lands in every other head slot of each token row of K and V:
    # 2 x 16 runs per rank pair x 8 pairs = 256 writes.
    (QWEN, (8, 1), (4, 1), "NHD", 256, each(8, 32), each(4, 2)),
    # TP4 -> TP8 HND: prefill rank s sends head 2s to decode 2s and head 2s+1 to decode 2s+1, one
    # K run and one V run each: 4 writes per prefill rank, 16 in all, 1 immediate per decode rank.
    (QWEN, (4, 1), (8, 1), "HND", 16, each(4, 4), each(8, 1)),
    # TP4 -> TP8 NHD: a decode rank's head is one 256-byte row per token of K and V: 32 runs
    # from one prefill rank; 8 decode ranks x 32 = 256, 64 per prefill rank.
    (QWEN, (4, 1), (8, 1), "NHD", 256, each(4, 64), each(8, 1)),
]


@pytest.mark.parametrize("case", ARTICLE_CASES, ids=lambda c: f"{c[0].name}-{c[1]}-{c[2]}-{c[3]}")
def test_article_cases_match_hand_counts(case):
    model, src, dst, layout, ops, by_src, imms = case
    plan = plan_transfer(
        shard_layout(model, *src),
        shard_layout(model, *dst),
        16,
        layout,
        rng=0,
        src_dp_rank=2 if src[1] > 1 else None,
        dst_dp_rank=5 if dst[1] > 1 else None,
    )
    assert plan.ops_per_page_layer == ops
    assert plan.ops_by_src_rank() == by_src
    assert plan.imms_per_page_layer_by_dst_rank() == imms
    assert set(plan.bytes_by_src_rank().values()) == {
        plan.dst_page_bytes * len(imms) // len(by_src)
    }


def test_r1_request_immediates_include_the_metadata_at_the_decode_leader():
    plan = plan_transfer(shard_layout(R1, 8), shard_layout(R1, 8), 64)
    # 1000 prompt tokens, the last left to the decoder: 999 tokens -> 16 pages x 61 layers.
    expected = plan.expected_immediates(16, 61, metadata=True)
    assert expected == {0: 16 * 61 + 1, **{d: 16 * 61 for d in range(1, 8)}}


def test_dp_decode_counts_only_on_the_chosen_rank():
    plan = plan_transfer(shard_layout(R1, 1, 8), shard_layout(R1, 1, 8), 64, rng=1, dst_dp_rank=6)
    assert plan.expected_immediates(3, 61, metadata=True) == {6: 3 * 61 + 1}
    assert plan.metadata("hidden").dst_rank == 6


# ---- replication: random, seeded, all devices busy -------------------------------------------
def test_same_seed_same_plan_and_seeds_spread_the_pairing():
    tp8 = shard_layout(R1, 8)
    plans = [plan_transfer(tp8, tp8, 16, rng=seed) for seed in range(10)]
    assert plans[3] == plan_transfer(tp8, tp8, 16, rng=random.Random(3))
    assert len({p.pairs for p in plans}) > 1
    assert all(set(p.ops_by_src_rank()) == set(range(8)) for p in plans)
    assert {tuple(p.imms_per_page_layer_by_dst_rank().values()) for p in plans} == {(1,) * 8}


def test_tp8_to_dp8_takes_the_full_latent_from_a_random_prefill_replica():
    plans = [
        plan_transfer(shard_layout(R1, 8), shard_layout(R1, 1, 8), 64, rng=s, dst_dp_rank=0)
        for s in range(20)
    ]
    assert {len(p.segments) for p in plans} == {1}
    assert {p.segments[0].nbytes for p in plans} == {64 * 576 * 2}
    assert len({p.segments[0].src_rank for p in plans}) > 3


def test_replicated_gqa_heads_keep_every_prefill_rank_sending():
    tp8 = shard_layout(GQA_KV2, 8)  # 2 KV heads on 8 ranks: 4 replica sets of 2 ranks
    plan = plan_transfer(tp8, tp8, 4, "NHD", rng=7)
    assert plan.ops_by_src_rank() == dict.fromkeys(range(8), 1)


# ---- metadata --------------------------------------------------------------------------------
def test_metadata_is_one_write_from_leader_to_leader():
    assert metadata_bytes(QWEN3_CODER_480B, "hidden") == 6144 * 2
    assert metadata_bytes(QWEN3_CODER_480B, "logits") == 151936 * 4
    dp2xtp4, tp8 = shard_layout(QWEN3_CODER_480B, 4, 2), shard_layout(QWEN3_CODER_480B, 8)
    meta = plan_transfer(dp2xtp4, tp8, 16, src_dp_rank=1).metadata("logits")  # group 1: ranks 4-7
    assert (meta.src_rank, meta.dst_rank, meta.nbytes) == (4, 0, 151936 * 4)
    assert meta.write(100, 200) == PlannedWrite(4, 0, 100, 200, 151936 * 4, True)


# ---- bad input -------------------------------------------------------------------------------
def test_tp_that_does_not_divide_the_heads_is_refused():
    with pytest.raises(ConfigError, match=r"TP5: tp=5 does not divide .*96 query heads"):
        shard_layout(QWEN3_CODER_480B, 5)
    with pytest.raises(ConfigError, match=r"TP12: .*8 KV heads"):
        shard_layout(QWEN3_CODER_480B, 12)
    with pytest.raises(ConfigError, match="dp=0"):
        shard_layout(QWEN3_CODER_480B, 8, 0)
    with pytest.raises(ConfigError, match="'TP4xDP2' is not TP<n>, DP<n> or DP<n>xTP<n>"):
        parse_shard_layout(QWEN3_CODER_480B, "TP4xDP2")


def test_mismatched_sides_are_refused_naming_both():
    tp8, tp4 = shard_layout(QWEN3_CODER_480B, 8), shard_layout(QWEN3_CODER_480B, 4)
    with pytest.raises(ConfigError, match=r"prefill TP8 page_size=16 and decode TP4 page_size=32"):
        plan_transfer(tp8, tp4, 16, dst_page_size=32)
    with pytest.raises(ConfigError, match=r"prefill TP8 runs qwen.* but decode TP8 runs deepseek"):
        plan_transfer(tp8, shard_layout(R1, 8), 16)
    with pytest.raises(ConfigError, match=r"decode DP8: dp rank 8 out of range 0..7"):
        plan_transfer(tp8, shard_layout(QWEN3_CODER_480B, 1, 8), 16, dst_dp_rank=8)
    with pytest.raises(ConfigError, match="unknown metadata kind"):
        metadata_bytes(R1, "tokens")  # type: ignore[arg-type]


# ---- the docs table is what the planner computes ---------------------------------------------
DOC = Path(__file__).parents[1] / "docs" / "sharding.md"


def test_docs_examples_print_what_the_planner_returns():
    result = doctest.testfile(str(DOC), module_relative=False)
    assert (result.attempted, result.failed) == (7, 0)


def test_docs_op_count_table_matches_the_planner():
    doc = DOC.read_text()
    rows = re.findall(
        r"^\| (\S+) \| (\w+) → (\w+) \| (\w+) \| (\d+) \| (\d+) \| (\d+) \|", doc, re.M
    )
    assert len(rows) >= 9
    for name, src, dst, layout, ops, senders, imms in rows:
        model = get_model(name)
        layout = "NHD" if layout == "NHD" else "HND"  # "any": MLA pages have no head dimension
        plan = plan_transfer(
            parse_shard_layout(model, src), parse_shard_layout(model, dst), 16, layout
        )
        got = (plan.ops_per_page_layer, len(plan.ops_by_src_rank()))
        assert got == (int(ops), int(senders))
        assert set(plan.imms_per_page_layer_by_dst_rank().values()) == {int(imms)}

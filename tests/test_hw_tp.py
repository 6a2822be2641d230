"""Tensor parallelism in the hw model: two real rank processes over gloo compute the TP1 model's
logits, each rank caches exactly the slice the transfer planner assigns it, and a group that
cannot split the model is a ConfigError naming what does not divide."""

from __future__ import annotations

import multiprocessing as mp
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import pytest

pytest.importorskip("torch", reason="the hw backend needs torch: pip install -e '.[hw]'")

import torch
import torch.distributed

from disagg.core.kvcache import Layout
from disagg.core.sharding import plan_transfer, shard_layout
from disagg.errors import ConfigError
from disagg.hw.batch import Seq
from disagg.hw.cache import KVCache
from disagg.hw.model import Transformer
from disagg.hw.specs import tiny_gqa, tiny_mla, tiny_mla_moe, tiny_moe
from disagg.hw.tp import TensorParallel, join
from disagg.models import ModelSpec

SEED, PAGES, PAGE_SIZE, TP = 5, 12, 4, 2
PROMPTS = ([3, 14, 15, 92, 65, 35, 89, 79, 32, 38, 46], [26, 43, 38, 32, 79, 50])
PAGE_IDS = ((5, 2, 9), (0, 7))  # 12 and 8 token slots: room for one decode token each
NEXT = (7, 200)  # the decode step's tokens

KV1 = replace(tiny_gqa(), name="tiny-gqa-kv1", kv_heads=1)  # one KV head: replicated at tp 2
# case -> (model, page layout, expert parallelism)
CASES: dict[str, tuple[ModelSpec, Layout, bool]] = {
    "gqa-HND": (tiny_gqa(), "HND", False),
    "gqa-NHD": (tiny_gqa(), "NHD", False),
    "gqa-kv1": (KV1, "HND", False),
    "mla": (tiny_mla(), "HND", False),
    "moe": (tiny_moe(), "NHD", False),
    "moe-ep": (tiny_moe(), "HND", True),
    "mla-moe": (tiny_mla_moe(), "HND", False),
    "mla-moe-ep": (tiny_mla_moe(), "HND", True),
}


def steps(model: Transformer, layout: Layout) -> tuple[torch.Tensor, torch.Tensor, KVCache]:
    """(prefill logits, decode logits, cache) of a two-request prefill and one decode step."""
    cache = model.new_cache(PAGES, PAGE_SIZE, layout)
    prefill = [Seq.of(p, 0, pages) for p, pages in zip(PROMPTS, PAGE_IDS, strict=True)]
    first = model.forward(prefill, cache).logits
    decode = [
        Seq.of([t], len(p), pages) for t, p, pages in zip(NEXT, PROMPTS, PAGE_IDS, strict=True)
    ]
    return first, model.forward(decode, cache).logits, cache


def rank_main(rank: int, init_file: str, out_dir: str) -> None:
    """One rank: join the gloo group, run every case, save its logits and cache pages."""
    tp = join(rank, TP, init_file, timeout_s=60)
    for name, (spec, layout, ep) in CASES.items():
        model = Transformer(spec, seed=SEED, tp=replace(tp, expert_parallel=ep))
        first, second, cache = steps(model, layout)
        pages = [cache.layer_bytes(i).clone() for i in range(spec.layers)]
        torch.save((first, second, pages), Path(out_dir) / f"{name}.{rank}.pt")
    torch.distributed.destroy_process_group()


def spawn_ranks(
    target: Callable[[int, str, str], None], n: int, out: Path, timeout_s: float
) -> None:
    """Run `target(rank, store file, out)` in `n` spawned processes; fail naming the ranks that
    did not finish within `timeout_s` (killed), or unless every one exited 0."""
    ctx = mp.get_context("spawn")
    ranks = [ctx.Process(target=target, args=(r, str(out / "store"), str(out))) for r in range(n)]
    for p in ranks:
        p.start()
    for p in ranks:
        p.join(timeout=timeout_s)
    hung = [r for r, p in enumerate(ranks) if p.is_alive()]
    for p in ranks:
        if p.is_alive():
            p.kill()
            p.join()
    assert not hung, f"ranks {hung} did not finish within {timeout_s:g} s"
    assert [p.exitcode for p in ranks] == [0] * n


@pytest.fixture(scope="module")
def tp2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A directory of every case's results from a TP2 group of two spawned processes."""
    out = tmp_path_factory.mktemp("tp2")
    spawn_ranks(rank_main, 2, out, timeout_s=120)
    return out


@pytest.mark.parametrize("case", list(CASES))
def test_tp2_logits_equal_tp1(tp2: Path, case: str) -> None:
    spec, layout, _ = CASES[case]
    want_first, want_second, _ = steps(Transformer(spec, seed=SEED), layout)
    for rank in range(TP):
        first, second, _ = torch.load(tp2 / f"{case}.{rank}.pt")
        assert first.shape == (2, spec.vocab)
        torch.testing.assert_close(first, want_first, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(second, want_second, atol=1e-5, rtol=1e-5)
    # the residual stream is replicated: every rank returns the same logits, bit for bit
    ranks = [torch.load(tp2 / f"{case}.{rank}.pt")[:2] for rank in range(TP)]
    assert all(torch.equal(a, b) for a, b in zip(*ranks, strict=True))


@pytest.mark.parametrize("case", list(CASES))
def test_each_rank_caches_the_slice_the_planner_assigns(tp2: Path, case: str) -> None:
    """Moving the TP1 cache to a TP2 group by the planner's writes gives each rank's pages."""
    spec, layout, _ = CASES[case]
    _, _, cache = steps(Transformer(spec, seed=SEED), layout)
    plan = plan_transfer(
        shard_layout(spec, 1), shard_layout(spec, TP), PAGE_SIZE, layout, kv_dtype="fp32"
    )
    writes = plan.writes([(p, p) for p in range(PAGES)])
    for layer in range(spec.layers):
        src = cache.layer_bytes(layer)
        want = [torch.zeros(PAGES * plan.dst_page_bytes, dtype=torch.uint8) for _ in range(TP)]
        for w in writes:
            want[w.dst_rank][w.dst_offset : w.dst_offset + w.nbytes] = src[
                w.src_offset : w.src_offset + w.nbytes
            ]
        for rank in range(TP):
            got = torch.load(tp2 / f"{case}.{rank}.pt")[2][layer]
            assert got.abs().sum() > 0  # the prompt's pages were written
            # bytes compared as float32 values: past layer 0 the residual stream carries the
            # all-reduce's rounding
            torch.testing.assert_close(
                got.view(torch.float32), want[rank].view(torch.float32), atol=1e-5, rtol=1e-5
            )


def test_a_rank_keeps_its_heads_cut_from_the_full_weights() -> None:
    """tiny-gqa-kv1 at tp 2, rank 1: query heads 2 and 3, the single KV head replicated."""
    full = Transformer(KV1, seed=SEED)
    mine = Transformer(KV1, seed=SEED, tp=TensorParallel(1, 2))  # no collective: no group
    d = KV1.head_dim
    wqkv = full.layers[0]["wqkv"]  # rows: 4 query heads, K head 0, V head 0
    torch.testing.assert_close(
        mine.layers[0]["wqkv"], torch.cat([wqkv[2 * d : 4 * d], wqkv[4 * d :]])
    )
    torch.testing.assert_close(mine.layers[0]["wo"], full.layers[0]["wo"][:, 2 * d :])
    inter = KV1.intermediate
    gate_up = full.layers[0]["w_gate_up"]
    torch.testing.assert_close(
        mine.layers[0]["w_gate_up"],
        torch.cat([gate_up[inter // 2 : inter], gate_up[inter + inter // 2 :]]),
    )
    torch.testing.assert_close(mine.lm_head, full.lm_head[KV1.vocab // 2 :])
    torch.testing.assert_close(mine.embed, full.embed)
    assert mine.new_cache(3, 4).layers[0].shape == (4, 2, 1, 4, d)  # 3 pages + scratch


def test_mla_ranks_keep_the_whole_latent_and_half_the_heads() -> None:
    full = Transformer(tiny_mla(), seed=SEED)
    mine = Transformer(tiny_mla(), seed=SEED, tp=TensorParallel(0, 2))
    for name in ("w_dkv", "w_dq", "kv_norm"):
        torch.testing.assert_close(mine.layers[1][name], full.layers[1][name])
    torch.testing.assert_close(mine.layers[1]["w_uk"], full.layers[1]["w_uk"][:2])
    assert mine.new_cache(3, 4).layers[0].shape == full.new_cache(3, 4).layers[0].shape


@pytest.mark.parametrize("spec", [tiny_gqa(), tiny_mla_moe()], ids=["gqa", "mla-moe"])
@pytest.mark.parametrize("ep", [False, True], ids=["tp", "ep"])
def test_weight_bytes_count_what_a_rank_allocates(spec: ModelSpec, ep: bool) -> None:
    m = Transformer(spec, seed=0, tp=TensorParallel(1, 2, expert_parallel=ep))
    dense = [w for layer in m.layers for n, w in layer.items() if n[0] == "w"]
    experts = [
        t for moe in m.moes.values() for t in (moe.router, moe.w13, moe.w2, *(moe.shared or ()))
    ]
    tensors = [m.embed, m.lm_head, *dense, *experts]
    assert m.weight_bytes() == sum(t.numel() * 4 for t in tensors)
    assert m.weight_bytes() < Transformer(spec, seed=0).weight_bytes()


@pytest.mark.parametrize(
    ("spec", "tp", "ep", "match"),
    [
        (tiny_gqa(), 3, False, "does not divide tiny-gqa's 4 query heads"),
        (replace(tiny_gqa(), heads=6, kv_heads=3), 2, False, "3 KV heads: one must divide"),
        (replace(tiny_gqa(), heads=12, kv_heads=3), 4, False, "3 KV heads: one must divide"),
        (replace(tiny_gqa(), intermediate=129), 2, False, r"MLP width \(intermediate\) \(129\)"),
        (replace(tiny_moe(), moe_intermediate=33), 2, False, r"\(moe_intermediate\) \(33\)"),
        (replace(tiny_moe(), experts=9), 2, True, r"routed experts \(expert parallelism\) \(9\)"),
        (replace(tiny_gqa(), vocab=255), 2, False, "tiny-gqa's vocab"),
    ],
)
def test_a_tp_that_cannot_split_the_model_is_a_config_error(
    spec: ModelSpec, tp: int, ep: bool, match: str
) -> None:
    with pytest.raises(ConfigError, match=match):
        Transformer(spec, tp=TensorParallel(0, tp, expert_parallel=ep))


def test_a_rank_outside_the_group_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match=r"tp rank=2 outside 0\.\.1"):
        TensorParallel(2, 2)


def test_a_rank_whose_group_never_forms_times_out_naming_it(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"tp rank 1 of 2 could not join .* within 1 s"):
        join(1, 2, str(tmp_path / "store"), timeout_s=1)
    assert not torch.distributed.is_initialized()

"""DP attention in the hw backend for MLA models: a node of `dp` attention groups, each holding
whole requests in its own latent cache, the MLP and experts cut over all the node's ranks.

Two levels, CPU, float32, gloo, tiny models (what CI runs):
- the model: two (or four) real rank processes give the TP1 model's logits, and each rank's
  cache holds its group's requests' latent pages, as TP1's cache holds them, and nothing else;
- the nodes (tcp wire): MLA prefill TP2 -> decode DP2 (tiny-mla, tiny-mla-moe), prefill DP2 ->
  decode DP2xTP2 and a colocated DP2 node give the colocated TP1 run's tokens, and its logits to
  float32 rounding (at most seven processes at once: the driver, two and four ranks).
"""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("torch", reason="the hw backend needs torch: pip install -e '.[hw]'")
pytest.importorskip("zmq")

import torch
import torch.distributed as dist
from test_hw_tp import spawn_ranks
from test_hw_tp_nodes import assert_same_outputs, colocated_tp1, run, with_tp

from disagg.config import build_experiment
from disagg.core import messenger as m
from disagg.hw.batch import Seq
from disagg.hw.cache import KVCache
from disagg.hw.model import Transformer
from disagg.hw.node import dp_rank, transfer_plan
from disagg.hw.prefill import PrefillServer
from disagg.hw.protocol import NodeConfig, unpack_imm
from disagg.hw.specs import tiny_mla, tiny_mla_moe
from disagg.hw.tp import TensorParallel, join
from disagg.models import ModelSpec

SEED, PAGES, PAGE_SIZE = 5, 12, 4
PROMPTS = ([3, 14, 15, 92, 65, 35, 89, 79, 32, 38, 46], [26, 43, 38, 32, 79, 50], [7, 1, 8, 2])
PAGE_IDS = ((5, 2, 9, 1), (0, 7), (3, 11))  # room for the decode steps
GROUPS = (1, 0, 1)  # each request's attention group at DP2
NEXT = (7, 200, 31)  # the first decode step's tokens
LAST = (9, 44)  # a second decode step of requests 0 and 2 only: group 0 attends nothing
MODELS: dict[str, ModelSpec] = {"mla": tiny_mla(), "mla-moe": tiny_mla_moe()}


def steps(model: Transformer, groups: tuple[int, ...]) -> tuple[list[torch.Tensor], KVCache]:
    """(logits of each step, cache) of a three-request prefill, a decode step of all three and
    one of requests 0 and 2, request i held by attention group groups[i]."""
    cache = model.new_cache(PAGES, PAGE_SIZE)
    at = zip(PROMPTS, PAGE_IDS, groups, strict=True)
    passes = [[Seq.of(p, 0, pages, dp_rank=g) for p, pages, g in at]]
    at = zip(NEXT, PROMPTS, PAGE_IDS, groups, strict=True)
    passes.append([Seq.of([t], len(p), pages, dp_rank=g) for t, p, pages, g in at])
    passes.append(
        [
            Seq.of([t], len(PROMPTS[i]) + 1, PAGE_IDS[i], dp_rank=groups[i])
            for t, i in zip(LAST, (0, 2), strict=True)
        ]
    )
    return [model.forward(batch, cache).logits for batch in passes], cache


def rank_main(rank: int, init_file: str, out_dir: str) -> None:
    """One of four ranks: DP2xTP2 over all four, then DP2 (of one rank each) over ranks 0, 1."""
    world = join(rank, 4, init_file, timeout_s=60, dp=2)
    pair = dist.new_group([0, 1])  # every rank makes it (a collective), ranks 0 and 1 use it
    for name, spec in MODELS.items():
        layouts = {"dp2xtp2": world}
        if rank < 2:
            layouts["dp2"] = TensorParallel(rank, 2, pair, dp=2)
        for label, tp in layouts.items():
            logits, cache = steps(Transformer(spec, seed=SEED, tp=tp), GROUPS)
            pages = [cache.layer_bytes(i).clone() for i in range(spec.layers)]
            torch.save((logits, pages), Path(out_dir) / f"{name}.{label}.{rank}.pt")
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A directory of every model's results from four spawned rank processes."""
    out = tmp_path_factory.mktemp("dp")
    spawn_ranks(rank_main, 4, out, timeout_s=180)
    return out


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize(("label", "size"), [("dp2", 2), ("dp2xtp2", 4)])
def test_dp_groups_give_the_tp1_logits_and_cache_only_their_requests(
    ranks: Path, model: str, label: str, size: int
) -> None:
    """Every rank returns TP1's logits of every step's requests (float32 rounding: the MLP's
    and experts' partial sums are added in another order), a step that has none of a group's
    requests included; the ranks of group g hold, page for page, TP1's latent of the requests
    of group g (the latent is replicated over the group's ranks), and zeros in the pages of the
    other group's requests."""
    spec = MODELS[model]
    want, cache = steps(Transformer(spec, seed=SEED), (0, 0, 0))
    for rank in range(size):
        logits, pages = torch.load(ranks / f"{model}.{label}.{rank}.pt")
        for got, ref in zip(logits, want, strict=True):
            torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
        group = rank // (size // 2)
        for layer in range(spec.layers):
            full = cache.layer_bytes(layer).view(torch.float32).view(PAGES, -1)
            mine = pages[layer].view(torch.float32).view(PAGES, -1)
            for ids, g in zip(PAGE_IDS, GROUPS, strict=True):
                got = mine[list(ids)]
                if g == group:  # (a GEMM of fewer rows may round otherwise)
                    torch.testing.assert_close(got, full[list(ids)], rtol=1e-5, atol=1e-6)
                else:
                    assert not got.any(), (rank, layer, ids)


def test_a_rank_cuts_attention_within_its_group_and_the_mlp_over_the_node() -> None:
    """DP2xTP2: rank 3 is the second rank of group 1, with half of the query heads and the
    whole latent projection; the MLP is cut four ways."""
    tp = TensorParallel(3, 4, dp=2)
    assert (tp.dp_rank, tp.attention.rank, tp.attention.size) == (1, 1, 2)
    assert str(tp) == "tp=2 x dp=2 (4 ranks)"
    model = Transformer(tiny_mla(), seed=SEED, tp=tp)
    assert model.heads == 2
    assert model.layer_shapes()["w_gate_up"] == (2 * 128 // 4, 64)
    assert model.layer_shapes()["w_dkv"] == (32 + 8, 64)  # the latent: uncut


# ---- nodes -------------------------------------------------------------------------------
def test_prefill_posts_each_request_to_the_ranks_of_its_decode_group() -> None:
    """TP1 -> DP2 of tiny-mla (pages of 4 fp32 tokens of its 40-wide latent: 640 bytes): a
    request of decode group g is written, whole pages, into rank g's regions only, and its
    immediates, the metadata's too, name rank g, where the decoder counts them."""
    data = dp_nodes("tiny-mla", (1, 1), (1, 2))
    exp = build_experiment(data, ["kv.pages=16"])
    server = PrefillServer(
        NodeConfig("prefill", 0, exp.model_dump(mode="json"), "tcp://127.0.0.1:1")
    )
    try:
        by_group = {dp_rank(exp, "decode", i): i for i in range(20)}
        assert sorted(by_group) == [0, 1]
        page = 4 * 40 * 4
        for group, req_id in by_group.items():
            post = m.PostWrites(req_id, 0, 9, range(0, 2), (3, 5), (1, 2), (True, False))
            units = server.page_units(post)
            suffix = f".r{group}" if group else ""
            assert [(u.writes.src, u.writes.dst) for u in units] == [
                ("kv0", f"kv0{suffix}"),
                ("kv1", f"kv1{suffix}"),
            ]
            assert list(units[0].writes.src_offsets) == [3 * page, 5 * page]
            assert list(units[0].writes.dst_offsets) == [1 * page, 2 * page]
            assert [unpack_imm(u.imm) for u in units] == [(9, 1, group)] * 2
            server.meta_row(req_id)
            assert unpack_imm(server.meta_unit(m.PostMetadata(req_id, 0, 9)).imm) == (9, 1, group)
            plan = transfer_plan(exp, 4, 0, group)
            assert plan.expected_immediates(2, 2, metadata=True) == {group: 2 * 2 + 1}
    finally:
        server.watcher.stop()
        server.control.close()


@pytest.fixture(scope="module", params=["tiny-mla", "tiny-mla-moe"])
def colocated(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    model = request.param
    _, state = run(tmp_path_factory.mktemp(model), "colocated", colocated_tp1(model))
    return model, state.finished


def dp_nodes(model: str, prefill: tuple[int, int], decode: tuple[int, int]) -> dict:
    """Disaggregated, one node per role of (tp, dp) each."""
    data = with_tp(model, prefill[0], decode[0])
    data["cluster"]["prefill"]["dp"] = prefill[1]
    data["cluster"]["decode"]["dp"] = decode[1]
    return data


def test_mla_prefill_tp2_to_decode_dp2_gives_the_colocated_tokens(
    colocated, tmp_path: Path
) -> None:
    """Each request's latent goes from both prefill ranks' replicas (the planner picks one per
    request) to the one rank of its decode group, counted in there; both groups hold requests."""
    model, reference = colocated
    data = dp_nodes(model, (2, 1), (1, 2))
    exp = build_experiment(data)
    assert {dp_rank(exp, "decode", i) for i in reference} == {0, 1}
    summary, state = run(tmp_path, "tp2-dp2", data)
    assert_same_outputs(summary, state, reference)


@pytest.mark.parametrize("colocated", ["tiny-mla"], indirect=True)  # seven processes: one model
def test_prefill_dp2_to_decode_dp2xtp2_gives_the_colocated_tokens(
    colocated, tmp_path: Path
) -> None:
    """Both sides in groups: a request's prefill group posts to the two ranks of its decode
    group (the latent replicated on both)."""
    model, reference = colocated
    summary, state = run(tmp_path, "dp2-dp2xtp2", dp_nodes(model, (1, 2), (2, 2)))
    assert_same_outputs(summary, state, reference)


def test_a_colocated_dp2_node_gives_the_tp1_tokens(colocated, tmp_path: Path) -> None:
    model, reference = colocated
    data = colocated_tp1(model)
    data["cluster"]["colocated"]["dp"] = 2
    summary, state = run(tmp_path, "colocated-dp2", data)
    assert_same_outputs(summary, state, reference)

"""MoE layers of the real backend: routing against hand-computed cases, the torch experts
(per-expert and grouped) against a per-token loop, and an MoE model's chunking and batching
invariants; on a GPU, the grouped experts in bf16 and an MoE decode step in a CUDA graph."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

pytest.importorskip("torch", reason="the hw backend needs torch: pip install -e '.[hw]'")

import torch

from disagg.config import load_experiment
from disagg.hw.batch import Seq
from disagg.hw.model import Transformer
from disagg.hw.moe import (
    Routing,
    experts_grouped,
    experts_reference,
    grouped_runs,
    route,
    routing_for,
    swiglu,
)
from disagg.hw.specs import small_moe, tiny_mla_moe, tiny_moe
from disagg.models import DEEPSEEK_V2_LITE, DEEPSEEK_V3, QWEN3_CODER_480B

EXPERIMENTS = Path(__file__).parent.parent / "experiments"
PROMPT = [3, 14, 15, 92, 65, 35, 89, 79, 32, 38, 46]


def logit(p: float) -> float:
    return math.log(p / (1 - p))


def test_each_family_routes_as_its_model_does() -> None:
    assert routing_for(DEEPSEEK_V3) == Routing("grouped", 8, 8, 4, 2.5)
    assert routing_for(QWEN3_CODER_480B) == Routing("softmax", 8)
    assert routing_for(DEEPSEEK_V2_LITE) == Routing("softmax", 6, normalise=False)
    assert routing_for(tiny_mla_moe()).kind == "grouped"
    assert routing_for(tiny_moe()) == Routing("softmax", 2)


def test_softmax_routing_renormalises_the_top_k() -> None:
    # softmax of log(1..4) is (1, 2, 3, 4) / 10: the top two, 4 and 3, renormalised
    logits = torch.tensor([[0.0, math.log(2), math.log(3), math.log(4)]])
    weights, ids = route(logits, Routing("softmax", 2))
    assert ids.tolist() == [[3, 2]]
    torch.testing.assert_close(weights, torch.tensor([[4 / 7, 3 / 7]]))
    weights, _ = route(logits, Routing("softmax", 2, scale=2.0, normalise=False))
    torch.testing.assert_close(weights, torch.tensor([[0.8, 0.6]]))  # 2 x (0.4, 0.3)


def test_grouped_routing_keeps_the_best_groups_and_weighs_scores_without_bias() -> None:
    # 8 experts in 4 groups of 2; sigmoid scores chosen directly
    p = [0.9, 0.1, 0.6, 0.5, 0.8, 0.05, 0.3, 0.3]
    logits = torch.tensor([[logit(x) for x in p]])
    routing = Routing("grouped", top_k=2, groups=4, topk_groups=2, scale=2.5)
    # group scores (sum of both): 1.0, 1.1, 0.85, 0.6 -> groups 1 and 0; best experts 0, 2
    weights, ids = route(logits, routing)
    assert ids.tolist() == [[0, 2]]
    torch.testing.assert_close(weights, torch.tensor([[0.9 / 1.5 * 2.5, 0.6 / 1.5 * 2.5]]))
    # a bias on expert 4 lifts group 2 above group 0 and expert 4 above 0: chosen, but its
    # weight is its score without the bias
    bias = torch.tensor([0.0, 0.0, 0.0, 0.0, 0.5, 0.0, 0.0, 0.0])
    weights, ids = route(logits, routing, bias)
    assert ids.tolist() == [[4, 2]]
    torch.testing.assert_close(weights, torch.tensor([[0.8 / 1.4 * 2.5, 0.6 / 1.4 * 2.5]]))


def experts_by_loop(x, weights, ids, w13, w2):  # type: ignore[no-untyped-def]
    """The definition, one token and one chosen expert at a time."""
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            out[t] += weights[t, j] * swiglu(x[t : t + 1], w13[e], w2[e])[0]
    return out


def random_experts(t: int, e: int, k: int, h: int, i: int, seed: int = 0):  # type: ignore[no-untyped-def]
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, h, generator=g)
    logits = torch.randn(t, e, generator=g)
    w13 = torch.randn(e, 2 * i, h, generator=g) / h**0.5
    w2 = torch.randn(e, h, i, generator=g) / i**0.5
    weights, ids = route(logits, Routing("softmax", k))
    return x, weights, ids, w13, w2


def test_the_torch_experts_equal_the_per_token_definition() -> None:
    args = random_experts(t=13, e=6, k=3, h=16, i=8)
    torch.testing.assert_close(experts_reference(*args), experts_by_loop(*args))


def test_experts_that_receive_no_token_are_skipped() -> None:
    x, weights, _, w13, w2 = random_experts(t=4, e=6, k=2, h=16, i=8)
    ids = torch.tensor([[5, 1]] * 4, dtype=torch.int32)  # experts 0, 2, 3, 4 idle
    torch.testing.assert_close(
        experts_reference(x, weights, ids, w13, w2), experts_by_loop(x, weights, ids, w13, w2)
    )


needs_grouped = pytest.mark.skipif(
    not hasattr(torch, "_grouped_mm"), reason="this torch has no grouped GEMM (torch._grouped_mm)"
)


@needs_grouped
def test_the_grouped_experts_equal_the_per_token_definition_idle_experts_included() -> None:
    x, weights, ids, w13, w2 = random_experts(t=13, e=6, k=3, h=16, i=8)
    torch.testing.assert_close(
        experts_grouped(x, weights, ids, w13, w2), experts_by_loop(x, weights, ids, w13, w2)
    )
    ids = torch.tensor([[5, 1, 3]] * 13, dtype=torch.int64)  # experts 0, 2, 4 idle
    torch.testing.assert_close(
        experts_grouped(x, weights, ids, w13, w2), experts_by_loop(x, weights, ids, w13, w2)
    )


def test_the_grouped_experts_serve_only_a_rank_holding_every_expert_unless_told_not_to(
    monkeypatch,  # type: ignore[no-untyped-def]
) -> None:
    x = torch.zeros(2, 4)  # rows of 16 bytes
    assert grouped_runs(x, torch.zeros(8, 4, 8), 8) == hasattr(torch, "_grouped_mm")
    assert not grouped_runs(x, torch.zeros(4, 4, 8), 8)  # expert parallelism: per expert
    assert not grouped_runs(x, torch.zeros(8, 4, 9), 8)  # an expert's rows of 36 bytes
    assert not grouped_runs(torch.zeros(2, 5), torch.zeros(8, 5, 8), 8)  # hidden rows of 20
    spec = tiny_moe()
    reference = Transformer(spec, seed=3, moe="reference")
    assert not any(m.grouped for m in reference.moes.values())
    assert all(m.grouped for m in Transformer(spec, seed=3).moes.values())
    monkeypatch.setenv("DISAGG_MOE", "reference")  # the experiment's hw.moe, as every setting
    assert load_experiment(EXPERIMENTS / "tiny-disagg.toml").hw.moe == "reference"


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@cuda
@needs_grouped
def test_gpu_grouped_experts_in_bf16_match_the_float32_reference() -> None:
    args = [a.cuda() for a in random_experts(t=300, e=16, k=4, h=256, i=128, seed=5)]
    x, weights, ids, w13, w2 = args
    want = experts_reference(x, weights, ids, w13, w2)
    got = experts_grouped(x.bfloat16(), weights, ids, w13.bfloat16(), w2.bfloat16())
    torch.testing.assert_close(got.float(), want, atol=3e-2, rtol=3e-2)


@cuda
def test_gpu_an_moe_decode_step_replays_a_cuda_graph_with_eager_tokens() -> None:
    from disagg.hw.runner import Runner

    pytest.importorskip("flashinfer", reason="CUDA graphs replay FlashInfer decode steps")
    spec = small_moe()
    m = Transformer(spec, seed=4, device="cuda")
    graphs = Runner(m, m.new_cache(64, 16), graph_batches=(4,))
    eager = Runner(m, m.new_cache(64, 16), graph_batches=())
    seqs = [Seq.of(PROMPT[: 5 + i], 0, [i]) for i in range(3)]
    for r in (graphs, eager):
        r.step(seqs)
    step = [Seq.of([PROMPT[i]], 5 + i, [i]) for i in range(3)]
    got, want = graphs.step(step, sample=True), eager.step(step, sample=True)
    assert graphs.captured == [4] and not graphs.graph_error
    assert got.tokens == want.tokens


@pytest.mark.parametrize("spec", [tiny_moe(), tiny_mla_moe()], ids=["gqa-moe", "mla-moe"])
def test_an_moe_model_prefills_in_chunks_as_in_one_shot(spec) -> None:  # type: ignore[no-untyped-def]
    m = Transformer(spec, seed=1)
    assert sorted(m.moes) == list(range(spec.dense_layers, spec.layers))
    pages = [7, 1, 4]
    whole = m.forward([Seq.of(PROMPT, 0, pages, hidden_at=-1)], m.new_cache(8, 4))
    cache = m.new_cache(8, 4)
    m.forward([Seq.of(PROMPT[:5], 0, pages)], cache)
    last = m.forward([Seq.of(PROMPT[5:], 5, pages)], cache)
    torch.testing.assert_close(last.logits, whole.logits, atol=1e-5, rtol=1e-5)


def test_an_moe_batch_equals_its_sequences_run_alone() -> None:
    m = Transformer(tiny_mla_moe(), seed=2)
    a, b = Seq.of(PROMPT, 0, [0, 1, 2]), Seq.of(PROMPT[:6][::-1], 0, [3, 4])
    both = m.forward([a, b], m.new_cache(6, 4))
    alone = [m.forward([s], m.new_cache(6, 4)).logits[0] for s in (a, b)]
    torch.testing.assert_close(both.logits, torch.stack(alone), atol=1e-5, rtol=1e-5)


def test_the_experts_change_the_output() -> None:
    """The routed experts are on the path: other expert weights, other logits."""
    spec = tiny_moe()
    a, b = Transformer(spec, seed=3), Transformer(spec, seed=3)
    b.moes[1].w2 = b.moes[1].w2 * 2
    seq = [Seq.of(PROMPT, 0, [0, 1, 2])]
    la = a.forward(seq, a.new_cache(4, 4)).logits
    lb = b.forward(seq, b.new_cache(4, 4)).logits
    assert not torch.allclose(la, lb, atol=1e-4)


def test_weight_bytes_count_the_experts() -> None:
    m = Transformer(tiny_mla_moe(), seed=0)
    dense = [w for layer in m.layers for n, w in layer.items() if n[0] == "w"]
    experts = [
        t for moe in m.moes.values() for t in (moe.router, moe.w13, moe.w2, *(moe.shared or ()))
    ]
    tensors = [m.embed, m.lm_head, *dense, *experts]
    assert m.weight_bytes() == sum(t.numel() * 4 for t in tensors)

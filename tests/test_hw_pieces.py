"""hw.latency.prefill_graphs: a pass's work between its attentions in CUDA graphs, padded to a
size (disagg.hw.pieces). On the CPU the pieces run uncaptured, padded all the same; on a GPU
they are captured and replayed."""

from __future__ import annotations

import pytest

pytest.importorskip("torch", reason="the hw backend needs torch: pip install -e '.[hw]'")

import torch
from test_hw_disagg import experiment, run

from disagg.config import build_experiment
from disagg.errors import ConfigError
from disagg.hw.attention import TorchAttention
from disagg.hw.batch import Seq
from disagg.hw.cache import KVCache
from disagg.hw.model import Transformer
from disagg.hw.pieces import PrefillPieces
from disagg.hw.runner import Runner
from disagg.hw.specs import small_gqa, small_moe, tiny_gqa, tiny_mla, tiny_moe
from disagg.models import ModelSpec
from disagg.settings import pieces_size

PAGE = 16


def mixed_pass() -> list[Seq]:
    """A 40-token prompt chunk, a decode row at position 20, and a 10-token chunk after 16
    cached tokens: 51 new tokens on pages 0-7."""
    return [
        Seq.of(list(range(5, 45)), 0, range(0, 4)),
        Seq.decode(7, 20, range(4, 6)),
        Seq.of(list(range(3, 13)), 16, range(6, 8)),
    ]


def twin_caches(m: Transformer, layout: str) -> tuple[KVCache, KVCache]:
    """Two caches of 16 pages holding the same random entries (the rows' cached context)."""
    a, b = m.new_cache(16, PAGE, layout), m.new_cache(16, PAGE, layout)  # type: ignore[arg-type]
    gen = torch.Generator().manual_seed(0)
    for x, y in zip(a.layers, b.layers, strict=True):
        x.copy_(torch.randn(x.shape, generator=gen))
        y.copy_(x)
    return a, b


def but_scratch(cache: KVCache) -> list[torch.Tensor]:
    """Each layer's pages, less the scratch page (where padding writes)."""
    return [layer[: cache.scratch_page] for layer in cache.layers]


@pytest.mark.parametrize(
    ("spec", "layout"),
    [(tiny_gqa(layers=3), "HND"), (tiny_gqa(layers=3), "NHD"), (tiny_moe(layers=3), "HND")],
    ids=["dense-HND", "dense-NHD", "moe-HND"],
)
def test_a_pass_in_pieces_gives_the_eager_pass(spec: ModelSpec, layout: str) -> None:
    """A mixed pass of 51 tokens padded to 64, then one of 3: the eager pass's logits, hidden
    states and pages (padding writes only the scratch page), up to the rounding of GEMMs over
    64 rows instead of 3 (float32 here), with the same greedy tokens. The second pass finds
    the first one's tokens in the buffers. An MoE model's padding rows go to experts too,
    without changing the real rows' outputs."""
    m = Transformer(spec, seed=1)
    eager_cache, pieces_cache = twin_caches(m, layout)
    shape = m.attn_shape(PAGE, eager_cache.layout.layout)
    pieces = PrefillPieces(m, pieces_cache, 64, capture=False)
    for batch in (mixed_pass(), [Seq.of([9, 8, 7], 40, range(0, 4))]):
        want = m.forward(batch, eager_cache, TorchAttention(shape))
        attn = TorchAttention(shape)
        got = pieces.run(m.planned_inputs(batch, pieces_cache, attn, None), attn)
        torch.testing.assert_close(got.logits, want.logits, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(got.hidden, want.hidden, atol=1e-5, rtol=1e-5)
        assert torch.equal(got.logits.argmax(-1), want.logits.argmax(-1))
        for x, y in zip(but_scratch(pieces_cache), but_scratch(eager_cache), strict=True):
            torch.testing.assert_close(x, y, atol=1e-5, rtol=1e-5)
    assert pieces.x.slot_pages[3:].eq(pieces_cache.scratch_page).all()


def test_a_runner_runs_a_pass_in_the_smallest_size_that_holds_it() -> None:
    """Sizes 16 and 64: the 51-token pass runs in the pieces of 64, a pass of 80 eagerly, and
    both give a runner without pieces its logits (to rounding) and tokens; every layer is
    counted either way."""
    m = Transformer(tiny_gqa(layers=3), seed=2)
    plain = Runner(m, m.new_cache(24, PAGE))
    pieces = Runner(m, m.new_cache(24, PAGE), prefill_graphs=(64, 16, 64))
    assert pieces.prefill_graphs == [16, 64]
    long = [Seq.of(list(range(80)), 0, range(8, 13))]
    for batch in (mixed_pass(), long):
        want = plain.step(batch, sample=True)
        got = pieces.step(batch, sample=True)
        torch.testing.assert_close(got.logits, want.logits, atol=1e-5, rtol=1e-5)
        assert got.tokens == want.tokens
        assert pieces.counter.read() == plain.counter.read()
    assert sorted(pieces._pieces) == [64]  # captured (here: built) when first needed
    assert pieces.passes_in_pieces == 1  # the 80-token pass ran eagerly
    assert pieces.counter.read() == 2 * m.spec.layers
    pieces.capture_pieces()
    assert sorted(pieces._pieces) == [16, 64] and pieces.capture_s == 0  # the CPU captures none


def test_pieces_size_is_the_smallest_that_holds_the_pass() -> None:
    assert pieces_size([256, 1024], 1) == 256
    assert pieces_size([256, 1024], 256) == 256
    assert pieces_size([256, 1024], 257) == 1024
    assert pieces_size([256, 1024], 1025) is None
    assert pieces_size([], 5) is None


@pytest.mark.parametrize(
    ("model", "why"),
    [
        (Transformer(tiny_mla(), seed=0), "not tiny-mla$"),
        (Transformer(tiny_moe(), seed=0, moe="reference"), "not tiny-moe with hw.moe=reference"),
    ],
    ids=["mla", "moe-reference"],
)
def test_prefill_graphs_for_a_model_they_do_not_fit_is_a_clear_error(
    model: Transformer, why: str
) -> None:
    """MLA, and experts whose counts go to the host (the reference path), cannot be captured."""
    with pytest.raises(ConfigError, match=rf"prefill_graphs \[64\]: for GQA models on one .*{why}"):
        Runner(model, model.new_cache(8, PAGE), prefill_graphs=(64,))


@pytest.mark.parametrize("model", ["tiny-gqa", "tiny-moe"])
def test_servers_in_pieces_serve_the_tokens_of_servers_without(tmp_path, model: str) -> None:  # type: ignore[no-untyped-def]
    """Real servers on this CPU, disaggregated with prompt chunks of 8 tokens (the prefill
    server's passes) and decode passes of up to 5 rows, all in pieces of 8: every request's
    tokens as the same servers give them without (prompts of 6-30 tokens, 3-7 out)."""
    data = experiment(model, "disagg", "HND", 8)
    _, without = run(tmp_path, "without", data)
    data["hw"] = {"latency": {"prefill_graphs": [8]}}
    summary, within = run(tmp_path, "within", data)
    assert summary["completed"] == 5 and summary["failed"] == 0
    # every pass: the prefill server's chunks and the decoder's passes (none replays a graph)
    steps = sum(len(r.steps) for r in within.records.values())
    assert summary["passes_in_pieces"] == steps > 0
    assert sorted(within.finished) == sorted(without.finished)
    for req_id, want in without.finished.items():
        assert within.finished[req_id].tokens == want.tokens


@pytest.mark.parametrize(
    ("model", "mode", "why"),
    [
        ("tiny-mla", "colocated", "tiny-mla is MLA"),
        ("tiny-gqa", "disagg", "cluster.prefill has tp=2 x dp=1"),
        ("tiny-moe", "colocated", "hw.moe is reference"),
    ],
)
def test_prefill_graphs_where_they_do_not_fit_are_a_clear_error(
    model: str, mode: str, why: str
) -> None:
    data = experiment(model, mode, "HND", 8)
    if mode == "disagg":
        data["cluster"]["prefill"]["tp"] = 2
    if model == "tiny-moe":
        data["hw"] = {"moe": "reference"}
    with pytest.raises(ConfigError, match=rf"hw.latency.prefill_graphs=\[64\]: .*{why}"):
        build_experiment(data, ["hw.latency.prefill_graphs=[64]"])


def test_prefill_graphs_take_positive_sizes_only() -> None:
    data = experiment("tiny-gqa", "colocated", "HND", 8)
    data["hw"] = {"latency": {"prefill_graphs": [0]}}
    with pytest.raises(ConfigError, match="prefill_graphs"):
        build_experiment(data)
    data["hw"] = {"latency": {"prefill_graphs": [512, 2048]}}
    assert build_experiment(data).hw.latency.prefill_graphs == (512, 2048)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("spec", [small_gqa(), small_moe()], ids=["dense", "moe"])
def test_gpu_a_pass_replayed_in_pieces_gives_the_eager_logits(spec: ModelSpec) -> None:
    """On a GPU with FlashInfer: the mixed pass replays the captured pieces of 64 and gives an
    eager runner's logits and greedy tokens (bf16 GEMMs over 64 rows or 51 may differ in the
    last bits); the layer counter, captured in the graphs, counts every layer; a capture error
    would have left passes eager and said so. An MoE model's grouped experts are captured."""
    pytest.importorskip("flashinfer", reason="the pieces' attention is FlashInfer's")
    m = Transformer(spec, seed=4, device="cuda")
    eager = Runner(m, m.new_cache(24, PAGE), graph_batches=())
    pieces = Runner(m, m.new_cache(24, PAGE), graph_batches=(), prefill_graphs=(64,))
    pieces.capture_pieces()
    assert not pieces.graph_error and pieces.capture_s > 0
    assert len(pieces._pieces[64].graphs) == m.spec.layers + 1
    for batch in (mixed_pass(), [Seq.of([1, 2, 3], 51, range(0, 4))]):
        want, got = eager.step(batch, sample=True), pieces.step(batch, sample=True)
        torch.testing.assert_close(got.logits, want.logits, atol=2e-2, rtol=2e-2)
        assert got.tokens == want.tokens
    torch.cuda.synchronize()
    assert pieces.counter.read() == eager.counter.read() == 2 * m.spec.layers

"""The runner: layer counting seen by the watcher thread, decode against full recompute."""

from __future__ import annotations

import math
import threading
import time

import pytest

pytest.importorskip("torch", reason="the hw backend needs torch: pip install -e '.[hw]'")

import torch

from disagg.hw import runner as runner_mod
from disagg.hw.batch import Seq
from disagg.hw.model import Transformer
from disagg.hw.runner import (
    GRAPH_BATCHES,
    LayerCounter,
    LayerWatcher,
    Runner,
    batches_to_capture,
    graph_batch_for,
)
from disagg.hw.specs import small_gqa, small_mla, tiny_gqa, tiny_mla

PROMPTS = [[5, 9, 2, 7, 7, 1, 30, 4, 8], [11, 3, 6], [40, 41, 42, 43, 44, 45, 46]]
PAGE = 4


def _pages(i: int) -> tuple[int, ...]:
    return tuple(range(8 * i, 8 * i + 8))  # 8 pages (32 tokens) per sequence


def test_watcher_sees_layer_counts_in_order() -> None:
    layers = 6
    m = Transformer(tiny_gqa(layers=layers), seed=0)
    runner = Runner(m, m.new_cache(32, PAGE))
    seen: list[int] = []
    done = threading.Event()

    def on_layers(n: int) -> None:
        seen.append(n)
        if n == 3 * layers:
            done.set()

    with LayerWatcher(runner.counter, on_layers, poll_interval_s=0):
        for step in range(3):
            out = runner.step([Seq.of(PROMPTS[0][:3], 3 * step, _pages(0))])
            assert out.layers_before == step * layers
        assert done.wait(5), seen
    assert seen == sorted(set(seen)) and seen[-1] == 3 * layers
    assert runner.counter.read() == 3 * layers


def test_a_runner_that_counts_no_layers_bumps_no_counter_and_computes_the_same() -> None:
    """count_layers=False (every server but a prefill one, whose watcher alone reads the
    counter): the counter stays at 0, and the passes are the counting runner's, bit for bit."""
    m = Transformer(tiny_gqa(layers=3), seed=0)
    counting, silent = (Runner(m, m.new_cache(32, PAGE), count_layers=c) for c in (True, False))
    for step in range(2):
        batch = [Seq.of(PROMPTS[0][:3], 3 * step, _pages(0))]
        a, b = counting.step(batch), silent.step(batch)
        assert torch.equal(a.logits, b.logits) and a.layers_before == b.layers_before == 3 * step
    assert (counting.counter.read(), silent.counter.read()) == (6, 0)
    assert silent.on_layer is None


def test_watcher_hands_callback_errors_to_stop() -> None:
    def fail(_: int) -> None:
        raise ZeroDivisionError("the callback failed")

    counter = LayerCounter(torch.device("cpu"))
    watcher = LayerWatcher(counter, fail).start()
    counter.bump()
    time.sleep(0.05)
    with pytest.raises(ZeroDivisionError):
        watcher.stop()


def _decode_against_recompute(m: Transformer, runner: Runner, steps: int, atol: float) -> None:
    """Prefill PROMPTS in two mixed chunks, then decode greedily; every step's logits must equal
    a fresh forward over the whole sequence so far (reference attention, new cache)."""
    seqs = [list(p) for p in PROMPTS]
    runner.step([Seq.of(p[:2], 0, _pages(i)) for i, p in enumerate(seqs)])
    out = runner.step([Seq.of(p[2:], 2, _pages(i)) for i, p in enumerate(seqs)], sample=True)
    for _ in range(steps):
        assert out.tokens is not None
        for p, t in zip(seqs, out.tokens, strict=True):
            p.append(t)
        out = runner.step(
            [Seq.of(p[-1:], len(p) - 1, _pages(i)) for i, p in enumerate(seqs)], sample=True
        )
        for i, p in enumerate(seqs):
            full = m.forward([Seq.of(p, 0, range(8))], m.new_cache(8, PAGE)).logits[0]
            torch.testing.assert_close(out.logits[i], full, atol=atol, rtol=0)
            assert out.tokens is not None and out.tokens[i] == int(out.logits[i].argmax())


@pytest.mark.parametrize("spec", [tiny_gqa(), tiny_mla()], ids=["gqa", "mla"])
def test_runner_decode_equals_full_recompute(spec) -> None:  # type: ignore[no-untyped-def]
    m = Transformer(spec, seed=4)
    runner = Runner(m, m.new_cache(24, PAGE))
    _decode_against_recompute(m, runner, steps=4, atol=1e-4)
    assert math.isnan(runner.device_s())  # no device: a CPU step is all host time


gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("spec", [small_gqa(), small_mla()], ids=["gqa", "mla"])
def test_graph_decode_on_gpu_matches_reference(spec) -> None:  # type: ignore[no-untyped-def]
    """FlashInfer + CUDA graphs (3 rows padded to a graph of 4) against the reference attention
    on the same bf16 weights; the in-graph layer counter must count every layer, and a graph
    captured without it gives the same logits."""
    m = Transformer(spec, seed=4, device="cuda")
    fi = Runner(m, m.new_cache(24, PAGE), graph_batches=(1, 4))
    ref = Runner(m, m.new_cache(24, PAGE), attention="torch")
    silent = Runner(m, m.new_cache(24, PAGE), graph_batches=(1, 4), count_layers=False)
    seqs = [list(p) for p in PROMPTS]
    for r in (fi, ref, silent):
        r.step([Seq.of(p, 0, _pages(i)) for i, p in enumerate(seqs)])
    for step in range(3):
        batch = [Seq.of([7 + step], len(p) + step, _pages(i)) for i, p in enumerate(seqs)]
        got, want = fi.step(batch).logits, ref.step(batch).logits
        torch.testing.assert_close(got, want, atol=0.1, rtol=0.05)
        assert torch.equal(silent.step(batch).logits, got)  # its graph without the counter
    assert silent.counter.read() == 0 and 4 in silent._graphs
    assert 4 in fi._graphs and not fi.graph_error
    t = time.perf_counter()
    fi.step(batch)
    wall = time.perf_counter() - t
    assert 0 < fi.device_s() <= wall + 1e-4  # the graph's time on the device, within the step
    assert ref.device_s() > 0  # eager passes are timed too
    torch.cuda.synchronize()
    assert fi.counter.read() == 5 * spec.layers


def test_plan_ahead_is_a_no_op_without_graphs() -> None:
    """On the CPU (eager steps) there is no graph to plan for: nothing is kept, the step runs
    as always."""
    m = Transformer(tiny_gqa(), seed=4)
    runner = Runner(m, m.new_cache(24, PAGE))
    runner.step([Seq.of(PROMPTS[0], 0, _pages(0))])
    batch = [Seq.of([7], len(PROMPTS[0]), _pages(0))]
    assert not runner.plan_ahead(batch)
    assert runner.step(batch, sample=True).tokens is not None and runner.planned_ahead == 0


@gpu
@pytest.mark.gpu
def test_gpu_plan_ahead_only_replays_its_graph_and_gives_the_same_logits() -> None:
    """A step of the rows planned ahead skips planning and matches a runner that planned as
    usual, its own tokens written where the plan had others; a plan made for other rows (here
    one position off) is not used (the step plans its own)."""
    m = Transformer(small_gqa(), seed=4, device="cuda")
    a, b = (Runner(m, m.new_cache(24, PAGE), graph_batches=(1,)) for _ in range(2))
    prompt = PROMPTS[0]
    for r in (a, b):
        r.step([Seq.of(prompt, 0, _pages(0))])
    batch = [Seq.of([7], len(prompt), _pages(0))]
    assert a.plan_ahead(batch)
    torch.testing.assert_close(a.step(batch).logits, b.step(batch).logits, atol=0, rtol=0)
    assert a.planned_ahead == 1
    assert a.plan_ahead([Seq.of([8], len(prompt) + 1, _pages(0))])  # token 8 planned ...
    other = [Seq.of([9], len(prompt) + 1, _pages(0))]  # ... token 9 run
    torch.testing.assert_close(a.step(other).logits, b.step(other).logits, atol=0, rtol=0)
    assert a.planned_ahead == 2
    assert a.plan_ahead([Seq.of([8], len(prompt) + 3, _pages(0))])  # a position off
    other = [Seq.of([9], len(prompt) + 2, _pages(0))]
    torch.testing.assert_close(a.step(other).logits, b.step(other).logits, atol=0, rtol=0)
    assert a.planned_ahead == 2


def test_a_decode_step_replays_the_smallest_graph_that_holds_it() -> None:
    assert [graph_batch_for(GRAPH_BATCHES, n) for n in (1, 2, 3, 5, 8, 9, 100, 128)] == [
        1,
        2,
        4,
        8,
        8,
        16,
        128,
        128,
    ]
    assert graph_batch_for(GRAPH_BATCHES, 129) is None  # runs eagerly
    assert graph_batch_for((4, 1), 2) == 4  # any order
    assert graph_batch_for((), 1) is None  # no graphs (CPU)


def test_graphs_to_capture_run_up_to_the_first_size_that_holds_the_batch_limit() -> None:
    for limit, want in (
        (1, [1]),
        (3, [1, 2, 4]),
        (8, [1, 2, 4, 8]),
        (10, [1, 2, 4, 8, 16]),
        (128, list(GRAPH_BATCHES)),
        (500, list(GRAPH_BATCHES)),  # larger batches run eagerly: no graph for them
    ):
        assert batches_to_capture(GRAPH_BATCHES, limit) == want, limit
    assert batches_to_capture((1, 3), 2) == [1, 3]
    assert batches_to_capture((), 8) == []


def test_a_cpu_runner_captures_nothing_and_decodes_eagerly() -> None:
    m = Transformer(tiny_gqa(), seed=0)
    runner = Runner(m, m.new_cache(8, PAGE))
    assert runner.graph_batches == []
    runner.capture_up_to(8)
    runner.step([Seq.of(PROMPTS[1], 0, (0, 1))])
    runner.step([Seq.of([5], len(PROMPTS[1]), (0, 1))])
    assert runner.captured == [] and runner.captured_on_demand == 0


@gpu
@pytest.mark.gpu
def test_gpu_graphs_are_captured_up_to_the_limit_and_replay_the_eager_logits() -> None:
    """A runner captures graphs 1, 2 and 4 for a batch limit of 3; a step of 3 sequences
    replays the graph of 4 and gives an eager runner's logits; a step of 5 (over the limit)
    captures the graph of 8 then, which is counted (the servers report it)."""
    pytest.importorskip("flashinfer", reason="decode graphs need FlashInfer")
    m = Transformer(small_gqa(), seed=4, device="cuda")
    graphs = Runner(m, m.new_cache(48, PAGE))
    eager = Runner(m, m.new_cache(48, PAGE), graph_batches=())
    graphs.capture_up_to(3)
    assert graphs.captured == [1, 2, 4] and not graphs.graph_error
    assert graphs.captured_on_demand == 0
    for r in (graphs, eager):
        r.step([Seq.of(p, 0, _pages(i)) for i, p in enumerate(PROMPTS)])
    batch = [Seq.of([7], len(p), _pages(i)) for i, p in enumerate(PROMPTS)]
    got, want = graphs.step(batch).logits, eager.step(batch).logits
    torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)
    assert graphs.captured == [1, 2, 4] and graphs.captured_on_demand == 0
    five = [Seq.of([9], 20, _pages(i)) for i in range(5)]
    graphs.step(five)
    assert graphs.captured == [1, 2, 4, 8] and graphs.captured_on_demand == 1
    assert eager.captured == []


def test_a_chained_warm_up_leaves_no_trace_and_feeds_the_first_pass_sample(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    m = Transformer(tiny_gqa(), seed=3)
    fresh = Runner(m, m.new_cache(24, PAGE))
    warmed = Runner(m, m.new_cache(24, PAGE))
    fed: list[list[int]] = []  # the tokens the chained pass ran on
    feed = runner_mod._fed
    monkeypatch.setattr(runner_mod, "_fed", lambda x, *a: (feed(x, *a), fed.append(x.tolist())))
    assert warmed.warm_chain()
    first = fresh.step([Seq.decode(0, 0, (0,))], sample=True)
    assert fed == [first.tokens]  # the second pass ran on the first one's sample
    assert warmed.steps == 2 and not any(bool(layer.any()) for layer in warmed.cache.layers)
    batch = [Seq.of(p, 0, _pages(i)[:3]) for i, p in enumerate(PROMPTS[:2])]
    other = Runner(m, m.new_cache(24, PAGE))
    out, ref = warmed.step(batch, sample=True), other.step(batch, sample=True)
    assert torch.equal(out.logits, ref.logits) and out.tokens == ref.tokens


def test_a_warm_up_pass_leaves_no_trace_in_the_pages_or_the_logits() -> None:
    m = Transformer(tiny_gqa(), seed=3)
    fresh = Runner(m, m.new_cache(24, PAGE))
    warmed = Runner(m, m.new_cache(24, PAGE))
    other = m.new_cache(24, PAGE)  # as a leader maps a follower's pages, written by its pass
    Runner(m, other).step([Seq.of(PROMPTS[0], 0, _pages(0)[:3])])
    assert any(bool(layer.any()) for layer in other.layers)
    warmed.warm_up(1000, [other])  # more than the 24 pages of 4 tokens hold: all of them
    for cache in (warmed.cache, other):
        assert not any(bool(layer.any()) for layer in cache.layers)
    assert warmed.steps == 1 and warmed.counter.read() == m.spec.layers
    batch = [Seq.of(p, 0, _pages(i)[:3]) for i, p in enumerate(PROMPTS[:2])]
    out, ref = warmed.step(batch, sample=True), fresh.step(batch, sample=True)
    assert out.layers_before == m.spec.layers and ref.layers_before == 0
    assert torch.equal(out.logits, ref.logits) and out.tokens == ref.tokens

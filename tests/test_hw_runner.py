"""The runner: layer counting seen by the watcher thread, decode against full recompute."""

from __future__ import annotations

import math
import threading
import time

import pytest

pytest.importorskip("torch", reason="the hw backend needs torch: pip install -e '.[hw]'")

import torch

from disagg.hw import runner as runner_mod
from disagg.hw.batch import BatchMeta, Seq
from disagg.hw.model import Transformer
from disagg.hw.runner import GRAPH_BATCHES, LayerCounter, LayerWatcher, Runner
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


def test_watcher_hands_callback_errors_to_stop() -> None:
    counter = LayerCounter(torch.device("cpu"))
    watcher = LayerWatcher(counter, lambda n: 1 / 0).start()
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
    on the same bf16 weights; the in-graph layer counter must count every layer."""
    m = Transformer(spec, seed=4, device="cuda")
    fi = Runner(m, m.new_cache(24, PAGE), graph_batches=(1, 4))
    ref = Runner(m, m.new_cache(24, PAGE), attention="torch")
    seqs = [list(p) for p in PROMPTS]
    for r in (fi, ref):
        r.step([Seq.of(p, 0, _pages(i)) for i, p in enumerate(seqs)])
    for step in range(3):
        batch = [Seq.of([7 + step], len(p) + step, _pages(i)) for i, p in enumerate(seqs)]
        got, want = fi.step(batch).logits, ref.step(batch).logits
        torch.testing.assert_close(got, want, atol=0.1, rtol=0.05)
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
    """A step of exactly the batch planned ahead skips planning and matches a runner that
    planned as usual; a plan made for another batch is not used (the step plans its own)."""
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
    assert a.planned_ahead == 1


def test_graphs_are_captured_up_to_the_batch_limit_and_later_captures_counted(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A server captures every graph its decode steps can replay, from batch 1 to the first
    size that holds its batch limit; a graph a step still has to capture is counted (the
    servers report it: a step that paid for a capture)."""
    m = Transformer(tiny_gqa(), seed=0)
    runner = Runner(m, m.new_cache(8, PAGE))
    runner.graph_batches = list(GRAPH_BATCHES)  # as on a GPU; captures recorded, not made
    captured: list[int] = []

    def fake(_: Runner, batch: int) -> object:
        captured.append(batch)
        return object()

    monkeypatch.setattr(runner_mod, "_DecodeGraph", fake)
    for limit, want in ((1, [1]), (8, [1, 2, 4, 8]), (10, [1, 2, 4, 8, 16]), (500, GRAPH_BATCHES)):
        captured.clear()
        runner._graphs.clear()
        runner.capture_up_to(limit)
        assert sorted(captured) == list(want) == runner.captured
    assert runner.captured_on_demand == 0
    runner._graphs = {1: object()}  # type: ignore[dict-item]
    one, three = ([Seq.of([5], 3, (0,))] * n for n in (1, 3))
    runner._graph_for(BatchMeta.of(one, PAGE, 8))
    assert runner.captured_on_demand == 0  # captured already
    runner._graph_for(BatchMeta.of(three, PAGE, 8))
    assert runner.captured_on_demand == 1 and 4 in runner._graphs  # a step would pay for it

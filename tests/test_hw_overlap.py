"""hw.latency.overlap: a server plans its next decode pass while this one runs on the device.

On the CPU a runner replays no graph, so what a server asks its runner to plan is recorded
here; the GPU tests check that a plan made while a pass runs gives that pass and the next the
logits of a runner that planned each pass as it came."""

from __future__ import annotations

from collections.abc import Sequence
from types import SimpleNamespace

import pytest

pytest.importorskip("torch", reason="the hw backend needs torch: pip install -e '.[hw]'")
pytest.importorskip("zmq")

import torch
from test_hw_disagg import experiment

from disagg.config import build_experiment
from disagg.hw.batch import Seq
from disagg.hw.decode import ColocatedServer
from disagg.hw.model import Transformer
from disagg.hw.protocol import NodeConfig, Submit
from disagg.hw.runner import Runner, _DecodeGraph
from disagg.hw.specs import small_gqa

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
PAGE = 4


def colocated_server(overlap: bool) -> ColocatedServer:
    """A real colocated server of the tiny model on this CPU, driven pass by pass here (its
    driver is not there: messages queue unsent); a token budget of 8, pages of 4 tokens."""
    data = experiment("tiny-gqa", "colocated", "HND", 8)
    exp = build_experiment(data, ["kv.pages=64", f"hw.latency.overlap={str(overlap).lower()}"])
    cfg = NodeConfig("colocated", 0, exp.model_dump(mode="json"), "tcp://127.0.0.1:1")
    return ColocatedServer(cfg)


@pytest.mark.parametrize("overlap", [True, False])
def test_a_server_plans_the_rows_its_decode_pass_leaves_one_position_on(overlap: bool) -> None:
    """Request 1: a 12-token prompt, 5 tokens out; request 2: 5 and 3. Passes: 1, request 1's
    first 8 prompt tokens; 2, its last 4 (its first token) and request 2's first 4; 3, request
    1's decode at 12 and request 2's last prompt token (its first token); 4, decodes alone at 13
    and 5, which plans both one position on (14 and 6); 5, which plans request 1 at 15 (request
    2 finishes on it); 6, request 1's last, which plans nothing. Each plan is on the request's
    own pages, with token 0 (not sampled yet). Without overlap nothing is planned."""
    server = colocated_server(overlap)
    planned: list[tuple[int, list[Seq], list[tuple[int, ...]]]] = []
    passes = 0

    def plan(batch: Sequence[Seq], in_flight: bool = False) -> bool:
        assert in_flight  # only while a pass runs
        owned = [tuple(server.pool.pages_of(r)) for r in (1, 2) if r in server.pool.owners]
        planned.append((passes, list(batch), owned))
        return True

    server.runner.plan_ahead = plan  # type: ignore[method-assign]
    try:
        server.on_message(Submit(1, 0.0, tuple(range(12)), 5))
        server.on_message(Submit(2, 0.0, tuple(range(20, 25)), 3))
        while server.step():
            passes += 1
    finally:
        server.control.close()
    assert passes == 6
    if not overlap:
        assert planned == []
        return
    (at4, rows4, (one, two)), (at5, rows5, owned5) = planned
    assert (at4, at5) == (3, 4)  # planned during passes 4 and 5 (0-based 3 and 4)
    assert (len(one), len(two)) == (5, 2)  # 12 + 5 and 5 + 3 tokens on pages of 4
    assert rows4 == [Seq((0,), 14, one), Seq((0,), 6, two)]
    assert rows5 == [Seq((0,), 15, one)] and owned5[0] == one


def test_a_graph_takes_a_plan_of_the_same_rows_and_writes_the_tokens_that_differ() -> None:
    """`_DecodeGraph.take` on a graph's packed inputs (a CPU tensor here): rows at the same
    positions, on the same pages, are the plan's, and their sampled tokens are written over the
    planned ones; rows one position off, on other pages or fewer are not."""
    graph = SimpleNamespace(packed=torch.zeros(12, dtype=torch.int64))
    planned = [Seq((0,), 5, (1, 2)), Seq((0,), 9, (3, 4, 6))]
    sampled = [Seq((17,), 5, (1, 2)), Seq((23,), 9, (3, 4, 6))]
    assert _DecodeGraph.take(graph, planned, sampled)  # type: ignore[arg-type]
    assert graph.packed[:3].tolist() == [17, 23, 0]  # the pad row's token is left as it was
    graph.packed.zero_()
    assert _DecodeGraph.take(graph, planned, planned)  # type: ignore[arg-type]
    assert not graph.packed.any()  # the same tokens: nothing written
    for other in (
        [Seq((17,), 6, (1, 2)), sampled[1]],
        [Seq((17,), 5, (1, 7)), sampled[1]],
        [Seq((17,), 5, (1, 2), dp_rank=1), sampled[1]],
        sampled[:1],
    ):
        assert not _DecodeGraph.take(graph, planned, other)  # type: ignore[arg-type]
    assert not graph.packed.any()


@gpu
@pytest.mark.gpu
def test_gpu_a_pass_planned_while_the_one_before_ran_gives_the_same_logits() -> None:
    """Three rows decode four passes, each step planning the next (`then`, tokens 0) while it
    runs: every pass gives, bit for bit, the logits of a runner that planned each pass as it
    came; the plans are used from the second pass on. Then a row finishes: the pass of the
    other two replays the graph of 2, which was planned while the pass of 3 ran."""
    m = Transformer(small_gqa(), seed=4, device="cuda")
    a, b = (Runner(m, m.new_cache(48, PAGE), graph_batches=(2, 4)) for _ in range(2))
    prompts = [[5, 9, 2, 7, 7, 1, 30, 4, 8], [11, 3, 6], [40, 41, 42, 43, 44, 45, 46]]
    pages = [tuple(range(16 * i, 16 * i + 16)) for i in range(3)]
    for r in (a, b):
        r.capture()  # as a server does at start: no capture while a pass runs
        r.step([Seq.of(p, 0, pages[i]) for i, p in enumerate(prompts)])
    tokens = [[7], [8], [9]]
    for step in range(5):
        rows = [i for i in range(3) if step < 4 or i != 1]  # row 1 finishes after pass 4
        batch = [Seq.of(tokens[i][-1:], len(prompts[i]) + step, pages[i]) for i in rows]
        ahead = [i for i in range(3) if step < 3 or i != 1]
        then = [Seq((0,), len(prompts[i]) + step + 1, pages[i]) for i in ahead]
        got = a.step(batch, sample=True, then=then)
        want = b.step(batch, sample=True)
        torch.testing.assert_close(got.logits, want.logits, atol=0, rtol=0)
        assert got.tokens == want.tokens and got.tokens is not None
        for i, tok in zip(rows, got.tokens, strict=True):
            tokens[i].append(tok)
    assert a.planned_ahead == 4 and b.planned_ahead == 0


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[gpu, pytest.mark.gpu])])
def test_a_chained_pass_takes_its_tokens_on_the_device_and_gives_the_same_logits(
    device: str,
) -> None:
    """hw.latency.chain on the runner: three rows decode five passes, each launched before the
    one before it is read, its tokens that pass's samples at its rows (`feed`); row 1 leaves
    after the third pass, so the fourth is fed rows 0 and 2 of the third (on a GPU, in the
    graph of 2). Every pass gives, bit for bit, the logits of a runner that ran each pass as
    it came with the tokens read on the host."""
    m = Transformer(small_gqa(), seed=4, device=device)
    a, b = (Runner(m, m.new_cache(48, PAGE), graph_batches=(2, 4)) for _ in range(2))
    prompts = [[5, 9, 2, 7, 7, 1, 30, 4, 8], [11, 3, 6], [40, 41, 42, 43, 44, 45, 46]]
    pages = [tuple(range(16 * i, 16 * i + 16)) for i in range(3)]
    for r in (a, b):
        r.capture()
        r.step([Seq.of(p, 0, pages[i]) for i, p in enumerate(prompts)])
    tokens = [[7], [8], [9]]
    rows = [0, 1, 2]
    first = [Seq.of(tokens[i][-1:], len(prompts[i]), pages[i]) for i in rows]
    assert a.chains(first)
    got = a.step(first, sample=True, read=False)
    for step in range(5):
        nxt = [i for i in rows if step < 2 or i != 1]
        after = [Seq((0,), len(prompts[i]) + step + 1, pages[i]) for i in nxt]
        chained = (
            a.step(after, sample=True, feed=(got, [rows.index(i) for i in nxt]), read=False)
            if step < 4
            else None
        )
        batch = [Seq.of(tokens[i][-1:], len(prompts[i]) + step, pages[i]) for i in rows]
        want = b.step(batch, sample=True)
        assert got.read() == want.tokens and want.tokens is not None
        torch.testing.assert_close(got.logits, want.logits, atol=0, rtol=0)
        for i, tok in zip(rows, want.tokens, strict=True):
            tokens[i].append(tok)
        if chained is not None:
            got, rows = chained, nxt

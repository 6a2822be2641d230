"""Eager passes in CUDA graphs between their attentions (`hw.latency.prefill_graphs`).

A pass with a prompt chunk runs eagerly: its attention's plan follows its sequences, so no one
graph fits it. Launched op by op, a Llama-3.1-8B forward takes the host 11-31 ms on an H200,
as long as a chunk of 400 tokens takes the device (benchmarks/results/2026-12-05b-gpu/), so
small chunks wait on their launch; a Qwen3-30B-A3B forward of 12 layers took 19-25 ms
(benchmarks/results/2026-12-06d-gpu/). Everything but the attention depends on the pass's token
count alone (an MoE layer's grouped experts too: their counts stay on the device).
`PrefillPieces` captures that work, for a padded size of `tokens` tokens, as one
graph per stretch between two attentions (`Transformer.piece`): the embedding and layer 0's
qkv; each layer's output projection, MLP and the next layer's qkv; the last layer's. A pass of
up to `tokens` tokens copies its inputs into the graphs' buffers, pads the rest (their K/V go
to the scratch page, their rows are dropped), and replays them with the attention between,
eager on its real rows. On the CPU the same pieces run uncaptured, for the tests.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from disagg.hw.attention import Attention
from disagg.hw.batch import StepTensors
from disagg.hw.cache import KVCache
from disagg.hw.model import ForwardOut, Transformer

TOKEN_INPUTS = ("input_ids", "positions", "slot_pages", "slot_offsets")  # StepTensors' per token


class PrefillPieces:
    """Passes of up to `tokens` new tokens of `model` over `cache`, their work between
    attentions captured in CUDA graphs (in `pool`, `on_layer` captured with each layer) when
    `capture`, else run as it comes (the CPU)."""

    def __init__(
        self,
        model: Transformer,
        cache: KVCache,
        tokens: int,
        on_layer: Callable[[], None] | None = None,
        pool: Any = None,
        capture: bool = True,
    ) -> None:
        self.model, self.cache, self.tokens = model, cache, tokens
        dev = model.device
        ids, pos, pages, offsets, none = (
            torch.zeros(n, dtype=torch.int64, device=dev) for n in (*[tokens] * 4, 0)
        )
        # the graphs' inputs: the pass's, then padding (TOKEN_INPUTS; no rows: `run` takes its)
        self.x = StepTensors(ids, pos, pages, offsets, none, none)
        self.x.slot_pages.fill_(cache.scratch_page)
        width = model.heads * model.spec.head_dim
        self.o = torch.zeros(tokens, width, dtype=model.dtype, device=dev)  # attention output
        self.h: torch.Tensor | None = None  # the hidden states after the last piece run
        self.q: list[torch.Tensor | None] = [None] * (len(model.layers) + 1)  # layer i's q
        self.tables = model.rope_tables(self.x.positions)  # piece 0's, at the pass's positions
        self.graphs: list[torch.cuda.CUDAGraph] = []
        if capture:  # on the current device's streams (the runner's)
            self._capture(on_layer, pool)
        self.on_layer = on_layer

    def _piece(self, i: int, on_layer: Callable[[], None] | None) -> None:
        if i == 0:
            self.tables = self.model.rope_tables(self.x.positions)
        args = (self.o, self.x, self.cache, self.tables, on_layer)
        self.h, self.q[i] = self.model.piece(i, self.h if i else None, *args)

    def _capture(self, on_layer: Callable[[], None] | None, pool: Any) -> None:
        """Each piece run once uncaptured (lazy initialisations, on a side stream, without
        `on_layer`), then captured. A piece reads the hidden states the one before it wrote, and
        the replays run in the order of the captures, so what a later capture reuses of the
        pool (a piece's hidden states once the next has read them) is never read again."""
        dev = self.model.device
        for i in range(len(self.q)):
            before = self.h  # the captured piece before's output: this one's input
            side = torch.cuda.Stream(dev)
            side.wait_stream(torch.cuda.current_stream(dev))
            with torch.cuda.stream(side), torch.inference_mode():
                self._piece(i, None)
            torch.cuda.current_stream(dev).wait_stream(side)
            self.h = before
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool), torch.inference_mode():
                self._piece(i, on_layer)
            self.graphs.append(graph)

    @torch.inference_mode()
    def run(self, x: StepTensors, attn: Attention) -> ForwardOut:
        """The pass of `x` (at most `tokens` new tokens; `attn` planned for it)."""
        n = x.input_ids.numel()
        for name in TOKEN_INPUTS:
            getattr(self.x, name)[:n].copy_(getattr(x, name))
        self.x.slot_pages[n:].fill_(self.cache.scratch_page)  # padding writes only there
        for i, q in enumerate(self.q):
            if self.graphs:
                self.graphs[i].replay()
            else:
                self._piece(i, self.on_layer)
                q = self.q[i]
            if q is not None:
                self.o[:n].copy_(attn.run(self.cache.layers[i], q[:n]).reshape(n, -1))
        assert self.h is not None
        return self.model.head(self.h, x)  # x's rows index its own tokens: none of the padding

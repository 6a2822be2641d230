"""Runs forward steps on a Transformer: eager for prefill and mixed steps, CUDA graphs for decode.

After each layer's attention output projection the step bumps a `LayerCounter` in-stream; a
`LayerWatcher` thread polls its host copy (no device sync) and reports progress, which is how
the messenger learns that a layer's KV pages may be sent while the step still runs.
"""

from __future__ import annotations

import contextlib
import math
import threading
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch

from disagg.errors import ConfigError
from disagg.hw.attention import FlashInferAttention, make_attention
from disagg.hw.batch import BatchMeta, Seq, StepTensors
from disagg.hw.cache import KVCache
from disagg.hw.device import on_device
from disagg.hw.model import ForwardOut, Transformer
from disagg.hw.pieces import PrefillPieces
from disagg.settings import pieces_size

GRAPH_BATCHES = (1, 2, 4, 8, 16, 32, 64, 128)


def graph_batch_for(graph_batches: Sequence[int], batch: int) -> int | None:
    """The graph size a decode step of `batch` sequences replays: the smallest of
    `graph_batches` that holds it (the rest of its rows are padding); None if none does."""
    return min((b for b in graph_batches if b >= batch), default=None)


def batches_to_capture(graph_batches: Sequence[int], max_batch: int) -> list[int]:
    """Every graph size that decode steps of 1..`max_batch` sequences replay, ascending."""
    sizes = {graph_batch_for(graph_batches, n) for n in range(1, max_batch + 1)}
    return sorted(b for b in sizes if b is not None)


class LayerCounter:
    """Layers completed since creation: bumped by the model, read by a polling thread.

    CUDA: a device int64 incremented in place, then copied non-blocking into pinned host memory;
    both are stream operations, so a CUDA graph captures them and the host value advances while
    the step runs. CPU: a plain host counter (CPU ops are synchronous).
    """

    def __init__(self, device: torch.device) -> None:
        cuda = device.type == "cuda"
        self.host = torch.zeros(1, dtype=torch.int64, pin_memory=cuda)
        self._view = self.host.numpy()
        self.dev = torch.zeros(1, dtype=torch.int64, device=device) if cuda else None

    def bump(self) -> None:
        if self.dev is None:
            self._view[0] += 1
        else:
            self.dev.add_(1)
            self.host.copy_(self.dev, non_blocking=True)

    def read(self) -> int:
        """The latest value that reached host memory (never waits for the device)."""
        return int(self._view[0])


class LayerWatcher:
    """A thread that calls `on_layers(n_done)` whenever the counter's host value changes.

    n_done is the total number of layers completed since the counter was created (step k of an
    L-layer model covers values k*L+1 .. (k+1)*L). Polling may skip values: a call means every
    layer up to n_done is done. An exception raised by `on_layers` stops the thread and is
    raised again by `stop()`.
    """

    def __init__(
        self,
        counter: LayerCounter,
        on_layers: Callable[[int], None],
        poll_interval_s: float = 50e-6,
    ) -> None:
        self.counter, self.on_layers, self.poll_interval_s = counter, on_layers, poll_interval_s
        self._stop = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._loop, name="layer-watcher", daemon=True)

    def _loop(self) -> None:
        last = self.counter.read()
        try:
            while not self._stop.is_set():
                now = self.counter.read()
                if now != last:
                    last = now
                    self.on_layers(now)
                else:
                    time.sleep(self.poll_interval_s)
        except BaseException as e:  # handed to stop()
            self._error = e

    def start(self) -> LayerWatcher:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
        if self._error is not None:
            raise self._error

    def __enter__(self) -> LayerWatcher:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


@dataclass
class StepOutput:
    """One step's results (device tensors unless noted).

    logits [B, vocab] float32 at each sequence's last new token; hidden [B, hidden] at its
    `hidden_at` token; tokens: greedy samples (host ints) when asked for and read (`read`);
    layers_before: the counter value when the step began (its layers are layers_before+1 ..
    layers_before+L); sampled [B] int64: the greedy samples on the device, when asked for
    (a chained step's inputs); launched: the host's clock around its forward (`launched`).
    """

    logits: torch.Tensor
    hidden: torch.Tensor
    tokens: list[int] | None
    layers_before: int
    sampled: torch.Tensor | None = None
    launched: tuple[float, float] = (math.nan, math.nan)
    timed: tuple[torch.cuda.Event, torch.cuda.Event] | None = None
    copied: tuple[torch.Tensor, torch.cuda.Event] | None = None  # sampled, on its way to host

    def read(self) -> list[int]:
        """The greedy samples as host ints, waiting for this step only (not for a step
        launched after it)."""
        if self.tokens is None:
            if self.copied is not None:
                host, done = self.copied
                done.synchronize()
                self.tokens = host.tolist()
            elif self.sampled is not None:
                self.tokens = self.sampled.tolist()
            else:
                raise ValueError("the step sampled no tokens")
        return self.tokens

    def device_s(self) -> float:
        """Seconds from the device reaching this step's forward to its end (see
        `Runner.device_s`); NaN on the CPU."""
        return _elapsed_s(self.timed)


def _elapsed_s(timed: tuple[torch.cuda.Event, torch.cuda.Event] | None) -> float:
    """Seconds between a step's two events, once the second is reached; NaN without them."""
    if timed is None:
        return math.nan
    start, end = timed
    end.synchronize()
    return start.elapsed_time(end) / 1e3


def _fed(input_ids: torch.Tensor, step: StepOutput, rows: Sequence[int]) -> None:
    """Write `step`'s samples at `rows` over the first tokens of `input_ids`, on the device."""
    if step.sampled is None:
        raise ValueError("a chained step follows a step that sampled its tokens")
    at = torch.tensor(rows, dtype=torch.int64)
    if step.sampled.is_cuda:  # pinned: the copy waits for nothing on the host
        at = at.pin_memory().to(step.sampled.device, non_blocking=True)
    input_ids[: len(rows)].copy_(step.sampled.index_select(0, at))


class _DecodeGraph:
    """A captured decode step for exactly `batch` rows; shorter batches are padded with rows
    that write and read only the cache's scratch page."""

    def __init__(self, runner: Runner, batch: int) -> None:
        self.runner, self.batch = runner, batch
        cache, dev = runner.cache, runner.device
        self.pad = Seq((0,), 0, (cache.scratch_page,))
        self.attn = FlashInferAttention(
            runner.shape,
            dev,
            graph_batch=batch,
            dtype=runner.model.dtype,
            max_pages=cache.num_pages + batch,
            workspace=runner.workspace,
            decode_kernel=getattr(runner.attn, "decode_kernel", None),
        )
        rows = [self.pad] * batch
        meta = BatchMeta.of(rows, cache.page_size, cache.num_pages)
        self.attn.plan(meta)
        self.packed = torch.from_numpy(StepTensors.pack(rows, meta)).to(dev)
        self.x = StepTensors.unpack(self.packed, batch)
        side = torch.cuda.Stream(dev)
        side.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(side):  # warm-up outside capture, without bumping the counter
            runner.model.forward_tensors(self.x, cache, self.attn)
        torch.cuda.current_stream(dev).wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=runner.graph_pool):
            self.out = runner.model.forward_tensors(self.x, cache, self.attn, runner.on_layer)

    def prepare(self, seqs: Sequence[Seq], in_flight: bool = False) -> None:
        """Plan attention and copy the inputs of `seqs` (padded) into the graph's buffers.
        `in_flight`: a pass runs on the device; the copies queue behind it, none waits for it."""
        cache = self.runner.cache
        rows = [*seqs, *[self.pad] * (self.batch - len(seqs))]
        meta = BatchMeta.of(rows, cache.page_size, cache.num_pages)
        self.attn.plan(meta, staged=in_flight)
        host = torch.from_numpy(StepTensors.pack(rows, meta)).pin_memory()
        self.packed.copy_(host, non_blocking=True)

    def take(self, planned: Sequence[Seq], seqs: Sequence[Seq]) -> bool:
        """Whether `seqs` are the rows `planned` (positions, pages, groups), their tokens aside;
        if so, their tokens are written into the graph's inputs where they differ (a plan made
        while the pass before ran lacks the tokens that pass samples)."""
        if len(planned) != len(seqs) or any(
            (p.start, p.pages, p.dp_rank, p.hidden_at, len(p.tokens))
            != (s.start, s.pages, s.dp_rank, s.hidden_at, len(s.tokens))
            for p, s in zip(planned, seqs, strict=True)
        ):
            return False
        tokens = [s.tokens[0] for s in seqs]
        if tokens != [p.tokens[0] for p in planned]:
            self.packed[: len(seqs)].copy_(torch.tensor(tokens, dtype=self.packed.dtype))
        return True

    def replay(self, n: int) -> ForwardOut:
        """Run the captured step; the first `n` rows are the real sequences."""
        self.graph.replay()
        return ForwardOut(self.out.logits[:n].clone(), self.out.hidden[:n].clone())


class Runner:
    """Forward steps of `model` over `cache`, counting layers in `counter` where
    `count_layers` (a prefill server's watcher follows it; nobody reads another role's, so it
    launches none of the counter's two ops a layer).

    attention: "auto" (FlashInfer on CUDA, the torch reference on CPU), "torch", "flashinfer"
    or "flashinfer:KERNEL" (the GQA decode kernel: fa2, cuda-cores, fa3; see attention.py).
    Pure decode steps of at most max(graph_batches) sequences replay a CUDA graph captured for
    the next larger size in `graph_batches` (CUDA + FlashInfer only; eager elsewhere).
    """

    def __init__(
        self,
        model: Transformer,
        cache: KVCache,
        *,
        attention: str = "auto",
        graph_batches: Sequence[int] = GRAPH_BATCHES,
        counter: LayerCounter | None = None,
        count_layers: bool = True,
        prefill_graphs: Sequence[int] = (),
    ) -> None:
        if len(cache.layers) != model.spec.layers:
            raise ConfigError(f"cache has {len(cache.layers)} layers, model {model.spec.layers}")
        if prefill_graphs and not model.piecewise:
            how = " on TP ranks" if model.tp else ""
            how += " with hw.moe=reference" if model.moes and model.moe != "grouped" else ""
            raise ConfigError(
                f"hw.latency.prefill_graphs {list(prefill_graphs)}: for GQA models on one rank "
                f"(their experts grouped) only, not {model.spec.name}{how}"
            )
        self.model, self.cache, self.device = model, cache, model.device
        self.shape = model.attn_shape(cache.page_size, cache.layout.layout)  # this rank's heads
        self.attn = make_attention(attention, self.shape, self.device, model.dtype)
        self.counter = counter or LayerCounter(self.device)
        self.on_layer = self.counter.bump if count_layers else None
        self.steps = 0
        graphs = isinstance(self.attn, FlashInferAttention)
        self.graph_batches = sorted(set(graph_batches)) if graphs else []
        self.workspace = self.attn.workspace if isinstance(self.attn, FlashInferAttention) else None
        self.graph_pool = torch.cuda.graph_pool_handle() if graphs else None
        self._graphs: dict[int, _DecodeGraph] = {}
        self.prefill_graphs = sorted(set(prefill_graphs))  # see disagg.hw.pieces
        self._pieces: dict[int, PrefillPieces] = {}
        self.passes_in_pieces = 0  # eager passes run in pieces (`prefill_graphs`)
        self.graph_error = ""
        self._staged: torch.cuda.Event | None = None
        self._timed: tuple[torch.cuda.Event, torch.cuda.Event] | None = None
        self._launched = (math.nan, math.nan)  # the host's clock around the last forward
        self._ahead: tuple[_DecodeGraph, tuple[Seq, ...]] | None = None  # see plan_ahead
        self.planned_ahead = 0  # steps that found their plan made ahead
        self.captured_on_demand = 0  # graphs captured when first needed, not by `capture`
        self.capture_s = 0.0  # wall time spent capturing graphs

    def capture(self, batches: Sequence[int] | None = None) -> None:
        """Capture decode graphs now (largest first, so smaller ones reuse its memory)."""
        for b in sorted(batches or self.graph_batches, reverse=True):
            self._graph(b)

    @property
    def captured(self) -> list[int]:
        """The batch sizes whose decode graphs are captured."""
        return sorted(self._graphs)

    def capture_up_to(self, max_batch: int) -> None:
        """Capture every graph a decode step of at most `max_batch` sequences replays, so that
        no step pays a capture (many times a step's time) when a batch size first occurs.
        Nothing where steps run eagerly."""
        sizes = batches_to_capture(self.graph_batches, max_batch)
        if sizes:
            self.capture(sizes)

    def capture_pieces(self) -> None:
        """Capture the graphs of every size of `prefill_graphs` now (largest first), so that no
        pass with a prompt chunk pays a capture."""
        for tokens in sorted(self.prefill_graphs, reverse=True):
            self._pieces_of(tokens)

    def _pieces_of(self, tokens: int) -> PrefillPieces | None:
        """The pieces of size `tokens`, captured now if need be (on a GPU; on the CPU they run
        as they come); None, and passes eager, once a capture failed (`graph_error`)."""
        if tokens not in self._pieces and not self.graph_error:
            pieces = partial(PrefillPieces, self.model, self.cache, tokens, self.on_layer)
            if self.graph_pool is None:  # nothing to capture
                self._pieces[tokens] = pieces(capture=False)
            else:
                self._captured(self._pieces, tokens, "prefill", partial(pieces, self.graph_pool))
        return self._pieces.get(tokens)

    def _graph(self, batch: int, on_demand: bool = False) -> _DecodeGraph | None:
        """The graph for `batch`, captured now if need be (`on_demand`: by a step or a plan
        ahead, which `captured_on_demand` counts)."""
        if batch not in self._graphs and not self.graph_error:
            self.captured_on_demand += on_demand
            self._captured(self._graphs, batch, "decode", partial(_DecodeGraph, self, batch))
        return self._graphs.get(batch)

    def _captured(
        self, into: dict[int, Any], key: int, what: str, capture: Callable[[], Any]
    ) -> None:
        """`into[key] = capture()` on this device's streams, its time in `capture_s`; if it
        fails, `graph_error` says why, and `what` runs eagerly from then on."""
        began = time.perf_counter()
        try:
            with on_device(self.device):
                into[key] = capture()
        except (RuntimeError, ValueError) as e:  # keep serving, eagerly, and say why
            self.graph_error = f"CUDA graph capture failed, {what} runs eagerly: {e}"
            warnings.warn(self.graph_error, stacklevel=4)
        self.capture_s += time.perf_counter() - began

    def _graph_for(self, batch: Sequence[Seq], capture: bool = True) -> _DecodeGraph | None:
        """The graph a decode pass of `batch` replays: captured now if need be (`capture`), or
        only one captured before."""
        if any(len(s.tokens) != 1 for s in batch):  # not a decode pass
            return None
        size = graph_batch_for(self.graph_batches, len(batch))
        if size is None:
            return None
        return self._graph(size, on_demand=True) if capture else self._graphs.get(size)

    def _mark_staged(self) -> None:
        if self.device.type == "cuda":
            self._staged = torch.cuda.Event()
            self._staged.record()

    @contextlib.contextmanager
    def _timing(self) -> Iterator[None]:
        """Events around the forward on CUDA (its inputs are staged before it): `device_s`;
        and the host's clock around it, on any device: `launched`."""
        self._timed = None  # a forward that raises leaves no timing of an earlier step
        self._launched = (math.nan, math.nan)
        began = time.time()
        if self.device.type != "cuda":
            yield
            self._launched = (began, time.time())
            return
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        yield
        end.record()
        self._timed = start, end
        self._launched = (began, time.time())

    def launched(self) -> tuple[float, float]:
        """When (`time.time()`) the host began to launch the last step's forward and when it
        had launched all of it: on CUDA an eager forward's every kernel, or one graph replay
        (the device runs them meanwhile, or after); on the CPU, which runs each op as it is
        called, the whole forward. NaN before a step."""
        return self._launched

    def device_s(self) -> float:
        """Seconds from the device reaching the last step's forward to its end (gaps where it
        waited for the host's launches count; waits for the step to end). NaN on the CPU,
        where a step's time is all host time."""
        return _elapsed_s(self._timed)

    def step(
        self,
        batch: Sequence[Seq],
        *,
        sample: bool = False,
        then: Sequence[Seq] = (),
        feed: tuple[StepOutput, Sequence[int]] | None = None,
        read: bool = True,
    ) -> StepOutput:
        """Append the batch's new tokens' K/V, and return logits (and greedy tokens if `sample`).
        `then`: the decode step expected next, planned ahead (`plan_ahead`) while this one runs
        on the device, before its tokens are read. `feed` (a step and rows of it): the first
        rows of `batch` are decode rows whose tokens are that step's samples at those rows,
        taken on the device (their own tokens are placeholders): a chained step, launched
        before the one it follows is read (`chains`). `read=False`: the samples stay on their
        way to the host until `StepOutput.read`, so that a step can be chained behind this one
        first."""
        with on_device(self.device):  # its streams, graphs and kernels, whatever is current
            return self._step(batch, sample, then, feed, read)

    def chains(self, batch: Sequence[Seq]) -> bool:
        """Whether a step of `batch` may be launched while the step before it runs (`feed`):
        on the CPU, whose steps run one after the other anyway, or where it replays a graph
        captured already (an eager step's attention plan would rewrite what the running step
        reads)."""
        return self.device.type != "cuda" or self._graph_for(batch, capture=False) is not None

    def warm_up(self, tokens: int, caches: Sequence[KVCache] = ()) -> None:
        """Run one eager pass of a prompt of `tokens` tokens (at most what the cache holds) over
        the first pages, then zero those pages again: in this runner's cache, and in `caches`,
        the other ranks' pages that the pass wrote, as their leader maps them. On a GPU a
        process's first pass pays one-time costs (library handles, workspaces, kernels loaded
        on first launch): a quarter of a second on an H200, which a server would otherwise
        put into its first request's TTFT. The step count (and, where it counts, the layer
        counter) moves on, as after any pass."""
        size = self.cache.page_size
        tokens = max(1, min(tokens, self.cache.num_pages * size))
        pages = tuple(range(math.ceil(tokens / size)))
        self.step([Seq.of([0] * tokens, 0, pages)])
        for cache in (self.cache, *caches):
            for layer in cache.layers:
                layer[: len(pages)].zero_()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def warm_chain(self) -> bool:
        """Run a decode pass of one row on the first page, then a pass chained behind it (fed
        its sample on the device), read both, and zero that page again: the path only a chained
        server takes (a pass left unread, its samples copied out to pinned memory, the next
        pass's tokens taken from them) loads its kernels and buffers now, where its first use
        would otherwise cost a server's first pass many times a pass's time. False (nothing
        done) where decode passes do not chain (`chains`: eager on a GPU)."""
        rows = [Seq.decode(0, 0, (0,))]
        if not self.chains(rows):
            return False
        first = self.step(rows, sample=True, read=False)
        second = self.step([Seq.decode(0, 1, (0,))], sample=True, feed=(first, [0]), read=False)
        first.read()
        second.read()
        for layer in self.cache.layers:
            layer[:1].zero_()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return True

    def plan_ahead(self, batch: Sequence[Seq], in_flight: bool = False) -> bool:
        """Prepare the decode step of `batch` now (attention plan, inputs in its graph's
        buffers), so that the next step, if it is of these rows, only replays the graph (after
        writing its tokens, where they differ from those planned). The plan reads page numbers
        and lengths, not the pages: a decoder with nothing to run plans a request's first pass
        while its KV is still inbound, which takes the planning's host time off its TTFT; and
        with `in_flight` (a step's `then`), the next pass is planned while this one runs.
        False (nothing done) where the step would not replay a graph, or, in flight, one not
        captured yet (no graph is captured while a pass runs)."""
        graph = self._graph_for(batch, capture=not in_flight)
        if graph is None:
            return False
        with on_device(self.device):
            self._prepare(graph, batch, in_flight)
        self._ahead = (graph, tuple(batch))
        return True

    def _prepare(self, graph: _DecodeGraph, batch: Sequence[Seq], in_flight: bool = False) -> None:
        self._wait_staged()
        graph.prepare(batch, in_flight)
        self._mark_staged()

    def _wait_staged(self) -> None:
        if self._staged is not None:
            # FlashInfer's plan() refills a pinned staging buffer that the previous step's
            # host-to-device copy may not have read yet: wait until it has (not for the step).
            self._staged.synchronize()

    def _step(
        self,
        batch: Sequence[Seq],
        sample: bool,
        then: Sequence[Seq],
        feed: tuple[StepOutput, Sequence[int]] | None,
        read: bool,
    ) -> StepOutput:
        before = self.steps * self.model.spec.layers
        group = self.model.group_rows(batch, self.cache)  # DP attention: eager
        graph = self._graph_for(batch) if group is None else None
        ahead, self._ahead = self._ahead, None  # any step uses up a plan made ahead
        if graph is not None:
            if ahead is not None and ahead[0] is graph and graph.take(ahead[1], batch):
                self.planned_ahead += 1
            else:
                self._prepare(graph, batch, in_flight=feed is not None)
            if feed is not None:
                _fed(graph.x.input_ids, *feed)
            with self._timing():
                out = graph.replay(len(batch))
        else:
            self._wait_staged()
            x = self.model.planned_inputs(batch, self.cache, self.attn, group)
            self._mark_staged()
            if feed is not None:
                _fed(x.input_ids, *feed)
            size = pieces_size(self.prefill_graphs, x.input_ids.numel())
            pieces = None if size is None else self._pieces_of(size)
            with self._timing():
                if pieces is not None:
                    out = pieces.run(x, self.attn)
                    self.passes_in_pieces += 1
                else:
                    out = self.model.forward_tensors(
                        x, self.cache, self.attn, self.on_layer, group=group
                    )
        self.steps += 1
        res = StepOutput(
            out.logits, out.hidden, None, before, launched=self._launched, timed=self._timed
        )
        if sample:
            res.sampled = out.logits.argmax(-1)
            if self.device.type == "cuda" and not read:
                host = torch.empty(len(batch), dtype=torch.int64, pin_memory=True)
                host.copy_(res.sampled, non_blocking=True)
                res.copied = (host, torch.cuda.Event())
                res.copied[1].record()
        if then:  # host work while the device runs this step: its copies queue behind it
            self.plan_ahead(then, in_flight=True)
        if sample and read:
            res.read()
        return res

"""One GPU that several simulated nodes share (`cluster.shared_gpu`), as the processes of a hw
run on a single device do. The GPU time-slices between them, so passes that overlap take longer
than alone. Three rules say how much; a pass alone always runs at full speed.

- **Turns** (`cluster.turn_slice_s` set; `TurnGPU`): what kernel timelines of both servers
  on one H200 and one H100 showed. The GPU runs one process's work at a time: a chunk pass a
  layer a turn, a decode pass `turn_slice_s` of device time a turn and a yield before and
  after it; a chunk beside decodes advances a layer at each of their yields.
- **Round robin** (`cluster.switch_s` set): the processes' kernels take turns, one each, with a
  cost to every turn, so each pass advances at its alone time's part of the alone times of all
  the passes running plus `switch_s` for every two of them (`round_robin`). A prefill pass beside
  back-to-back decode passes then takes its time plus theirs plus `switch_s`, whatever its size,
  and a decode pass inside a prefill pass ends with it, as measured on one H200
  (docs/calibration.md).
- **Weights** (the default): a decode-only pass weighs `cluster.decode_share` and one with a
  prompt chunk `cluster.prefill_share`, and each advances at its weight's part of the GPU's
  capacity, the two weights' sum, at most at full speed (`pace`). Unset, prefill_share is
  1 - decode_share, so the capacity is 1 and the GPU's work is conserved; above that, passes
  beside each other do more than one GPU's work alone would. A pass with a prompt chunk that
  meets another pass, beside it at its start or begun later, also has `cluster.chunk_extra_s`
  more work to do, once: on one H100, a Llama-3.1-8B prefill pass beside a decode server took
  its time alone at nearly full pace plus about 50 ms, 256 tokens or 2,048, eager or in
  pieces, its KV sent layer by layer or whole; and a 2,048-token pass that began alone and
  then met a decode pass took as long as one that began beside it, on an H100 and an H200
  (docs/calibration.md). With `cluster.chunk_extra_shape` the extra follows the pass's time
  alone: a Qwen3-30B-A3B pass took 14-17 ms more up to 19 ms alone and 29-33 ms more at
  29 ms (benchmarks/results/2026-12-06d-gpu/). With `cluster.chunk_extra_wide` the extra
  beside a decode pass of more than EXTRA_YIELD_SEQS sequences (the first the chunk pass
  meets), which yields the GPU once more a pass, is that factor of it: a Llama-3.1-8B chunk
  pass beside chained decodes on one H100 took 66-74 ms more beside up to 16 sequences and
  58-64 ms beside more (docs/calibration.md). With `cluster.decode_share_shape` a decode
  pass's weight follows the time alone of the chunk pass beside it: on one H100 a
  Llama-3.1-8B decode pass ran at 0.62 of its pace alone beside a chunk of 13 ms alone, 0.53
  beside 26 ms and 0.40 beside 45 ms, in every run (benchmarks/results/2026-12-06f-gpu/).
  With `cluster.decode_share_wide` a decode pass of more than EXTRA_YIELD_SEQS sequences
  beside a chunk pass weighs that factor of its share: it yields the GPU once more a pass,
  and a chained decode server's then waits that much longer beside a chunk (on one H100,
  Llama-3.1-8B's chained passes beside chunks showed 0.92-0.93: docs/calibration.md)."""

from __future__ import annotations

import math
from collections.abc import Generator, Sequence
from typing import Any

import numpy as np

from disagg.sim.clock import Clock, Signal

# a decode pass of more sequences yields once more before its device time: its host issues
# its copies in more groups (a kernel timeline on one H100: 4 yields a pass above 16, 3 below;
# benchmarks/results/2026-12-06-gpu)
EXTRA_YIELD_SEQS = 16


def pace(weight: float, total: float, capacity: float) -> float:
    """The pace of a pass of `weight` among running passes of `total` weight (its own
    included) on a GPU of `capacity`: its weight's part of the capacity, at most 1; alone, 1."""
    return 1.0 if total == weight else min(1.0, capacity * weight / total)


def round_robin(alone_s: float, total_s: float, passes: int, switch_s: float) -> float:
    """The pace of a pass of `alone_s` among `passes` running passes of `total_s` alone
    seconds (its own included) whose kernels take turns at `switch_s` for every two: its part
    of all their time plus the turns' cost; alone, 1."""
    return 1.0 if passes == 1 else alone_s / (total_s + switch_s * passes / 2)


class _OneGPU:
    """What both rules' GPUs do alike: `run` (a light process's `yield from`) puts a pass's host
    time around its device time (`_device`, each rule's), and counts what sharing added."""

    def __init__(self, env: Clock, host_before: float) -> None:
        self.env = env
        self.host_before = host_before  # the part of a pass's host time before its device time
        self.shared = 0  # passes that ran beside another
        self.lost_s = 0.0  # what sharing added to them, all together

    def run(
        self, seconds: float, decode_only: bool, host_s: float | None = None, seqs: int = 0
    ) -> Generator[Any, Any, None]:
        """A pass of `seconds` on the device (`seqs`: a decode pass's sequences) and, if given,
        `host_s` on the host, which takes no turns: `host_before` of it before the device
        time, the rest after."""
        env, before = self.env, self.host_before
        if host_s:
            yield host_s * before
        t0 = env._now
        yield from self._device(seconds, decode_only, seqs)
        if env._now - t0 > seconds * (1 + 1e-9):
            self.shared += 1
            self.lost_s += env._now - t0 - seconds
        if host_s and before < 1:
            yield host_s * (1 - before)

    def _device(self, seconds: float, decode_only: bool, seqs: int) -> Generator[Any, Any, None]:
        raise NotImplementedError


class SharedGPU(_OneGPU):
    """The passes running on one GPU: `run` takes as long as `seconds` of the GPU to itself
    take at the paces the passes beside it leave."""

    def __init__(
        self,
        env: Clock,
        decode_share: float,
        prefill_share: float | None = None,
        switch_s: float | None = None,
        host_before: float = 1.0,
        chunk_extra_s: float = 0.0,
        chunk_extra_shape: Sequence[tuple[float, float]] = (),
        decode_share_shape: Sequence[tuple[float, float]] = (),
        chunk_extra_wide: float = 1.0,
        decode_share_wide: float = 1.0,
    ) -> None:
        super().__init__(env, host_before)
        prefill = 1.0 - decode_share if prefill_share is None else prefill_share
        self.weights = (decode_share, prefill)  # decode-only, with a prompt chunk
        self.conserved = prefill_share is None  # the capacity 1, whatever the decode weight
        self.switch_s = switch_s  # set: round robin, each pass weighing its seconds alone
        self.chunk_extra_s = 0.0 if switch_s is not None else chunk_extra_s
        self.extra_shape = _points(chunk_extra_shape)  # none: every pass adds chunk_extra_s
        self.extra_wide = chunk_extra_wide  # its factor beside a wide decode pass (`extra_s`)
        self.share_shape = _points(() if switch_s is not None else decode_share_shape)
        self.share_wide = decode_share_wide  # a wide decode pass's factor of its weight
        # pass -> [seconds of work left, weight, decode-only, the decode share's factor
        # beside it (`share_factor`), a decode pass's sequences]
        self.running: dict[Signal, list[Any]] = {}
        # passes with a chunk that have met no other pass yet -> their time alone
        self.alone: dict[Signal, float] = {}
        self.at = 0.0  # when the work left was last brought up to date
        self.turn = 0  # the completion timer set last (earlier ones are stale)

    def weight(self, seconds: float, decode_only: bool) -> float:
        if self.switch_s is not None:
            return seconds
        return self.weights[0] if decode_only else self.weights[1]

    def extra_s(self, seconds: float, seqs: int = 0) -> float:
        """The work a pass with a chunk of `seconds` alone adds once it meets another pass, the
        first a decode pass of `seqs` sequences (0: a pass with a chunk): `chunk_extra_s`,
        times the shape's factor at `seconds`, and `chunk_extra_wide` beside more than
        EXTRA_YIELD_SEQS."""
        if not self.chunk_extra_s:
            return 0.0
        wide = self.extra_wide if seqs > EXTRA_YIELD_SEQS else 1.0
        return self.chunk_extra_s * _factor(self.extra_shape, seconds) * wide

    def share_factor(self, seconds: float, decode_only: bool) -> float:
        """The decode share's factor beside a pass with a chunk of `seconds` alone (the shape's
        there); 1 for a decode-only pass, which sets no factor."""
        return 1.0 if decode_only else _factor(self.share_shape, seconds)

    def paces(self, passes: Sequence[Sequence[Any]]) -> list[float]:
        """The paces of `passes` ([work left, weight, decode-only, share factor, sequences] each)
        running together. Round robin: each its seconds' part of all theirs plus the turns' cost.
        Weights: each its weight's part of the capacity, at most 1, where a decode-only pass
        weighs the decode share times the mean factor of the passes with a chunk beside it
        (and, of more than EXTRA_YIELD_SEQS sequences, `decode_share_wide`), and the capacity
        is the two shares' sum."""
        if self.switch_s is not None:
            total = sum(p[1] for p in passes)
            return [round_robin(p[1], total, len(passes), self.switch_s) for p in passes]
        chunks = [p[3] for p in passes if not p[2]]
        f = sum(chunks) / len(chunks) if chunks else 1.0
        wide = self.share_wide if chunks else 1.0
        weights = [
            p[1] * f * (wide if p[4] > EXTRA_YIELD_SEQS else 1) if p[2] else p[1] for p in passes
        ]
        total = sum(weights)
        capacity = 1.0 if self.conserved else self.weights[0] * f + self.weights[1]
        return [pace(w, total, capacity) for w in weights]

    def work_s(self, seconds: float, decode_only: bool) -> float:
        """The work of a pass of `seconds` alone started now: with a prompt chunk beside
        another pass, its `extra_s` more (beside the widest decode pass running)."""
        if decode_only or not self.running:
            return seconds
        return seconds + self.extra_s(seconds, max(p[4] for p in self.running.values()))

    def _meet(self, seqs: int) -> None:
        """A pass of `seqs` decode sequences begins: the passes with a chunk that began alone
        and have met no other pass until now take their extra work."""
        for p, seconds in self.alone.items():
            self.running[p][0] += self.extra_s(seconds, seqs)
        self.alone.clear()

    def expected_s(self, seconds: float, decode_only: bool) -> float:
        """How long a pass of `seconds` started now would take if the passes running now ran
        throughout (the layer-wise KV sends of a prefill pass keep that pace)."""
        work = self.work_s(seconds, decode_only)
        factor = self.share_factor(seconds, decode_only)
        new = [work, self.weight(work, decode_only), decode_only, factor, 0]
        return work / self.paces([new, *self.running.values()])[0]

    def _device(self, seconds: float, decode_only: bool, seqs: int) -> Generator[Any, Any, None]:
        self._advance()
        done = self.env.event()
        work = self.work_s(seconds, decode_only)
        self._meet(seqs if decode_only else 0)
        if not decode_only and not self.running:
            self.alone[done] = seconds
        factor = self.share_factor(seconds, decode_only)
        self.running[done] = [work, self.weight(work, decode_only), decode_only, factor, seqs]
        self._schedule()
        yield done

    def _advance(self) -> None:
        now = self.env._now
        if self.running:
            passes = list(self.running.values())
            for p, at in zip(passes, self.paces(passes), strict=True):
                p[0] -= (now - self.at) * at
        self.at = now

    def _schedule(self) -> None:
        """Set a timer for the first of the running passes to end at the present paces."""
        self.turn += 1
        if not self.running:
            return
        paces = self.paces(list(self.running.values()))
        ends = {s: p[0] / at for (s, p), at in zip(self.running.items(), paces, strict=True)}
        first = min(ends, key=ends.__getitem__)
        turn = self.turn
        self.env.call(max(0.0, ends[first]), lambda: self._end(turn, first))

    def _end(self, turn: int, first: Signal) -> None:
        if turn != self.turn:
            return  # a pass began or ended since this timer was set
        self._advance()
        del self.running[first]
        self.alone.pop(first, None)
        first.succeed()
        self._schedule()


def _points(shape: Sequence[tuple[float, float]]) -> tuple[np.ndarray, np.ndarray]:
    """A shape's (seconds, factor) points as two arrays."""
    return np.array([s for s, _ in shape], float), np.array([f for _, f in shape], float)


def _factor(shape: tuple[np.ndarray, np.ndarray], seconds: float) -> float:
    """A shape's factor at `seconds`, interpolated and held at the ends; 1 without points."""
    return float(np.interp(seconds, *shape)) if len(shape[0]) else 1.0


class TurnGPU(_OneGPU):
    """The turns rule (`cluster.turn_slice_s` set): the GPU runs one process's work at a time
    and passes to the next process with work queued at each turn's end, `switch_s` apart, as
    kernel timelines of both servers on one H200 and one H100 showed (docs/calibration.md):
    - a pass with a prompt chunk takes `chunk_turns` turns, one a layer (the model's layers and
      two more) of its time alone over that many: it yields the GPU after each;
    - a decode-only pass yields after every `slice_s` of device time it has run, and once just
      before its device time and once just after it (where its host waits on a copy), and of
      more than EXTRA_YIELD_SEQS sequences once more before; its host time (`host_before` of
      it first, the rest after) runs beside the other's turns.
    So beside decode passes a chunk advances a layer at each of their yields, and its last
    layer most often ends in one of their gaps, by the end of the decode pass in flight; and
    a pass alone runs at full speed, in its own turns back to back."""

    def __init__(
        self, env: Clock, slice_s: float, switch_s: float, chunk_turns: int, host_before: float
    ) -> None:
        super().__init__(env, host_before)
        self.slice_s, self.switch_s, self.chunk_turns = slice_s, switch_s, chunk_turns
        self.queues: dict[Signal, list[float]] = {}  # pass -> its turns left, last first
        self.owner: Signal | None = None  # the pass whose turn is running (None: GPU idle)
        self.last: Signal | None = None  # the pass whose turn ran last
        self.decode_s, self.decode_seqs = 0.0, 0  # the last decode pass's, for `expected_s`
        self.decode_end = -math.inf  # and when it ended

    def turns(self, seconds: float, decode_only: bool, seqs: int = 0) -> list[float]:
        """A pass's turns in order (`seqs`: a decode pass's sequences): a zero turn is a
        yield with no work."""
        if not decode_only:
            return [seconds / self.chunk_turns] * self.chunk_turns
        whole, rest = divmod(seconds, self.slice_s)
        before = [0.0] * (2 if seqs > EXTRA_YIELD_SEQS else 1)
        return [*before, *[self.slice_s] * int(whole), *([rest] if rest > 1e-12 else []), 0.0]

    def expected_s(self, seconds: float, decode_only: bool) -> float:
        """How long a chunk pass of `seconds` started now would take beside back-to-back decode
        passes like the last one, if one is running: a layer at each of their yields."""
        beside = bool(self.queues) or self.env._now - self.decode_end < self.slice_s
        if decode_only or not beside or not self.decode_s:
            return seconds
        yields = len(self.turns(self.decode_s, True, self.decode_seqs))  # a chunk's turns a pass
        per_layer = seconds / self.chunk_turns + 2 * self.switch_s
        return self.chunk_turns * per_layer + self.chunk_turns / yields * self.decode_s

    def _device(self, seconds: float, decode_only: bool, seqs: int) -> Generator[Any, Any, None]:
        """The pass's turns (`turns`), round robin with the others'."""
        if decode_only:
            self.decode_s, self.decode_seqs = seconds, seqs
        done = self.env.event()
        self.queues[done] = self.turns(seconds, decode_only, seqs)[::-1]
        if self.owner is None:
            self._next()
        yield done
        if decode_only:
            self.decode_end = self.env._now

    def _next(self) -> None:
        """Start the next turn: of the pass after the last one to run that has turns left
        (round robin in arrival order), `switch_s` later if the GPU goes from one pass's turn
        straight to another's."""
        order = list(self.queues)
        if not order:
            self.owner = None
            return
        at = order.index(self.last) + 1 if self.last in self.queues else 0
        p = order[at % len(order)]
        switch = self.switch_s if self.owner is not None and self.last is not p else 0.0
        work = self.queues[p].pop()
        self.owner = self.last = p
        self.env.call(switch + work, self._turn_done)

    def _turn_done(self) -> None:
        p = self.owner
        assert p is not None
        if not self.queues[p]:
            del self.queues[p]
            p.succeed()
        self._next()

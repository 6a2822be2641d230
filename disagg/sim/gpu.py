"""One GPU that several simulated nodes share (`cluster.shared_gpu`), as the processes of a hw
run on a single device do. The GPU time-slices between them (measured on one H200: a decode
pass that meets another process's prefill pass is slowed, neither run at full speed nor held
for the rest of it, docs/calibration.md), so passes that overlap share it by weight: each
advances at its weight over the weights of the passes running, a decode-only pass weighing
`cluster.decode_share` and one with a prompt chunk the rest of one. A pass alone runs at full
speed; the GPU's work is conserved."""

from __future__ import annotations

from collections.abc import Generator
from typing import Any

from disagg.sim.clock import Clock, Signal


class SharedGPU:
    """The passes running on one GPU: `run` (a light process's `yield from`) takes as long as
    `seconds` of the GPU to itself take at the shares the passes beside it leave."""

    def __init__(self, env: Clock, decode_share: float) -> None:
        self.env = env
        self.weights = (decode_share, 1.0 - decode_share)  # decode-only, with a prompt chunk
        self.running: dict[Signal, list[float]] = {}  # pass -> [seconds of work left, weight]
        self.at = 0.0  # when the work left was last brought up to date
        self.turn = 0  # the completion timer set last (earlier ones are stale)
        self.shared = 0  # passes that ran beside another
        self.lost_s = 0.0  # what sharing added to them, all together

    def weight(self, decode_only: bool) -> float:
        return self.weights[0] if decode_only else self.weights[1]

    def expected_s(self, seconds: float, decode_only: bool) -> float:
        """How long a pass of `seconds` started now would take if the passes running now ran
        throughout (the layer-wise KV sends of a prefill pass keep that pace)."""
        w = self.weight(decode_only)
        return seconds * (w + sum(p[1] for p in self.running.values())) / w

    def run(self, seconds: float, decode_only: bool) -> Generator[Any, Any, None]:
        env = self.env
        self._advance()
        done, t0 = env.event(), env._now
        self.running[done] = [seconds, self.weight(decode_only)]
        self._schedule()
        yield done
        if env._now - t0 > seconds * (1 + 1e-9):
            self.shared += 1
            self.lost_s += env._now - t0 - seconds

    def _advance(self) -> None:
        now = self.env._now
        if self.running:
            total = sum(p[1] for p in self.running.values())
            for p in self.running.values():
                p[0] -= (now - self.at) * p[1] / total
        self.at = now

    def _schedule(self) -> None:
        """Set a timer for the first of the running passes to end at the present shares."""
        self.turn += 1
        if not self.running:
            return
        total = sum(p[1] for p in self.running.values())
        first, (left, w) = min(self.running.items(), key=lambda item: item[1][0] / item[1][1])
        turn = self.turn
        self.env.call(max(0.0, left * total / w), lambda: self._end(turn, first))

    def _end(self, turn: int, first: Signal) -> None:
        if turn != self.turn:
            return  # a pass began or ended since this timer was set
        self._advance()
        del self.running[first]
        first.succeed()
        self._schedule()

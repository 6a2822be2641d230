"""One GPU that several simulated nodes share (`cluster.shared_gpu`), as the processes of a hw
run on a single device do: a pass runs only while no other node's pass holds the GPU, and
nodes waiting for it take their turns in the order they asked. Whole turns are the first-order
model: on one H200 the processes' passes time-slice, so a decode pass that meets a prefill pass
is slowed, not held for all of it (docs/calibration.md)."""

from __future__ import annotations

from collections import deque
from collections.abc import Generator
from typing import Any

from disagg.sim.clock import Clock, Signal


class SharedGPU:
    """Turns on one GPU: `take` (a light process's `yield from`) returns once the GPU is this
    caller's; `give` hands it to the next waiting, or leaves it free."""

    def __init__(self, env: Clock) -> None:
        self.env = env
        self.held = False
        self.waiting: deque[Signal] = deque()
        self.waits = 0  # passes that waited for another node's pass
        self.waited_s = 0.0  # and how long, all together

    def take(self) -> Generator[Any, Any, None]:
        if not self.held:
            self.held = True
            return
        turn, asked = self.env.event(), self.env._now
        self.waiting.append(turn)
        yield turn
        self.waits += 1
        self.waited_s += self.env._now - asked

    def give(self) -> None:
        if self.waiting:
            self.waiting.popleft().succeed()  # still held: now by the next in line
        else:
            self.held = False

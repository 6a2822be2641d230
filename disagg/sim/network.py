"""NICs as processor-sharing servers: bandwidth, latency, per-operation cost, fair sharing.

A flow is a set of parts, one per NIC it leaves through; each part is an amount of NIC work in
seconds (bytes / bandwidth + ops * op_cost). A NIC serves all its active parts at once, each at
1/n of its rate (fair sharing). A flow completes when all its parts are done, plus the NIC's
latency, and never before its `not_before_s` (layer-wise transfers cannot finish before their
last layer is produced). Only flow arrivals and completions are events: the model keeps one
pending timeout, however many flows are in progress.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Mapping
from dataclasses import dataclass, field
from typing import Any

import simpy

from disagg.hardware import NIC

EPS = 1e-12


@dataclass(eq=False)
class _Flow:
    parts_left: int
    done: simpy.Event
    not_before_s: float
    latency_s: float


@dataclass(eq=False)
class _Part:
    flow: _Flow
    work_s: float  # remaining NIC time at full rate


@dataclass
class _Nic:
    spec: NIC
    parts: list[_Part] = field(default_factory=list)
    busy_s: float = 0.0  # time with at least one active part
    rate: float = 1.0  # fraction of the NIC's bandwidth it moves (a fault: down 0, degraded)


def _succeed(event: simpy.Event) -> None:
    event.succeed()


class Network:
    """All NICs of a cluster, keyed by anything hashable, e.g. (node, nic index)."""

    def __init__(self, env: simpy.Environment) -> None:
        self.env = env
        self.nics: dict[Hashable, _Nic] = {}
        self._last_s = 0.0
        self._generation = 0

    def add_nic(self, key: Hashable, spec: NIC) -> None:
        self.nics[key] = _Nic(spec)

    def work_s(self, key: Hashable, nbytes: float, ops: float) -> float:
        """NIC time at full rate for `nbytes` bytes in `ops` work requests."""
        spec = self.nics[key].spec
        return nbytes / spec.bandwidth_bps + ops * spec.op_cost_s

    def set_rate(self, key: Hashable, rate: float) -> None:
        """From now on the NIC moves `rate` of its bandwidth (0: down, 1: healthy)."""
        self._advance()
        self.nics[key].rate = rate
        self._reschedule()

    def transfer(self, work: Mapping[Any, float], not_before_s: float = 0.0) -> simpy.Event:
        """Start a flow now with `work[nic]` seconds of NIC time per NIC; returns its event."""
        self._advance()
        parts = {k: w for k, w in work.items() if w > 0}
        latency = max((self.nics[k].spec.latency_s for k in parts), default=0.0)
        flow = _Flow(len(parts), self.env.event(), not_before_s, latency)
        for key, w in parts.items():
            self.nics[key].parts.append(_Part(flow, w))
        if not parts:
            self._finish(flow)
        self._reschedule()
        return flow.done

    def _advance(self) -> None:
        """Serve every active part for the time since the last update."""
        dt = self.env.now - self._last_s
        self._last_s = self.env.now
        if dt <= 0:
            return
        for nic in self.nics.values():
            if nic.parts:
                nic.busy_s += dt
                share = dt * nic.rate / len(nic.parts)
                for part in nic.parts:
                    part.work_s -= share

    def _reschedule(self) -> None:
        nxt = math.inf
        for nic in self.nics.values():
            if nic.parts and nic.rate > 0:
                nxt = min(nxt, min(p.work_s for p in nic.parts) * len(nic.parts) / nic.rate)
        if nxt == math.inf:
            return
        self._generation += 1
        gen = self._generation
        timer = self.env.timeout(max(nxt, 0.0))
        timer.callbacks.append(lambda _: self._on_timer(gen))

    def _on_timer(self, gen: int) -> None:
        if gen != self._generation:
            return  # superseded by a later arrival
        self._advance()
        for nic in self.nics.values():
            done = [p for p in nic.parts if p.work_s <= EPS * max(1.0, len(nic.parts))]
            if done:
                nic.parts = [p for p in nic.parts if p not in done]
                for part in done:
                    part.flow.parts_left -= 1
                    if part.flow.parts_left == 0:
                        self._finish(part.flow)
        self._reschedule()

    def _finish(self, flow: _Flow) -> None:
        at = max(self.env.now + flow.latency_s, flow.not_before_s)
        if at <= self.env.now:
            flow.done.succeed()
        else:
            timer = self.env.timeout(at - self.env.now)
            timer.callbacks.append(lambda _: _succeed(flow.done))

    def utilisation(self, key: Hashable) -> float:
        """Fraction of the elapsed simulated time the NIC had work."""
        self._advance()
        return self.nics[key].busy_s / self.env.now if self.env.now else 0.0

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
from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass
from typing import Any

import simpy

from disagg.hardware import NIC

EPS = 1e-12


@dataclass(eq=False)
class _Flow:
    parts_left: int
    done: simpy.Event | None  # succeeds at the end (`transfer`)
    not_before_s: float
    latency_s: float
    then: Callable[[], None] | None = None  # called at the end instead (`transfer_then`)


@dataclass(eq=False)
class _State:
    """What a NIC is doing: `work_s[i]` seconds left (at full rate) of the part of `flows[i]`,
    served at `rate`. Never changed in place, only replaced: NICs in the same state share one,
    and the work of identical NICs (a flow spread evenly over a node's NICs) is done once."""

    work_s: list[float]
    flows: list[_Flow]
    rate: float  # fraction of the NIC's bandwidth it moves (a fault: down 0, degraded)


@dataclass
class _Nic:
    spec: NIC
    state: _State
    busy_s: float = 0.0  # time with at least one active part

    @property
    def rate(self) -> float:
        return self.state.rate


def _succeed(event: simpy.Event) -> None:
    event.succeed()


class Network:
    """All NICs of a cluster, keyed by anything hashable, e.g. (node, nic index)."""

    def __init__(self, env: simpy.Environment) -> None:
        self.env = env
        self.nics: dict[Hashable, _Nic] = {}
        self._order: dict[Hashable, int] = {}  # a NIC's place in `nics`
        self._active: dict[Hashable, _Nic] = {}  # the NICs with parts (any order)
        self._idle: dict[float, _State] = {}  # the state of an idle NIC, by rate
        self._last_s = 0.0
        self._generation = 0

    def _idle_state(self, rate: float) -> _State:
        state = self._idle.get(rate)
        if state is None:
            state = self._idle[rate] = _State([], [], rate)
        return state

    def add_nic(self, key: Hashable, spec: NIC) -> None:
        self._order.setdefault(key, len(self._order))
        self.nics[key] = _Nic(spec, self._idle_state(1.0))

    def work_s(self, key: Hashable, nbytes: float, ops: float) -> float:
        """NIC time at full rate for `nbytes` bytes in `ops` work requests."""
        spec = self.nics[key].spec
        return nbytes / spec.bandwidth_bps + ops * spec.op_cost_s

    def set_rate(self, key: Hashable, rate: float) -> None:
        """From now on the NIC moves `rate` of its bandwidth (0: down, 1: healthy)."""
        self._advance()
        nic = self.nics[key]
        st = nic.state
        nic.state = _State(st.work_s, st.flows, rate) if st.flows else self._idle_state(rate)
        self._reschedule()

    def transfer(self, work: Mapping[Any, float], not_before_s: float = 0.0) -> simpy.Event:
        """Start a flow now with `work[nic]` seconds of NIC time per NIC; returns its event."""
        flow = _Flow(0, self.env.event(), not_before_s, 0.0)
        self._start(flow, work)
        assert flow.done is not None
        return flow.done

    def transfer_then(
        self, work: Mapping[Any, float], not_before_s: float, then: Callable[[], None]
    ) -> None:
        """`transfer`, calling `then()` when the flow ends (no event in between when the end
        waits for the latency or `not_before_s`, from the timer that ends it)."""
        self._start(_Flow(0, None, not_before_s, 0.0, then), work)

    def _start(self, flow: _Flow, work: Mapping[Any, float]) -> None:
        self._advance()
        latency, parts = -math.inf, 0
        added: dict[tuple[_State, float], _State] = {}
        for key, w in work.items():
            if w > 0:
                nic = self.nics[key]
                latency = max(latency, nic.spec.latency_s)
                st = nic.state
                new = added.get((st, w))
                if new is None:
                    new = added[(st, w)] = _State([*st.work_s, w], [*st.flows, flow], st.rate)
                nic.state = new
                self._active[key] = nic
                parts += 1
        flow.parts_left, flow.latency_s = parts, latency if parts else 0.0
        if not parts:
            self._finish(flow)
        self._reschedule()

    def _advance(self) -> None:
        """Serve every active part for the time since the last update."""
        dt = self.env._now - self._last_s
        self._last_s = self.env._now
        if dt <= 0:
            return
        served: dict[_State, _State] = {}
        for nic in self._active.values():
            nic.busy_s += dt
            st = nic.state
            new = served.get(st)
            if new is None:
                share = dt * st.rate / len(st.work_s)
                new = served[st] = _State([w - share for w in st.work_s], st.flows, st.rate)
            nic.state = new

    def _reschedule(self) -> None:
        nxt = math.inf
        for st in {nic.state for nic in self._active.values()}:
            if st.rate > 0:
                nxt = min(nxt, min(st.work_s) * len(st.work_s) / st.rate)
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
        active = self._active
        ending = {
            st
            for st in {nic.state for nic in active.values()}
            if min(st.work_s) <= EPS * max(1, len(st.work_s))
        }
        if not ending:
            self._reschedule()
            return
        if len(active) * 4 >= len(self.nics):  # most NICs busy: filter them, in order
            keys = [k for k, nic in self.nics.items() if nic.state in ending]
        else:
            keys = sorted(
                (k for k, nic in active.items() if nic.state in ending), key=self._order.__getitem__
            )
        split: dict[_State, tuple[list[_Flow], _State]] = {}
        for key in keys:  # flows end in the order of their NICs
            nic = active[key]
            st = nic.state
            hit = split.get(st)
            if hit is None:
                eps = EPS * max(1.0, len(st.work_s))
                pairs = list(zip(st.work_s, st.flows, strict=True))
                left = [w for w, _ in pairs if w > eps]
                new = (
                    _State(left, [f for w, f in pairs if w > eps], st.rate)
                    if left
                    else self._idle_state(st.rate)
                )
                hit = split[st] = ([f for w, f in pairs if w <= eps], new)
            done, nic.state = hit
            if not nic.state.flows:
                del active[key]
            for flow in done:
                flow.parts_left -= 1
                if flow.parts_left == 0:
                    self._finish(flow)
        self._reschedule()

    def _finish(self, flow: _Flow) -> None:
        at = max(self.env._now + flow.latency_s, flow.not_before_s)
        done, then = flow.done, flow.then
        if done is None:  # transfer_then
            assert then is not None
            if at <= self.env._now:
                done = self.env.event()
                done.callbacks.append(lambda _: then())
            else:
                self.env.timeout(at - self.env._now).callbacks.append(lambda _: then())
                return
        if at <= self.env._now:
            done.succeed()
        else:
            timer = self.env.timeout(at - self.env._now)
            timer.callbacks.append(lambda _: _succeed(done))

    def utilisation(self, key: Hashable) -> float:
        """Fraction of the elapsed simulated time the NIC had work."""
        self._advance()
        return self.nics[key].busy_s / self.env._now if self.env._now else 0.0

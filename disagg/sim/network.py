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
from functools import partial
from typing import Any

import simpy

from disagg.hardware import NIC
from disagg.sim.clock import Clock

EPS = 1e-12


@dataclass(eq=False, slots=True)
class _Flow:
    parts_left: int
    done: simpy.Event | None  # succeeds at the end (`transfer`)
    not_before_s: float
    latency_s: float
    then: Callable[[], None] | None = None  # called at the end instead (`transfer_then`)


@dataclass(eq=False, slots=True)
class _State:
    """What a NIC is doing: `work_s[i]` seconds left (at full rate) of the part of `flows[i]`,
    served at `rate`. Never changed in place, only replaced: NICs in the same state share one,
    and the work of identical NICs (a flow spread evenly over a node's NICs) is done once.
    `nics`: the NICs in this state, in the order of `Network.nics` (kept for busy states only:
    an idle state's list stays empty)."""

    work_s: list[float]
    flows: list[_Flow]
    rate: float  # fraction of the NIC's bandwidth it moves (a fault: down 0, degraded)
    nics: list[_Nic]


@dataclass(frozen=True, slots=True)
class Parts:
    """A flow's work resolved to NICs: (key, NIC, seconds of work > 0) each, and the largest
    latency of those NICs (0 if none)."""

    nics: tuple[tuple[Hashable, _Nic, float], ...]
    latency_s: float


@dataclass(eq=False, slots=True)
class _Nic:
    spec: NIC
    state: _State
    order: int  # its place in `Network.nics`
    busy_s: float = 0.0  # time with at least one active part, up to `since_s` if active
    since_s: float = 0.0  # when it last became active

    @property
    def rate(self) -> float:
        return self.state.rate


def _call_by_timeout(env: simpy.Environment, delay: float, fn: Callable[[], None]) -> None:
    env.timeout(delay).callbacks.append(lambda _: fn())


def _succeed(event: simpy.Event) -> None:
    event.succeed()


class Network:
    """All NICs of a cluster, keyed by anything hashable, e.g. (node, nic index)."""

    def __init__(self, env: simpy.Environment) -> None:
        self.env = env
        # a call `delay` s from now: the Clock's, or a timeout's on another environment
        self.call: Callable[[float, Callable[[], None]], None] = (
            env.call if isinstance(env, Clock) else partial(_call_by_timeout, env)
        )
        self.nics: dict[Hashable, _Nic] = {}
        self._order: dict[Hashable, int] = {}  # a NIC's place in `nics`
        self._states: dict[_State, None] = {}  # the states of active NICs (each has NICs)
        self._idle: dict[float, _State] = {}  # the state of an idle NIC, by rate
        self._last_s = 0.0
        self._generation = 0

    def _idle_state(self, rate: float) -> _State:
        state = self._idle.get(rate)
        if state is None:
            state = self._idle[rate] = _State([], [], rate, [])
        return state

    def add_nic(self, key: Hashable, spec: NIC) -> None:
        order = self._order.setdefault(key, len(self._order))
        self.nics[key] = _Nic(spec, self._idle_state(1.0), order)

    def work_s(self, key: Hashable, nbytes: float, ops: float) -> float:
        """NIC time at full rate for `nbytes` bytes in `ops` work requests."""
        spec = self.nics[key].spec
        return nbytes / spec.bandwidth_bps + ops * spec.op_cost_s

    def set_rate(self, key: Hashable, rate: float) -> None:
        """From now on the NIC moves `rate` of its bandwidth (0: down, 1: healthy)."""
        self._advance()
        nic = self.nics[key]
        st = nic.state
        if st.flows:
            nic.state = _State(st.work_s, st.flows, rate, [nic])
            st.nics.remove(nic)
            if not st.nics:
                del self._states[st]
            self._states[nic.state] = None
        else:
            nic.state = self._idle_state(rate)
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

    def parts(self, work: Mapping[Any, float]) -> Parts:
        """`work` resolved for `transfer_parts`: the NICs with work, in the order of `nics`,
        and the flow's latency."""
        parts = tuple(
            sorted(
                ((key, self.nics[key], w) for key, w in work.items() if w > 0),
                key=lambda part: part[1].order,
            )
        )
        return Parts(parts, max((nic.spec.latency_s for _, nic, _ in parts), default=0.0))

    def transfer_parts(self, parts: Parts, not_before_s: float, then: Callable[[], None]) -> None:
        """`transfer_then` of a flow resolved by `parts` (valid while the NICs stay added)."""
        self._begin(_Flow(0, None, not_before_s, 0.0, then), parts)

    def _start(self, flow: _Flow, work: Mapping[Any, float]) -> None:
        self._begin(flow, self.parts(work))

    def _begin(self, flow: _Flow, parts: Parts) -> None:
        self._advance()
        added: dict[tuple[_State, float], _State] = {}  # (old state, work) -> new state
        states, now = self._states, self.env._now
        prev: _State | None = None
        new: _State
        w0, idle = 0.0, False
        for _, nic, w in parts.nics:  # in the order of `nics`, so each new state's NICs are
            st = nic.state
            if st is not prev or w != w0:  # else: as the NIC before (a flow spread evenly)
                prev, w0, idle = st, w, not st.flows
                found = added.get((st, w))
                if found is None:
                    found = added[(st, w)] = _State([*st.work_s, w], [*st.flows, flow], st.rate, [])
                    states[found] = None
                new = found
            nic.state = new
            new.nics.append(nic)
            if idle:  # idle until now
                nic.since_s = now
        for old, _ in added:  # the busy states left keep the NICs that did not move
            if old.flows and old in states:
                old.nics = [nic for nic in old.nics if nic.state is old]
                if not old.nics:
                    del states[old]
        flow.parts_left, flow.latency_s = len(parts.nics), parts.latency_s
        if not parts.nics:
            self._finish(flow)
        self._reschedule()

    def _advance(self) -> None:
        """Serve every active part for the time since the last update (once per state: the
        NICs sharing a state see it served)."""
        now = self.env._now
        dt = now - self._last_s
        self._last_s = now
        if dt <= 0:
            return
        for st in self._states:
            share = dt * st.rate / len(st.work_s)
            st.work_s = [w - share for w in st.work_s]  # a new list: others may hold the old

    def _reschedule(self) -> None:
        nxt = math.inf
        for st in self._states:
            rate = st.rate
            if rate > 0:
                work = st.work_s
                t = min(work) * len(work) / rate
                if t < nxt:
                    nxt = t
        if nxt == math.inf:
            return
        self._generation += 1
        gen = self._generation
        self.call(nxt if nxt > 0.0 else 0.0, lambda: self._on_timer(gen))

    def _on_timer(self, gen: int) -> None:
        if gen != self._generation:
            return  # superseded by a later arrival
        self._advance()
        states = self._states
        ending = [st for st in states if min(st.work_s) <= EPS * max(1, len(st.work_s))]
        if not ending:
            self._reschedule()
            return
        # Flows end in the order of their NICs: a flow ends with the last of its NICs (in the
        # order of `nics`) to finish its part, the flows of one NIC in their state's order. All
        # NICs of a state finish the same parts, so a state is handled at once, states in the
        # order of their last NIC: each flow's count reaches 0 at the state of its last NIC.
        if len(ending) > 1:
            ending.sort(key=lambda st: st.nics[-1].order)
        now = self.env._now
        for st in ending:
            eps = EPS * max(1.0, len(st.work_s))
            nics = st.nics
            del states[st]
            if len(st.work_s) == 1:  # its one part ends
                done, work, going = st.flows, [], []
            else:
                pairs = list(zip(st.work_s, st.flows, strict=True))
                work = [w for w, _ in pairs if w > eps]
                going = [f for w, f in pairs if w > eps]
                done = [f for w, f in pairs if w <= eps]
            if work:  # parts left: the NICs go on together
                new = _State(work, going, st.rate, nics)
                states[new] = None
                for nic in nics:
                    nic.state = new
            else:
                idle = self._idle_state(st.rate)
                for nic in nics:
                    nic.state = idle
                    nic.busy_s += now - nic.since_s
            for flow in done:
                flow.parts_left -= len(nics)
                if flow.parts_left == 0:
                    self._finish(flow)
        self._reschedule()

    def _finish(self, flow: _Flow) -> None:
        at = max(self.env._now + flow.latency_s, flow.not_before_s)
        done, then = flow.done, flow.then
        if done is None:  # transfer_then
            assert then is not None
            self.call(max(0.0, at - self.env._now), then)  # an event's place in the order
            return
        if at <= self.env._now:
            done.succeed()
        else:
            timer = self.env.timeout(at - self.env._now)
            timer.callbacks.append(lambda _: _succeed(done))

    def utilisation(self, key: Hashable) -> float:
        """Fraction of the elapsed simulated time the NIC had work."""
        self._advance()
        nic, now = self.nics[key], self.env._now
        busy_s = nic.busy_s + (now - nic.since_s if nic.state.flows else 0.0)
        return busy_s / now if now else 0.0

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
    and the work of identical NICs (a flow spread evenly over a node's NICs) is done once."""

    work_s: list[float]
    flows: list[_Flow]
    rate: float  # fraction of the NIC's bandwidth it moves (a fault: down 0, degraded)


@dataclass(frozen=True, slots=True)
class Parts:
    """A flow's work resolved to NICs: (key, NIC, seconds of work > 0) each, and the largest
    latency of those NICs (0 if none)."""

    nics: tuple[tuple[Hashable, _Nic, float], ...]
    latency_s: float


@dataclass(slots=True)
class _Nic:
    spec: NIC
    state: _State
    busy_s: float = 0.0  # time with at least one active part, up to `since_s` if active
    since_s: float = 0.0  # when it last became active

    @property
    def rate(self) -> float:
        return self.state.rate


def _leave(states: dict[_State, int], st: _State) -> None:
    """One NIC fewer in `st`."""
    n = states[st] - 1
    if n:
        states[st] = n
    else:
        del states[st]


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
        self._active: dict[Hashable, _Nic] = {}  # the NICs with parts (any order)
        self._states: dict[_State, int] = {}  # the states of active NICs: how many NICs each
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
        if st.flows:
            nic.state = _State(st.work_s, st.flows, rate)
            _leave(self._states, st)
            self._states[nic.state] = 1
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
        """`work` resolved for `transfer_parts`: the NICs with work, and the flow's latency."""
        parts = tuple((key, self.nics[key], w) for key, w in work.items() if w > 0)
        return Parts(parts, max((nic.spec.latency_s for _, nic, _ in parts), default=0.0))

    def transfer_parts(self, parts: Parts, not_before_s: float, then: Callable[[], None]) -> None:
        """`transfer_then` of a flow resolved by `parts` (valid while the NICs stay added)."""
        self._begin(_Flow(0, None, not_before_s, 0.0, then), parts)

    def _start(self, flow: _Flow, work: Mapping[Any, float]) -> None:
        self._begin(flow, self.parts(work))

    def _begin(self, flow: _Flow, parts: Parts) -> None:
        self._advance()
        added: dict[tuple[_State, float], _State] = {}
        active, states, now = self._active, self._states, self.env._now
        st = new = None
        w0 = 0.0
        for key, nic, w in parts.nics:
            if nic.state is not st or w != w0:  # else: as the NIC before (a flow spread evenly)
                st, w0 = nic.state, w
                new = added.get((st, w))
                if new is None:
                    new = added[(st, w)] = _State([*st.work_s, w], [*st.flows, flow], st.rate)
                    states[new] = 0
            assert st is not None and new is not None
            nic.state = new
            states[new] += 1
            if st.flows:
                _leave(states, st)
            else:  # idle until now
                nic.since_s = now
            active[key] = nic
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
        active, states = self._active, self._states
        ending = [st for st in states if min(st.work_s) <= EPS * max(1, len(st.work_s))]
        if not ending:
            self._reschedule()
            return
        split: dict[_State, tuple[list[_Flow], _State]] = {}
        for st in ending:
            eps = EPS * max(1.0, len(st.work_s))
            if len(st.work_s) == 1:  # its one part ends
                done, new = st.flows, self._idle_state(st.rate)
            else:
                pairs = list(zip(st.work_s, st.flows, strict=True))
                left = [w for w, _ in pairs if w > eps]
                if left:
                    new = _State(left, [f for w, f in pairs if w > eps], st.rate)
                    states[new] = states[st]
                else:
                    new = self._idle_state(st.rate)
                done = [f for w, f in pairs if w <= eps]
            del states[st]
            split[st] = (done, new)
        if len(active) * 4 >= len(self.nics):  # most NICs busy: filter them, in order
            keys = [k for k, nic in self.nics.items() if nic.state in split]
        else:
            keys = sorted(
                (k for k, nic in active.items() if nic.state in split), key=self._order.__getitem__
            )
        now = self.env._now
        for key in keys:  # flows end in the order of their NICs
            nic = active[key]
            done, nic.state = split[nic.state]
            if not nic.state.flows:
                del active[key]
                nic.busy_s += now - nic.since_s
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

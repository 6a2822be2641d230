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
    """What a group of NICs is doing: `work_s[i]` seconds left (at full rate) of the part of
    `flows[i]` on each of them, served at `rate`. The group is `mask` (bit i: the NIC of place
    i in `Network.nics`), `count` NICs: NICs that move in lockstep (a flow spread evenly over a
    node's NICs) are served, split and ended once. All of a group's NICs became busy at
    `since_s`: a group is split from one earlier group, or made of NICs idle until then."""

    work_s: list[float]
    flows: list[_Flow]
    rate: float  # fraction of the NICs' bandwidth they move (a fault: down 0, degraded)
    mask: int
    count: int
    since_s: float


@dataclass(frozen=True, slots=True)
class Parts:
    """A flow's work resolved to NICs: (mask of NICs, seconds of work > 0 on each of them)
    per amount of work, how many NICs in all, and the largest latency of them (0 if none)."""

    groups: tuple[tuple[int, float], ...]
    count: int
    latency_s: float


@dataclass(eq=False, slots=True)
class _Nic:
    spec: NIC
    order: int  # its place in `Network.nics`: its bit in a state's mask


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
        self._states: dict[_State, None] = {}  # the busy groups (disjoint masks)
        self._busy = 0  # the mask of the busy NICs (the union of the states')
        self._idle: dict[float, int] = {}  # the mask of the idle NICs, by rate
        # (mask, seconds) each time a group went idle: busy time per NIC, summed when read
        self._busy_log: list[tuple[int, float]] = []
        self._last_s = 0.0
        self._generation = 0

    def add_nic(self, key: Hashable, spec: NIC) -> None:
        order = self._order.setdefault(key, len(self._order))
        self.nics[key] = _Nic(spec, order)
        self._idle[1.0] = self._idle.get(1.0, 0) | 1 << order

    def work_s(self, key: Hashable, nbytes: float, ops: float) -> float:
        """NIC time at full rate for `nbytes` bytes in `ops` work requests."""
        spec = self.nics[key].spec
        return nbytes / spec.bandwidth_bps + ops * spec.op_cost_s

    def _busy_state(self, bit: int) -> _State | None:
        return next((st for st in self._states if st.mask & bit), None)

    def set_rate(self, key: Hashable, rate: float) -> None:
        """From now on the NIC moves `rate` of its bandwidth (0: down, 1: healthy)."""
        self._advance()
        bit = 1 << self.nics[key].order
        st = self._busy_state(bit)
        if st is not None:  # it leaves its group, into one of its own
            st.mask, st.count = st.mask ^ bit, st.count - 1
            if not st.mask:
                del self._states[st]
            self._states[_State(st.work_s, st.flows, rate, bit, 1, st.since_s)] = None
        else:
            for r, idle in self._idle.items():
                if idle & bit:
                    self._idle[r] = idle ^ bit
                    break
            self._idle[rate] = self._idle.get(rate, 0) | bit
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
        """`work` resolved for `transfer_parts`: the NICs with work, grouped by their work,
        and the flow's latency."""
        nics = [(self.nics[key], w) for key, w in work.items() if w > 0]
        groups: dict[float, int] = {}
        for nic, w in nics:
            groups[w] = groups.get(w, 0) | 1 << nic.order
        latency_s = max((nic.spec.latency_s for nic, _ in nics), default=0.0)
        return Parts(tuple((mask, w) for w, mask in groups.items()), len(nics), latency_s)

    def transfer_parts(self, parts: Parts, not_before_s: float, then: Callable[[], None]) -> None:
        """`transfer_then` of a flow resolved by `parts` (valid while the NICs stay added)."""
        self._begin(_Flow(0, None, not_before_s, 0.0, then), parts)

    def _start(self, flow: _Flow, work: Mapping[Any, float]) -> None:
        self._begin(flow, self.parts(work))

    def _begin(self, flow: _Flow, parts: Parts) -> None:
        """Add `flow`'s part to each of its NICs: a group whose NICs all get the same work
        moves to one new state, and the NICs of a group that get none keep theirs."""
        self._advance()
        states, now = self._states, self.env._now
        for mask, w in parts.groups:
            if mask & self._busy:
                for st in [st for st in states if st.mask & mask]:
                    both = st.mask & mask
                    n = both.bit_count()
                    new = _State([*st.work_s, w], [*st.flows, flow], st.rate, both, n, st.since_s)
                    states[new] = None
                    if both == st.mask:
                        del states[st]
                    else:
                        st.mask, st.count = st.mask ^ both, st.count - n
            if mask & ~self._busy:  # idle until now
                for rate, idle in self._idle.items():
                    both = idle & mask
                    if both:
                        self._idle[rate] = idle ^ both
                        states[_State([w], [flow], rate, both, both.bit_count(), now)] = None
                self._busy |= mask
        flow.parts_left, flow.latency_s = parts.count, parts.latency_s
        if not parts.count:
            self._finish(flow)
        self._reschedule()

    def _advance(self) -> None:
        """Serve every active part for the time since the last update (once per group)."""
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
        # NICs of a group finish the same parts, so a group is handled at once, groups in the
        # order of their last NIC (highest bit): each flow's count reaches 0 at the group of
        # its last NIC.
        if len(ending) > 1:
            ending.sort(key=lambda st: st.mask.bit_length())
        now = self.env._now
        for st in ending:
            work: list[float] | None = None
            if len(st.work_s) == 1:  # its one part ends
                done = st.flows
            else:
                eps = EPS * len(st.work_s)
                pairs = list(zip(st.work_s, st.flows, strict=True))
                work = [w for w, _ in pairs if w > eps]
                going = [f for w, f in pairs if w > eps]
                done = [f for w, f in pairs if w <= eps]
            if work:  # parts left: the NICs go on together
                st.work_s, st.flows = work, going
            else:
                del states[st]
                self._busy ^= st.mask
                self._idle[st.rate] = self._idle.get(st.rate, 0) | st.mask
                self._busy_log.append((st.mask, now - st.since_s))
            for flow in done:
                flow.parts_left -= st.count
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
        bit, now = 1 << self.nics[key].order, self.env._now
        busy_s = 0.0
        for mask, seconds in self._busy_log:  # in time order, as a running sum per NIC
            if mask & bit:
                busy_s += seconds
        st = self._busy_state(bit)
        if st is not None:
            busy_s += now - st.since_s
        return busy_s / now if now else 0.0

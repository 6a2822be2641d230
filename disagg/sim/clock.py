"""The simulator's SimPy environment, with lighter events and a lighter run loop.

`Clock` is a `simpy.Environment` whose `timeout` and `event` return a `Timer` and a `Signal`
(the few fields that the event loop and SimPy processes read, with no `Event` machinery), whose
`call` schedules a plain callable and `start` runs a generator as a light process (no event
objects at all), and whose `run(until=t)` steps events in a loop of its own. Everything is
processed in SimPy's order, by (time, priority, insertion): a `call` takes the place a timeout
made at that moment would, a `start` the place of a process started then, and the `until` mark
is scheduled as SimPy schedules it. (The simulator's hot paths read the time as `env._now`, the
field behind SimPy's `now` property.)
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from heapq import heappop, heappush
from types import FunctionType
from typing import Any

import simpy
from simpy.core import NORMAL, URGENT
from simpy.events import PENDING


class Timer:
    """A timeout: triggered at creation, processed `delay` seconds later. Supports what the
    simulator uses: `callbacks` (append to be called with the timer), `value`, and being
    yielded from a SimPy process."""

    __slots__ = ("_ok", "_value", "callbacks", "env")

    def __init__(self, env: Clock, value: Any = None) -> None:
        self.callbacks: list[Any] | None = []
        self._ok = True
        self._value = value
        self.env = env

    @property
    def triggered(self) -> bool:
        return True

    @property
    def processed(self) -> bool:
        return self.callbacks is None

    @property
    def value(self) -> Any:
        return self._value


class Signal:
    """An event triggered by `succeed()`, then processed in turn: SimPy's `Event` reduced to
    what the simulator uses (`callbacks`, `triggered`, `succeed`, being yielded)."""

    __slots__ = ("_ok", "_value", "callbacks", "env")

    def __init__(self, env: Clock) -> None:
        self.callbacks: list[Any] | None = []
        self._value: Any = PENDING
        self.env = env

    @property
    def triggered(self) -> bool:
        return self._value is not PENDING

    @property
    def processed(self) -> bool:
        return self.callbacks is None

    @property
    def value(self) -> Any:
        if self._value is PENDING:
            raise AttributeError(f"value of {self} is not yet available")
        return self._value

    def succeed(self, value: Any = None) -> Signal:
        """Trigger now: processed after the events already due now (SimPy's order)."""
        if self._value is not PENDING:
            raise RuntimeError(f"{self} has already been triggered")
        self._ok, self._value = True, value
        env = self.env
        queue: list[Any] = env._queue
        heappush(queue, (env._now, NORMAL, next(env._eid), self))
        return self


class Wake:
    """A wake-up for one light process (`Clock.start`), reused for every wait: the process
    yields it (alone, or as `(delay_s, wake)`) and `set()` resumes it, in the place a `Signal`
    succeeded then would take; a `set()` while nothing waits does nothing. No event object and
    no callback list per wait."""

    __slots__ = ("env", "waiter")

    def __init__(self, env: Clock) -> None:
        self.env = env
        self.waiter: Callable[[], None] | None = None  # the resume of the process waiting

    def set(self) -> None:
        waiter = self.waiter
        if waiter is not None:
            self.waiter = None
            env = self.env
            queue: list[Any] = env._queue
            heappush(queue, (env._now, NORMAL, next(env._eid), waiter))


class Clock(simpy.Environment):
    """A SimPy environment with cheaper timeouts and a cheaper `run(until=number)`."""

    def event(self) -> Any:
        """A `Signal`: an event to `succeed()` later."""
        return Signal(self)

    def wake(self) -> Wake:
        """A `Wake`: what a light process waits on to be woken."""
        return Wake(self)

    def timeout(self, delay: float = 0, value: Any = None) -> Any:
        """A `Timer` processed `delay` seconds from now (SimPy's contract for a timeout)."""
        if delay < 0:
            raise ValueError(f"Negative delay {delay}")
        timer = Timer(self, value)
        queue: list[Any] = self._queue  # SimPy types it as holding Events only
        heappush(queue, (self._now + delay, NORMAL, next(self._eid), timer))
        return timer

    def call(self, delay: float, fn: Callable[[], Any]) -> None:
        """Call `fn()` `delay` seconds from now, in the place a timeout made now would have in
        the order, with no event object: the queue holds the callable itself (`_is_call`)."""
        queue: list[Any] = self._queue  # SimPy types it as holding Events only
        heappush(queue, (self._now + delay, NORMAL, next(self._eid), fn))

    def start(self, gen: Generator[Any, Any, Any]) -> None:
        """Run `gen` as a light process (started as SimPy starts a process: first of the
        events due now). It yields what it waits for: a delay in seconds, an event (`Signal`,
        `Timer`), a `Wake`, or `(delay_s, signal)` (a Signal or a Wake): whichever comes first,
        the signal or the delay's end
        (the other is then ignored). Each resume sends it None; its exceptions propagate out of
        `run`. Unlike a SimPy process it is no event: nothing can wait for its end."""
        call, eid = self.call, self._eid
        queue: list[Any] = self._queue

        def resume(_: Any = None) -> None:
            try:
                target = gen.send(None)
            except StopIteration:
                return
            cls = target.__class__
            if cls is float:
                if target < 0:
                    raise ValueError(f"Negative delay {target}")
                heappush(queue, (self._now + target, NORMAL, next(eid), resume))  # call(...)
            elif cls is Wake:
                target.waiter = resume
            elif cls is tuple:
                delay_s, signal = target
                if delay_s < 0:
                    raise ValueError(f"Negative delay {delay_s}")
                waiting = True

                def first(_: Any = None) -> None:
                    nonlocal waiting
                    if waiting:
                        waiting = False
                        if signal.__class__ is Wake and signal.waiter is first:
                            signal.waiter = None  # the delay ended first
                        resume()

                if signal.__class__ is Wake:
                    signal.waiter = first
                else:
                    signal.callbacks.append(first)
                heappush(queue, (self._now + delay_s, NORMAL, next(eid), first))  # call(...)
            elif cls is Signal or cls is Timer or isinstance(target, simpy.Event):
                if target.callbacks is None:  # already processed: go on at once
                    call(0.0, resume)
                else:
                    target.callbacks.append(resume)
            else:
                call(_delay(target), resume)

        heappush(queue, (self._now, URGENT, next(eid), resume))

    def step(self) -> None:
        """SimPy's `step`, which also runs a `call`."""
        queue: list[Any] = self._queue
        if queue and _is_call(queue[0][3]):
            self._now, _, _, fn = heappop(queue)
            fn()
            return
        super().step()

    def run(self, until: Any = None) -> Any:
        """SimPy's `run`; a number `until` is run by the loop here, in SimPy's order."""
        if until is None or isinstance(until, simpy.Event):
            return super().run(until)
        at = until if isinstance(until, int) else float(until)
        if at <= self._now:
            raise ValueError(f"until ({at}) must be greater than the current simulation time")
        queue: list[Any] = self._queue
        stop = Timer(self)
        heappush(queue, (self._now + (at - self._now), URGENT, next(self._eid), stop))
        while True:  # the queue holds `stop` until it is popped
            self._now, _, _, event = heappop(queue)
            cls = event.__class__
            if cls is FunctionType or (cls is not Timer and cls is not Signal and _is_call(event)):
                event()  # a `call` (_is_call, its common case first)
                continue
            if event is stop:
                return None
            callbacks, event.callbacks = event.callbacks, None
            for callback in callbacks:
                callback(event)
            if not event._ok and not hasattr(event, "_defused"):
                exc = type(event._value)(*event._value.args)  # as simpy's step: a copy
                exc.__cause__ = event._value
                raise exc


def _is_call(entry: Any) -> bool:
    """Whether a queue entry is a `call` (a callable: a function, a bound method, a partial, or
    a compiled function when the simulator is compiled, tools/compile_sim.py) rather than an
    event (a `Timer`, a `Signal`, a SimPy event), whose callbacks are run."""
    return not isinstance(entry, (Timer, Signal, simpy.Event))


def _delay(delay_s: float) -> float:
    if delay_s < 0:
        raise ValueError(f"Negative delay {delay_s}")
    return delay_s

"""The simulator's Clock processes events in SimPy's order, and keeps SimPy's contracts."""

from __future__ import annotations

from collections.abc import Generator
from typing import Any

import pytest
import simpy

from disagg.sim.clock import Clock


def _scenario(env: simpy.Environment) -> list[tuple[float, str]]:
    """Ties at one time between timeouts, a succeeded event, a process and `run`'s until mark;
    returns what ran when, in order."""
    log: list[tuple[float, str]] = []
    wake = env.event()

    def note(label: str) -> Any:
        return lambda _: log.append((env.now, label))

    def proc() -> Generator[Any, Any, None]:
        log.append((env.now, "proc start"))
        yield env.timeout(1.0)
        log.append((env.now, "proc after 1"))
        wake.succeed()
        yield wake
        log.append((env.now, "proc woke"))
        yield env.timeout(0.5)
        log.append((env.now, "proc end"))

    env.timeout(1.0).callbacks.append(note("t1 a"))
    env.process(proc())
    env.timeout(1.0).callbacks.append(note("t1 b"))
    env.timeout(2.0).callbacks.append(note("t2"))
    env.run(until=1.5)
    log.append((env.now, "slice"))
    env.timeout(0.5).callbacks.append(note("t2 late"))
    env.run(until=3.0)
    log.append((env.now, "end"))
    return log


def test_clock_runs_events_in_simpy_order() -> None:
    assert _scenario(Clock()) == _scenario(simpy.Environment())
    assert _scenario(Clock()) == [
        (0.0, "proc start"),
        (1.0, "t1 a"),
        (1.0, "t1 b"),  # scheduled before the process's timeout: first at the tie
        (1.0, "proc after 1"),
        (1.0, "proc woke"),
        (1.5, "slice"),  # the until mark is urgent: it ends the slice before the timeout
        (1.5, "proc end"),
        (2.0, "t2"),
        (2.0, "t2 late"),
        (3.0, "end"),
    ]


def test_clock_timeout_is_yieldable_and_carries_its_value() -> None:
    env = Clock()
    got: list[Any] = []

    def proc() -> Generator[Any, Any, None]:
        got.append((yield env.timeout(2.0, value="x")))

    env.process(proc())
    env.run(until=5)
    assert got == ["x"]
    assert env.now == 5


def test_clock_rejects_a_negative_delay_and_a_past_until() -> None:
    env = Clock()
    with pytest.raises(ValueError, match="Negative delay -1"):
        env.timeout(-1)
    env.run(until=2.0)
    with pytest.raises(ValueError, match=r"until \(1.0\) must be greater"):
        env.run(until=1.0)


def test_clock_raises_a_process_failure_like_simpy() -> None:
    env = Clock()

    def proc() -> Generator[Any, Any, None]:
        yield env.timeout(1.0)
        raise KeyError("lost")

    env.process(proc())
    with pytest.raises(KeyError, match="lost"):
        env.run(until=2.0)


def test_clock_signal_succeeds_once_and_has_no_value_before() -> None:
    env = Clock()
    signal = env.event()
    assert not signal.triggered
    with pytest.raises(AttributeError, match="not yet available"):
        _ = signal.value
    signal.succeed(7)
    assert signal.triggered and signal.value == 7 and not signal.processed
    with pytest.raises(RuntimeError, match="already been triggered"):
        signal.succeed()
    env.run(until=1.0)
    assert signal.processed


def test_clock_call_takes_a_timeouts_place_in_the_order() -> None:
    env = Clock()
    log: list[tuple[float, str]] = []
    env.timeout(1.0).callbacks.append(lambda _: log.append((env.now, "timeout a")))
    env.call(1.0, lambda: log.append((env.now, "call")))
    env.timeout(1.0).callbacks.append(lambda _: log.append((env.now, "timeout b")))
    env.call(0.5, lambda: log.append((env.now, "early call")))
    env.run(until=2.0)
    assert log == [(0.5, "early call"), (1.0, "timeout a"), (1.0, "call"), (1.0, "timeout b")]
    env.call(1.0, log.clear)  # a bound method: a call too
    env.step()
    assert log == [] and env.now == 3.0


def test_clock_start_runs_delays_events_and_the_first_of_a_delay_and_a_signal() -> None:
    env = Clock()
    log: list[tuple[float, str]] = []
    wake = env.event()

    def proc() -> Generator[Any, Any, None]:
        log.append((env.now, "start"))
        yield 1.5
        log.append((env.now, "after 1.5"))
        yield 10.0, wake  # woken at 2.0, before the delay's end
        log.append((env.now, "woken"))
        yield 0.25, env.event()  # never succeeds: the delay ends it
        log.append((env.now, "delay first"))
        yield env.timeout(1.0)
        log.append((env.now, "after a timeout"))

    env.start(proc())
    env.call(2.0, lambda: wake.succeed())
    env.run(until=20.0)
    assert log == [
        (0.0, "start"),
        (1.5, "after 1.5"),
        (2.0, "woken"),
        (2.25, "delay first"),
        (3.25, "after a timeout"),
    ]


def test_clock_start_rejects_a_negative_delay() -> None:
    env = Clock()

    def proc() -> Generator[Any, Any, None]:
        yield -1.0

    env.start(proc())
    with pytest.raises(ValueError, match=r"Negative delay -1\.0"):
        env.run(until=1.0)


def test_clock_wake_resumes_its_waiter_once_and_forgets_a_set_with_none() -> None:
    env = Clock()
    log: list[tuple[float, str]] = []
    wake = env.wake()

    def proc() -> Generator[Any, Any, None]:
        yield wake
        log.append((env.now, "woken"))
        yield 10.0, wake  # woken at 3.0; the delay, ending at 13.0, is then ignored
        log.append((env.now, "woken before the delay"))
        yield 0.5, wake  # the delay ends first
        log.append((env.now, "delay first"))
        yield wake
        log.append((env.now, "woken last"))  # the set at 5.0 finds nothing waiting

    env.start(proc())
    env.call(1.0, wake.set)  # a bound method: a call too
    env.call(1.0, wake.set)  # the process is not waiting again yet: nothing happens
    env.call(3.0, wake.set)
    env.call(4.0, wake.set)
    env.call(5.0, wake.set)
    env.run(until=20.0)
    assert log == [
        (1.0, "woken"),
        (3.0, "woken before the delay"),
        (3.5, "delay first"),
        (4.0, "woken last"),
    ]

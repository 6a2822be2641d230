"""Chrome trace-event primitives: microsecond times, lanes for overlapping slices, slices
that flows bind to, and the processes and threads that name the tracks."""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

EPS_S = 1e-6  # tolerance when matching a request's prefill start to its pass's start
# a hw decoder stamps a token after sampling, up to ~0.1 ms past its pass's recorded end
TOKEN_LAG_S = 1e-3


def us(t_s: float) -> float:
    """Seconds to trace microseconds, rounded to the nanosecond."""
    return round(t_s * 1e6, 3)


def _clean(value: Any) -> Any:
    """A JSON-safe arg: numpy scalars to Python, NaN to None (JSON has no NaN)."""
    if isinstance(value, np.generic):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def column(values: Any) -> list[Any]:
    """A column as JSON-safe Python values: numbers as int/float/bool, NaN as None."""
    arr = np.asarray(values)
    out: list[Any] = arr.tolist()
    if arr.dtype.kind == "f" and not np.isfinite(arr).all():
        out = [v if math.isfinite(v) else None for v in out]
    return out


def lanes(starts: Sequence[float], ends: Sequence[float]) -> list[int]:
    """The lowest free lane of each interval, given in order of start: intervals on one lane
    never overlap (one may start where the one before ends)."""
    busy: list[tuple[float, int]] = []
    free: list[int] = []
    out: list[int] = []
    for start, end in zip(starts, ends, strict=True):
        while busy and busy[0][0] <= start:
            heapq.heappush(free, heapq.heappop(busy)[1])
        lane = heapq.heappop(free) if free else len(busy)
        heapq.heappush(busy, (end, lane))
        out.append(lane)
    return out


@dataclass(frozen=True)
class Slice:
    pid: int
    tid: int
    start_us: float
    dur_us: float

    def point(self, after_us: float) -> float:
        """A time inside the slice for a flow to bind to: its middle, or later to follow a
        point at `after_us`, never past its end."""
        mid = self.start_us + self.dur_us / 2
        return round(min(max(after_us, mid), self.start_us + self.dur_us * 0.999), 3)


@dataclass
class Tracks:
    """Trace events, with the processes and the lane threads of their tracks: lane k of a
    process's n-th track (from 0) is thread 1000 * (n + 1) + k."""

    events: list[dict[str, Any]] = field(default_factory=list)
    _pids: dict[str, int] = field(default_factory=dict)
    _tracks: dict[tuple[int, str], int] = field(default_factory=dict)
    _lanes: set[tuple[int, int]] = field(default_factory=set)

    def pid(self, process: str) -> int:
        if process not in self._pids:
            pid = self._pids[process] = len(self._pids) + 1
            self.meta(pid, 0, "process_name", process)
            self.meta(pid, 0, "process_sort_index", pid, key="sort_index")
        return self._pids[process]

    def tid(self, pid: int, track: str, lane: int = 0) -> int:
        if (pid, track) not in self._tracks:
            n = sum(1 for p, _ in self._tracks if p == pid)
            self._tracks[(pid, track)] = 1000 * (n + 1)
        tid = self._tracks[(pid, track)] + lane
        if (pid, tid) not in self._lanes:
            self._lanes.add((pid, tid))
            self.meta(pid, tid, "thread_name", track if lane == 0 else f"{track} #{lane + 1}")
            self.meta(pid, tid, "thread_sort_index", tid, key="sort_index")
        return tid

    def meta(self, pid: int, tid: int, name: str, value: Any, key: str = "name") -> None:
        self.events.append({"ph": "M", "pid": pid, "tid": tid, "name": name, "args": {key: value}})

    def slice(self, pid: int, tid: int, label: str, t0_s: float, t1_s: float, **args: Any) -> Slice:
        s = Slice(pid, tid, us(t0_s), max(0.0, round(us(t1_s) - us(t0_s), 3)))
        ev = {"ph": "X", "pid": pid, "tid": tid, "name": label, "ts": s.start_us, "dur": s.dur_us}
        self.events.append(ev | {"args": {k: _clean(v) for k, v in args.items()}})
        return s

    def slices(
        self,
        pid: int,
        tids: Sequence[int],
        labels: Sequence[str],
        t0_s: np.ndarray,
        t1_s: np.ndarray,
        args: dict[str, Any],
    ) -> list[Slice]:
        """Many slices at once (as `slice`, without a Python call per value); `args` maps
        each arg's name to its column."""
        start = np.round(t0_s * 1e6, 3)
        dur = np.maximum(0.0, np.round(np.round(t1_s * 1e6, 3) - start, 3))
        keys, cols = list(args), [column(v) for v in args.values()]
        out = []
        for tid, label, ts, d, *vals in zip(
            tids, labels, start.tolist(), dur.tolist(), *cols, strict=True
        ):
            ev = {"ph": "X", "pid": pid, "tid": tid, "name": label, "ts": ts, "dur": d}
            self.events.append(ev | {"args": dict(zip(keys, vals, strict=True))})
            out.append(Slice(pid, tid, ts, d))
        return out

    def flow(self, flow_id: int, points: Sequence[tuple[Slice, float]]) -> None:
        """Flow `flow_id` through the given slices, at the given times inside them."""
        for i, (s, ts) in enumerate(points):
            ph = "s" if i == 0 else ("f" if i == len(points) - 1 else "t")
            ev = {"ph": ph, "id": flow_id, "pid": s.pid, "tid": s.tid, "ts": ts}
            self.events.append(ev | {"name": "request", "cat": "request", "bp": "e"})


@dataclass
class Passes:
    """One node's passes as slices in order of start, found by time."""

    slices: list[Slice]
    starts_s: np.ndarray
    ends_s: np.ndarray

    def starting(self, t_s: float) -> Slice | None:
        """The last pass that starts at or before `t_s` and has not ended before it."""
        i = int(np.searchsorted(self.starts_s, t_s + EPS_S, side="right")) - 1
        return self.slices[i] if i >= 0 and self.ends_s[i] >= t_s - EPS_S else None

    def ending(self, t_s: float) -> Slice | None:
        """The pass a token stamped `t_s` came out of: the last pass that starts before
        `t_s`, if `t_s` is inside it or at most `TOKEN_LAG_S` after its end."""
        i = int(np.searchsorted(self.starts_s, t_s, side="left")) - 1
        return self.slices[i] if i >= 0 and self.ends_s[i] >= t_s - TOKEN_LAG_S else None

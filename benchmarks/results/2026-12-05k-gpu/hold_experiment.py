"""An experiment, not kept: a decode pass on a shared GPU that finishes while a pass with a
prompt chunk has at most HOLD seconds of work left ends with that pass instead, taking no share
meanwhile (`SharedGPU._end` patched here). Each validate directory given is copied under OUT
(its sim-* replays left out) and replayed there, the shares fitted again with the hold in
place. LATE=0 takes back the chunk extra for a chunk pass met after it began (`SharedGPU._meet`,
9a2b4c6), as the rule stood when the hold was first tried.

    HOLD=0.006 [LATE=0] python hold_experiment.py OUT VALIDATE_DIR...
"""

import contextlib
import os
import shutil
import sys
from pathlib import Path

import disagg.sim.gpu as G
from disagg.cli import app

HOLD = float(os.environ.get("HOLD", "0"))
gpu_init, gpu_work_s = G.SharedGPU.__init__, G.SharedGPU.work_s


class Running(dict):
    """A SharedGPU's running passes, each one's kind (decode-only or not) kept as `run` adds
    it: `work_s`, which `run` calls just before, says it."""

    def __init__(self, gpu):
        super().__init__()
        self.gpu = gpu

    def __setitem__(self, key, value):
        if key not in self:
            self.gpu.kind[key] = self.gpu.pending
        super().__setitem__(key, value)


def init(self, *a, **k):
    gpu_init(self, *a, **k)
    self.kind, self.held, self.pending = {}, {}, True
    self.running = Running(self)


def work_s(self, seconds, decode_only):
    self.pending = decode_only
    return gpu_work_s(self, seconds, decode_only)


def _end(self, turn, first):
    if turn != self.turn:
        return
    self._advance()
    del self.running[first]
    self.alone.discard(first)
    holder = None
    if self.kind.pop(first) and HOLD > 0:  # a decode pass: held by a chunk pass near its end
        holder = next(
            (s for s, p in self.running.items() if not self.kind[s] and p[0] <= HOLD), None
        )
    if holder is None:
        first.succeed()
    else:
        self.held.setdefault(holder, []).append(first)
    for s in self.held.pop(first, []):
        s.succeed()
    self._schedule()


G.SharedGPU.__init__, G.SharedGPU.work_s, G.SharedGPU._end = init, work_s, _end
if os.environ.get("LATE", "1") == "0":
    G.SharedGPU._meet = lambda self: self.alone.clear()

out = Path(sys.argv[1])
for src in sys.argv[2:]:
    src = Path(src)
    w = out / src.parent.name / src.name
    shutil.rmtree(w, ignore_errors=True)
    w.parent.mkdir(parents=True, exist_ok=True)
    shutil.copytree(src, w, ignore=shutil.ignore_patterns("sim-*"))
    sys.argv = [
        "disagg",
        "validate",
        "--replay",
        "--out",
        str(w),
        "--tolerance",
        "ttft_p50=5,ttft_p90=5,tpot_p50=3,tpot_p90=3,output_throughput=3",
    ]
    with contextlib.suppress(SystemExit):  # the command's exit: the next directory
        app()

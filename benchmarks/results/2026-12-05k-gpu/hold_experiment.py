"""An experiment, not kept: a decode pass on a shared GPU that finishes while a pass with a
prompt chunk has at most HOLD seconds of work left ends with that pass instead, taking no share
meanwhile (`SharedGPU` patched here). Each validate directory given is copied under OUT (its
sim-* replays left out) and replayed there, the shares fitted again with the hold in place.

    HOLD=0.006 python hold_experiment.py OUT VALIDATE_DIR...
"""

import contextlib
import os
import shutil
import sys
from pathlib import Path

import disagg.sim.gpu as G
from disagg.cli import app

HOLD = float(os.environ.get("HOLD", "0"))
orig_run, orig_init = G.SharedGPU.run, G.SharedGPU.__init__


def init(self, *a, **k):
    orig_init(self, *a, **k)
    self.kind = {}
    self.held = {}


def run(self, seconds, decode_only, host_s=None):
    env, before = self.env, self.host_before
    if host_s is not None:
        yield host_s * before
    self._advance()
    done, t0 = env.event(), env._now
    work = self.work_s(seconds, decode_only)
    self.running[done] = [work, self.weight(work, decode_only)]
    self.kind[done] = decode_only
    self._schedule()
    yield done
    if env._now - t0 > seconds * (1 + 1e-9):
        self.shared += 1
        self.lost_s += env._now - t0 - seconds
    if host_s is not None and before < 1:
        yield host_s * (1 - before)


def _end(self, turn, first):
    if turn != self.turn:
        return
    self._advance()
    del self.running[first]
    decode = self.kind.pop(first)
    holder = None
    if decode and HOLD > 0:
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


G.SharedGPU.__init__, G.SharedGPU.run, G.SharedGPU._end = init, run, _end

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

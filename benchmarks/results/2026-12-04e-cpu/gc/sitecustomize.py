"""Log each process's garbage collections: every full one, and every thousandth of any, into
GC_LOG_DIR/log.PID (default: this directory), with the counts, sums and maxima so far (ms)."""

import gc
import os
import time
from pathlib import Path

T0 = time.perf_counter()
LOG = Path(os.environ.get("GC_LOG_DIR", Path(__file__).parent)) / f"log.{os.getpid()}"
began = [0.0]
count, total, most = [0, 0, 0], [0.0, 0.0, 0.0], [0.0, 0.0, 0.0]


def _timed(phase: str, info: dict) -> None:
    if phase == "start":
        began[0] = time.perf_counter()
        return
    g, took = info["generation"], time.perf_counter() - began[0]
    count[g] += 1
    total[g] += took
    most[g] = max(most[g], took)
    if g == 2 or sum(count) % 1000 == 0:
        sums = [round(x * 1e3, 1) for x in total]
        tops = [round(x * 1e3, 2) for x in most]
        objects = len(gc.get_objects()) if g == 2 else ""
        with LOG.open("a") as f:
            f.write(
                f"t={time.perf_counter() - T0:.2f} gen={g} d={took * 1e3:.1f}ms n={count} "
                f"sum={sums} max={tops} objs={objects}\n"
            )


gc.callbacks.append(_timed)

"""Process-wide latency settings of a server (the experiment's `[hw.latency]`): what a process
sets for itself when it starts, and a record of it for the run's summary."""

from __future__ import annotations

import os
import struct
import sys
from typing import Any

from disagg.settings import LatencyConfig

# A spinning main thread holds the GIL between polls, so a wire thread that wants it waits for
# the switch interval (5 ms by default): spinning servers cut it to this.
SPIN_SWITCH_S = 100e-6
_cpu_latency = {"held": "not asked"}


def apply(cfg: LatencyConfig) -> None:
    """Set this process up for `cfg`: the switch interval of a spinning server, and the CPU
    wake-up latency request (held for as long as the process lives)."""
    if cfg.spin:
        sys.setswitchinterval(SPIN_SWITCH_S)
    if cfg.cpu_latency_us is not None:
        hold_cpu_latency(cfg.cpu_latency_us)


def hold_cpu_latency(us: int, path: str = "/dev/cpu_dma_latency") -> str:
    """Hold a PM QoS request for a CPU wake-up latency of at most `us` microseconds, for as
    long as this process lives (closing the file would end it); what happened, in words (also
    in this server's records). A host that refuses it is told on stderr, not an error: the
    run is only slower to wake."""
    try:
        fd = os.open(path, os.O_WRONLY)
        try:
            os.write(fd, struct.pack("i", us))
        except OSError:
            os.close(fd)
            raise
    except OSError as e:
        _cpu_latency["held"] = f"refused: {path}: {e.strerror}"
        print(f"hw.latency.cpu_latency_us={us}: {_cpu_latency['held']}", file=sys.stderr)
    else:
        _cpu_latency["held"] = f"{us} us"  # the descriptor stays open until the process exits
    return _cpu_latency["held"]


def held() -> dict[str, Any]:
    """What this process holds, for its records (the settings themselves are the experiment's,
    in the run's experiment.json)."""
    return {"cpu_latency": _cpu_latency["held"], "switch_interval_s": sys.getswitchinterval()}

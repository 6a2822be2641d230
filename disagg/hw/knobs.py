"""Latency settings of the servers, read from the environment when a server process starts.
They are for experiments (docs/gpu-runs.md lists them with what each measured); the defaults
are the measured best. Servers read them as `knobs.NAME`, so a test can patch them here.
"""

from __future__ import annotations

import os
import struct
import sys
from typing import Any

from disagg.errors import ConfigError

# An idle server sleeps in its poll until a control message or a landing wakes it. With
# DISAGG_SPIN=1 every server polls without sleeping (one busy core each). A spinning main
# thread holds the GIL between polls, so a wire thread that wants it waits for the switch
# interval (5 ms by default): spinning servers cut it to SPIN_SWITCH_S. Measured on H200s at
# 2k prompts (gpu_2026-11-29f.md, -g.md): without that cut whole-request TTFT grew by 1.5 ms;
# with it, decode-first's hop fell from 0.67 to 0.51 ms, but parallel handoff was 0.9 ms
# worse in the same run (1.35 ms in gpu_2026-11-29h.md). Mixed: opt-in.
SPIN = os.environ.get("DISAGG_SPIN", "0") != "0"
SPIN_SWITCH_S = 100e-6
# A decoder with nothing to run plans a request's first pass when it hands the request to
# prefill (Runner.plan_ahead), so the pass only replays its graph when the KV lands.
# DISAGG_PLAN_AHEAD=0 plans it then, as every other pass.
PLAN_AHEAD = os.environ.get("DISAGG_PLAN_AHEAD", "1") != "0"


# Each control message wakes a sleeping thread on both sides (ZeroMQ's I/O threads, and the
# receiving loop): on an idle host every wake-up may first bring a core out of a deep idle
# state. DISAGG_CPU_LATENCY_US=N asks the kernel (PM QoS, /dev/cpu_dma_latency) to keep the
# host's cores out of idle states slower than N us to leave, while the servers live.
def _cpu_latency_us() -> int | None:
    value = os.environ.get("DISAGG_CPU_LATENCY_US", "").strip()
    if not value:
        return None
    if not value.isdigit():
        raise ConfigError(f"DISAGG_CPU_LATENCY_US={value!r}: want whole microseconds, e.g. 0")
    return int(value)


CPU_LATENCY_US = _cpu_latency_us()
_cpu_latency = {"held": "not asked"}


def hold_cpu_latency(us: int, path: str = "/dev/cpu_dma_latency") -> str:
    """Hold a PM QoS request for a CPU wake-up latency of at most `us` microseconds, for as
    long as this process lives (closing the file would end it); what happened, in words (also
    in this server's settings). A host that refuses it is told on stderr, not an error: the
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
        print(f"DISAGG_CPU_LATENCY_US={us}: {_cpu_latency['held']}", file=sys.stderr)
    else:
        _cpu_latency["held"] = f"{us} us"  # the descriptor stays open until the process exits
    return _cpu_latency["held"]


# When a prefill pass ends, the server waits for the pass on the host, then posts the metadata
# (and, under whole-request transfer, the pages). With DISAGG_META_IN_STREAM=1 it posts them as
# soon as the last layer is seen, the cuda wire's copy stream waiting on an event at the end of
# the pass instead of the host (other wires wait for the event on the host). On one H200 at 2k
# prompts that changed neither TTFT nor ready minus prefill start beyond the spread between runs
# (gpu_2026-11-29f.md), so it stays off: the host then stamps the prefill's end only after its
# posts, which would move their host time from "end to ready" into "prefill" in the tables.
META_IN_STREAM = os.environ.get("DISAGG_META_IN_STREAM", "0") != "0"


def settings() -> dict[str, Any]:
    """The latency settings this process runs with, for its records (the DISAGG_* variables
    it was started with, and what they turned on)."""
    return {
        "environment": {k: v for k, v in sorted(os.environ.items()) if k.startswith("DISAGG_")},
        "spin": SPIN,
        "meta_in_stream": META_IN_STREAM,
        "plan_ahead": PLAN_AHEAD,
        "cpu_latency": _cpu_latency["held"],
        "switch_interval_s": sys.getswitchinterval(),
    }

"""Process-wide latency settings of a server (the experiment's `[hw.latency]`): what a process
sets for itself when it starts, and a record of it for the run's summary."""

from __future__ import annotations

import contextlib
import os
import resource
import struct
import sys
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from disagg.settings import LatencyConfig

if TYPE_CHECKING:
    from disagg.config import ClusterConfig

# A spinning main thread holds the GIL between polls, so a wire thread that wants it waits for
# the switch interval (5 ms by default): spinning servers cut it to this.
SPIN_SWITCH_S = 100e-6
_cpu_latency = {"held": "not asked", "cores": "not pinned"}


def apply(cfg: LatencyConfig, slot: int = 0, device: str = "cpu") -> None:
    """Set this process up for `cfg`: the switch interval of a spinning server, the CPU
    wake-up latency request (held for as long as the process lives), and the cores of
    process number `slot` of the host (`process_slot`), near `device`."""
    if cfg.spin:
        sys.setswitchinterval(SPIN_SWITCH_S)
    if cfg.cpu_latency_us is not None:
        hold_cpu_latency(cfg.cpu_latency_us)
    if cfg.cores_per_server:
        pin_cores(cfg.cores_per_server, slot, device, cfg.first_core)


def process_slot(cluster: ClusterConfig, role: str, index: int, rank: int = 0) -> int:
    """Where rank `rank` of node `index` of `role` comes among a run's server processes on one
    host (as the driver starts them: the mode's groups in order, then node, then rank), so that
    each takes cores of its own."""
    before = 0
    for name, group in cluster.groups.items():
        if name == role:
            return before + index * group.gpus_per_node + rank
        before += group.nodes * group.gpus_per_node
    raise ValueError(f"no cluster.{role} group")


def cpu_list(text: str) -> list[int]:
    """The cores of a sysfs cpulist ("0-7,16-23")."""
    cores: list[int] = []
    for part in filter(None, text.strip().split(",")):
        low, _, high = part.partition("-")
        cores.extend(range(int(low), int(high or low) + 1))
    return cores


def near_cores(device: str, sysfs: Path = Path("/sys")) -> list[int]:
    """The cores of `device`'s NUMA node (a GPU's `local_cpulist`); none for the CPU or when
    sysfs does not say."""
    if not device.startswith("cuda"):
        return []
    from disagg.hw.transport.nics import gpu_pci_bus_id

    bus = gpu_pci_bus_id(int(device.partition(":")[2] or 0))
    try:
        return cpu_list((sysfs / "bus/pci/devices" / str(bus) / "local_cpulist").read_text())
    except (OSError, ValueError):
        return []


def host_cores(start: int, n: int, device: str) -> list[int]:
    """Cores `start` to `start + n` of those this process may run on, the cores near `device`
    first; fewer than `n` where the host has too few."""
    allowed = sorted(os.sched_getaffinity(0))
    near = [c for c in near_cores(device) if c in allowed]
    return (near + [c for c in allowed if c not in near])[start : start + n]


def set_cores(cores: Iterable[int]) -> str:
    """Pin every thread of this process (those already started, zmq's, too) to `cores`; the
    main thread's cores as the OS now has them."""
    for task in os.listdir("/proc/self/task"):
        with contextlib.suppress(OSError):  # a thread that has ended since
            os.sched_setaffinity(int(task), cores)
    return ",".join(map(str, sorted(os.sched_getaffinity(0))))


def pin_cores(n: int, slot: int, device: str, first: int = 0) -> str:
    """Pin every thread of this process to `n` cores of its own: the `slot`-th `n` of the
    cores it may run on, those near `device` first, after the `first` first of them. A host
    with too few cores is told on stderr, not an error: the process stays where the OS puts
    it."""
    cores = host_cores(first + slot * n, n, device)
    if len(cores) < n:
        total = len(os.sched_getaffinity(0))
        after = f" after the first {first}" if first else ""
        _cpu_latency["cores"] = f"refused: process {slot} of {n} cores each{after}, {total} cores"
        print(f"hw.latency.cores_per_server={n}: {_cpu_latency['cores']}", file=sys.stderr)
        return _cpu_latency["cores"]
    _cpu_latency["cores"] = set_cores(cores)
    return _cpu_latency["cores"]


@contextlib.contextmanager
def driver_cores(cfg: LatencyConfig, servers: int, device: str) -> Iterator[str]:
    """While the block runs, this process (the driver of `servers` server processes, already
    started: they keep the cores they were given) on `cfg.driver_cores` cores of its own, the
    next after the servers' (`cfg.cores_per_server` each, from `cfg.first_core`); back on its
    own cores after. What it holds, in words ("not pinned" for 0; too few cores is told on
    stderr, not an error)."""
    n = cfg.driver_cores
    cores = host_cores(cfg.first_core + servers * cfg.cores_per_server, n, device)
    if len(cores) < n:
        first = f"{cfg.first_core} + " if cfg.first_core else ""
        said = f"refused: {n} cores after {first}{servers} x {cfg.cores_per_server}"
        print(f"hw.latency.driver_cores={n}: {said}", file=sys.stderr)
    if not n or len(cores) < n:
        yield said if n else "not pinned"
        return
    before = os.sched_getaffinity(0)
    try:
        yield set_cores(cores)
    finally:
        set_cores(before)


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


# /proc/stat's fields of a core, in its order (clock ticks)
CORE_FIELDS = ("user", "nice", "system", "idle", "iowait", "irq", "softirq", "steal")


def cores_time(cores: Iterable[int], stat: Path = Path("/proc/stat")) -> dict[str, float]:
    """Seconds `cores` have spent, all together, in each of /proc/stat's fields since boot
    (`CORE_FIELDS`; none where the host has no /proc/stat)."""
    want, tick = {f"cpu{c}" for c in cores}, os.sysconf("SC_CLK_TCK")
    spent = dict.fromkeys(CORE_FIELDS, 0.0)
    try:
        lines = stat.read_text().splitlines()
    except OSError:
        return {}
    for name, *values in (line.split() for line in lines):
        if name in want:
            for field, v in zip(CORE_FIELDS, values, strict=False):
                spent[field] += int(v) / tick
    return spent


def switches(status: Path = Path("/proc/thread-self/status")) -> tuple[int, int]:
    """(voluntary, involuntary) context switches of the calling thread so far ((0, 0) where
    the host does not say)."""
    counts = {}
    with contextlib.suppress(OSError):
        for line in status.read_text().splitlines():
            key, _, value = line.partition(":")
            counts[key] = value.strip()
    return (
        int(counts.get("voluntary_ctxt_switches", 0)),
        int(counts.get("nonvoluntary_ctxt_switches", 0)),
    )


def usage() -> dict[str, float]:
    """What this process and its cores have spent so far: its wall clock, its CPU time and
    context switches (its main thread's too: the serving loop's), and its cores' time by
    /proc/stat's fields (`cores_time`). Two readings, `used_between`, say what took a
    server's cores from it during a run."""
    own = resource.getrusage(resource.RUSAGE_SELF)
    voluntary, involuntary = switches()
    cores = cores_time(os.sched_getaffinity(0))
    return {
        "wall_s": time.monotonic(),
        "user_s": own.ru_utime,
        "system_s": own.ru_stime,
        "switches": own.ru_nvcsw,
        "switches_forced": own.ru_nivcsw,
        "main_switches": voluntary,
        "main_switches_forced": involuntary,
    } | {f"cores_{k}_s": v for k, v in cores.items()}


def used_between(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """What was spent between two `usage` readings; and `cores_others_s`, the time its cores
    ran anything but this process (their user, nice and system time less its own CPU time:
    another process, or a thread not pinned with it)."""
    spent = {k: after[k] - before[k] for k in before.keys() & after.keys()}
    if "cores_user_s" in spent:
        busy = sum(spent[f"cores_{k}_s"] for k in ("user", "nice", "system"))
        spent["cores_others_s"] = max(busy - spent["user_s"] - spent["system_s"], 0.0)
    return {k: round(v, 6) for k, v in sorted(spent.items())}


def held() -> dict[str, Any]:
    """What this process holds, for its records (the settings themselves are the experiment's,
    in the run's experiment.json)."""
    return {
        "cpu_latency": _cpu_latency["held"],
        "cores": _cpu_latency["cores"],
        "switch_interval_s": sys.getswitchinterval(),
    }

"""Which RDMA NIC, and which GID on its port, the verbs wire uses.

A GPU's traffic should leave through the NIC nearest to it on the PCIe tree (the longest shared
path from the root complex, then the same NUMA node). `choose_nic` applies that rule, or takes
a device named by the caller or by DISAGG_VERBS_DEVICE; `pick_gid_index` chooses a RoCE v2 GID
of its port (IPv4-mapped first), or index 0 on InfiniBand. Both read sysfs under a root given
as a Path, so tests run them on a fake tree; only `device_names` (pyverbs, passed in) and
`gpu_pci_bus_id` (torch, imported when called) touch anything else.

Environment: DISAGG_VERBS_DEVICE (device name, e.g. mlx5_0), DISAGG_VERBS_GID_INDEX,
DISAGG_VERBS_PORT.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from disagg.errors import TransportError

IPV4_MAPPED = "0000:0000:0000:0000:0000:ffff:"  # the prefix of a GID that holds an IPv4 address


def device_names(pv: SimpleNamespace) -> list[str]:
    """Sorted names of the verbs devices (`pv`: verbs.load_pyverbs()); TransportError "no RDMA
    device found" when there is none."""
    try:
        names = sorted(d.name.decode() for d in pv.get_device_list())
    except pv.Error as ex:  # libibverbs raises, rather than returning [], without any device
        raise TransportError(f"no RDMA device found: {ex} (see docs/hardware.md)") from ex
    if not names:
        raise TransportError("no RDMA device found: no verbs driver lists any device")
    return names


def gpu_pci_bus_id(gpu: int) -> str | None:
    """PCI address (`0000:3b:00.0`) of CUDA device `gpu`, from torch; None if it cannot tell."""
    try:
        import torch

        p: Any = torch.cuda.get_device_properties(gpu)
        return f"{p.pci_domain_id:04x}:{p.pci_bus_id:02x}:{p.pci_device_id:02x}.0"
    except Exception:
        return None


def numa_node(dev: Path) -> str:
    """The NUMA node of the PCI device at sysfs folder `dev` as sysfs writes it ("-1": none),
    or "?" when sysfs does not say."""
    with contextlib.suppress(OSError):
        return (dev / "numa_node").read_text().strip()
    return "?"


def nearest_nic(gpu_bus_id: str, nics: Sequence[str], sysfs: Path = Path("/sys")) -> str:
    """The verbs device of `nics` (at least one) closest to the GPU at PCI address `gpu_bus_id`:
    the longest PCIe path shared with the GPU, then the same NUMA node, then the first name."""
    gpu = (sysfs / "bus/pci/devices" / gpu_bus_id).resolve()

    def score(nic: str) -> tuple[int, bool, str]:
        path = (sysfs / "class/infiniband" / nic / "device").resolve()
        shared = len(os.path.commonpath([gpu, path]).split(os.sep))
        return (-shared, numa_node(path) != numa_node(gpu), nic)

    return min(nics, key=score)


def choose_nic(
    names: Sequence[str],
    wanted: str | None,
    gpu: int | None,
    sysfs: Path = Path("/sys"),
    bus_id: Callable[[int], str | None] = gpu_pci_bus_id,
) -> str:
    """The device to open among `names` (sorted, at least one): `wanted` if given (a
    TransportError listing the devices if absent), else the one nearest GPU `gpu` (its PCI
    address from `bus_id`, asked only when there is a choice), else the first."""
    if wanted:
        if wanted not in names:
            raise TransportError(f"verbs device {wanted!r} not found; devices: {list(names)}")
        return wanted
    address = bus_id(gpu) if gpu is not None and len(names) > 1 else None
    return nearest_nic(address, names, sysfs) if address else names[0]


def pick_gid_index(dev: str, port: int, sysfs: Path = Path("/sys")) -> int:
    """The GID index to use on port `port` of device `dev`: index 0 on InfiniBand; on RoCE the
    lowest RoCE v2 GID holding an IPv4 address, else the lowest RoCE v2 GID; TransportError
    naming the fix when the port has no RoCE v2 GID."""
    base = sysfs / "class/infiniband" / dev / "ports" / str(port)
    if (base / "link_layer").read_text().strip() == "InfiniBand":
        return 0
    v2 = []
    for entry in sorted((base / "gids").iterdir(), key=lambda p: int(p.name)):
        gid = entry.read_text().strip()
        if not gid.strip("0:"):
            continue  # unused (most of the table)
        with contextlib.suppress(OSError):
            kind = (base / "gid_attrs/types" / entry.name).read_text().strip()
            if "v2" in kind:
                v2.append((not gid.startswith(IPV4_MAPPED), int(entry.name)))
    if not v2:
        raise TransportError(
            f"no RoCE v2 GID found on {dev} port {port}: give its network interface an IP "
            "address, or set hw.verbs.gid_index"
        )
    return min(v2)[1]

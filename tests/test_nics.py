"""Choosing the verbs wire's NIC and GID from sysfs, on fake sysfs trees: no pyverbs, no NIC."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from disagg.errors import TransportError
from disagg.hw.transport.nics import (
    choose_nic,
    device_names,
    gpu_pci_bus_id,
    nearest_nic,
    numa_node,
    pick_gid_index,
)

# two root complexes (NUMA nodes 0 and 1); a PCIe switch under each holds a GPU and a NIC, and a
# third NIC hangs off another root port of the second complex
PCI = {
    "gpu0": "pci0000:00/0000:00:01.0/0000:01:00.0/0000:02:00.0",
    "mlx5_0": "pci0000:00/0000:00:01.0/0000:01:00.0/0000:02:01.0",
    "gpu1": "pci0000:80/0000:80:01.0/0000:81:00.0/0000:82:00.0",
    "mlx5_1": "pci0000:80/0000:80:01.0/0000:81:00.0/0000:82:01.0",
    "mlx5_2": "pci0000:80/0000:80:02.0/0000:83:00.0",
}
GPU_BUS = {0: "0000:02:00.0", 1: "0000:82:00.0"}


@pytest.fixture
def sysfs(tmp_path: Path) -> Path:
    """A sysfs tree of PCI: devices as folders, NICs and GPUs linked to them as sysfs does."""
    devices = tmp_path / "devices"
    for name, path in PCI.items():
        (devices / path).mkdir(parents=True)
        (devices / path / "numa_node").write_text("0\n" if "pci0000:00" in path else "1\n")
        if name.startswith("mlx5"):
            (tmp_path / "class/infiniband" / name).mkdir(parents=True)
            (tmp_path / "class/infiniband" / name / "device").symlink_to(devices / path)
        else:
            (tmp_path / "bus/pci/devices").mkdir(parents=True, exist_ok=True)
            bus_id = path.rsplit("/", 1)[1]
            (tmp_path / "bus/pci/devices" / bus_id).symlink_to(devices / path)
    return tmp_path


def test_the_nearest_nic_shares_the_longest_pcie_path_then_the_numa_node(sysfs: Path) -> None:
    all_nics = ["mlx5_0", "mlx5_1", "mlx5_2"]
    assert nearest_nic(GPU_BUS[0], all_nics, sysfs) == "mlx5_0"  # under the same switch
    assert nearest_nic(GPU_BUS[1], all_nics, sysfs) == "mlx5_1"
    assert nearest_nic(GPU_BUS[1], ["mlx5_0", "mlx5_2"], sysfs) == "mlx5_2"  # same complex
    assert nearest_nic(GPU_BUS[0], ["mlx5_2", "mlx5_1"], sysfs) == "mlx5_1"  # a tie: by name


def test_numa_node_reads_sysfs_or_says_unknown(sysfs: Path) -> None:
    assert numa_node(sysfs / "devices" / PCI["gpu1"]) == "1"
    assert numa_node(sysfs / "devices") == "?"


def test_a_named_device_wins_else_the_gpus_nearest_else_the_first(sysfs: Path) -> None:
    names = ["mlx5_0", "mlx5_1", "mlx5_2"]
    asked: list[int] = []

    def bus_id(gpu: int) -> str | None:
        asked.append(gpu)
        return GPU_BUS.get(gpu)

    assert choose_nic(names, "mlx5_2", 0, sysfs, bus_id) == "mlx5_2"
    assert choose_nic(names, None, 1, sysfs, bus_id) == "mlx5_1"
    assert choose_nic(names, None, 0, sysfs, bus_id) == "mlx5_0"
    assert choose_nic(names, None, 7, sysfs, bus_id) == "mlx5_0"  # no PCI address: the first
    assert choose_nic(names, None, None, sysfs, bus_id) == "mlx5_0"
    assert asked == [1, 0, 7]
    assert choose_nic(["mlx5_1"], None, 0, sysfs, bus_id) == "mlx5_1"
    assert asked == [1, 0, 7]  # one device: no choice, no GPU asked about
    with pytest.raises(TransportError, match=r"verbs device 'mlx5_9' not found; devices: \["):
        choose_nic(names, "mlx5_9", None, sysfs, bus_id)


def test_a_gpu_torch_cannot_see_has_no_pci_address() -> None:
    pytest.importorskip("torch")
    assert gpu_pci_bus_id(64) is None


def fake_port(root: Path, dev: str, gids: dict[int, tuple[str, str]], link: str) -> Path:
    """Port 1 of `dev`: a GID table of 8 entries (index -> GID, type), the rest unused."""
    port = root / "class/infiniband" / dev / "ports/1"
    (port / "gids").mkdir(parents=True)
    (port / "gid_attrs/types").mkdir(parents=True)
    (port / "link_layer").write_text(link + "\n")
    for i in range(8):
        gid, kind = gids.get(i, ("0000:" * 7 + "0000", ""))
        (port / "gids" / str(i)).write_text(gid + "\n")
        if kind:
            (port / "gid_attrs/types" / str(i)).write_text(kind + "\n")
    return port


V4 = "0000:0000:0000:0000:0000:ffff:0a00:0001"
LINK_LOCAL = "fe80:0000:0000:0000:0202:c9ff:fe00:0001"


def test_gid_choice_prefers_ipv4_mapped_roce_v2(tmp_path: Path) -> None:
    fake_port(tmp_path, "mlx5_0", {0: (LINK_LOCAL, "IB/RoCE v1"), 1: (LINK_LOCAL, "RoCE v2"),
              2: (V4, "IB/RoCE v1"), 3: (V4, "RoCE v2")}, "Ethernet")  # fmt: skip
    assert pick_gid_index("mlx5_0", 1, tmp_path) == 3
    fake_port(tmp_path, "mlx5_1", {0: (LINK_LOCAL, "RoCE v2")}, "Ethernet")
    assert pick_gid_index("mlx5_1", 1, tmp_path) == 0
    fake_port(tmp_path, "mlx5_4", {2: (V4, "RoCE v2"), 5: (V4, "RoCE v2")}, "Ethernet")
    assert pick_gid_index("mlx5_4", 1, tmp_path) == 2  # the lowest of equals
    fake_port(tmp_path, "mlx5_2", {0: (LINK_LOCAL, "IB/RoCE v1")}, "Ethernet")
    with pytest.raises(
        TransportError, match=r"no RoCE v2 GID found on mlx5_2 port 1.*hw.verbs.gid_index"
    ):
        pick_gid_index("mlx5_2", 1, tmp_path)
    fake_port(tmp_path, "mlx5_3", {0: (LINK_LOCAL, "IB/RoCE v1")}, "InfiniBand")
    assert pick_gid_index("mlx5_3", 1, tmp_path) == 0


def test_device_names_are_sorted_and_none_is_a_clear_error() -> None:
    class Failed(Exception):
        pass

    def pv(listing: object) -> SimpleNamespace:
        def get_device_list() -> list[SimpleNamespace]:
            if isinstance(listing, Exception):
                raise listing
            return [SimpleNamespace(name=n.encode()) for n in listing]  # type: ignore[attr-defined]

        return SimpleNamespace(get_device_list=get_device_list, Error=Failed)

    assert device_names(pv(["rxe0", "mlx5_1", "mlx5_0"])) == ["mlx5_0", "mlx5_1", "rxe0"]
    with pytest.raises(TransportError, match="no RDMA device found: no verbs driver"):
        device_names(pv([]))
    with pytest.raises(TransportError, match="no RDMA device found: no devices"):
        device_names(pv(Failed("no devices")))

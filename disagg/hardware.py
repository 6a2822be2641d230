"""Hardware catalogue: GPUs, NICs and nodes (public datasheet figures, dense FLOP/s)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypeVar

from disagg.errors import ConfigError


@dataclass(frozen=True)
class GPU:
    name: str
    bf16_flops: float  # dense FLOP/s
    fp8_flops: float
    hbm_bandwidth_bps: float  # bytes/s
    hbm_bytes: int
    nvlink_bandwidth_bps: float  # bytes/s per direction to the switch

    def flops(self, dtype: str) -> float:
        if dtype == "fp8":
            return self.fp8_flops
        if dtype in ("bf16", "fp16"):
            return self.bf16_flops
        raise ConfigError(f"no FLOP/s figure for dtype {dtype!r} on {self.name}")


@dataclass(frozen=True)
class NIC:
    """One network interface: the transfer model charges bytes/bandwidth + ops*op_cost."""

    name: str
    bandwidth_gbps: float  # line rate, Gbit/s
    latency_s: float  # one-way, first byte
    op_cost_s: float  # NIC/CPU time per posted work request

    @property
    def bandwidth_bps(self) -> float:
        """Bytes per second."""
        return self.bandwidth_gbps * 1e9 / 8


@dataclass(frozen=True)
class Node:
    gpu: GPU
    nic: NIC
    gpus: int = 8
    nics: int = 8

    def nic_of_gpu(self, gpu: int) -> int:
        """Nearest NIC of a GPU: GPUs are spread evenly over the NICs (one each by default)."""
        if not 0 <= gpu < self.gpus:
            raise ConfigError(f"gpu {gpu} out of range 0..{self.gpus - 1}")
        return gpu * self.nics // self.gpus


TB = 1e12
GB = 1e9
GIB = 1 << 30

H100_SXM = GPU(
    "H100-SXM",
    bf16_flops=989e12,
    fp8_flops=1979e12,
    hbm_bandwidth_bps=3.35 * TB,
    hbm_bytes=80 * 10**9,
    nvlink_bandwidth_bps=450 * GB,
)
H200_SXM = GPU(
    "H200-SXM",
    bf16_flops=989e12,
    fp8_flops=1979e12,
    hbm_bandwidth_bps=4.8 * TB,
    hbm_bytes=141 * 10**9,
    nvlink_bandwidth_bps=450 * GB,
)
CONNECTX_7 = NIC("ConnectX-7", bandwidth_gbps=400, latency_s=3e-6, op_cost_s=0.25e-6)
EFA = NIC("EFA", bandwidth_gbps=400, latency_s=15e-6, op_cost_s=1.0e-6)
# The hw backend's cuda wire on H200s, as NICs, to simulate a run of prefill and decode
# processes on one host: one GPU (`cuda-H200`) or two joined by NVLink (`NVLink-H200`).
# Bandwidth: a request's pages copied on the GPU, or as peer copies. Latency: a small post's
# completion, notification included. Per write: the simulator counts one per page per layer,
# while the wire coalesces runs and gathers scattered pages, so this is the per-page cost of a
# coalesced post; the dearer batched copies of 64-512 scattered pages are left out. Where each
# figure comes from: docs/calibration.md.
CUDA_H200 = NIC("cuda-H200", bandwidth_gbps=16_700, latency_s=170e-6, op_cost_s=0.2e-6)
NVLINK_H200 = NIC("NVLink-H200", bandwidth_gbps=3_120, latency_s=130e-6, op_cost_s=0.2e-6)

T = TypeVar("T", "GPU", "NIC")

GPUS = {g.name.lower(): g for g in (H100_SXM, H200_SXM)}
NICS = {n.name.lower(): n for n in (CONNECTX_7, EFA, CUDA_H200, NVLINK_H200)}


def _lookup(table: dict[str, T], kind: str, name: str) -> T:
    key = name.lower()
    if key not in table:
        known = ", ".join(v.name for v in table.values())
        raise ConfigError(f"unknown {kind} {name!r}; known: {known}")
    return table[key]


def get_gpu(name: str) -> GPU:
    return _lookup(GPUS, "GPU", name)


def get_nic(name: str) -> NIC:
    return _lookup(NICS, "NIC", name)

"""Hardware catalogue: GPUs, NICs and nodes (public datasheet figures, dense FLOP/s).

An experiment names a catalogue entry or gives a custom one as a table of every field
(`from_table`); docs/models.md shows both.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from numbers import Real
from typing import Any, TypeVar

from disagg.errors import ConfigError


def _check(obj: GPU | NIC, positive: tuple[str, ...], non_negative: tuple[str, ...] = ()) -> None:
    """Raise ConfigError naming the first field of `obj` that is not a number > 0 (>= 0 for
    `non_negative`), or a `name` that is not a non-empty string."""
    kind = type(obj).__name__
    name = obj.name
    if not isinstance(name, str) or not name:
        raise ConfigError(f"{kind} name={name!r} must be a non-empty string")
    for field in (*positive, *non_negative):
        v = getattr(obj, field)
        bad = isinstance(v, bool) or not isinstance(v, Real) or not math.isfinite(v)
        if bad or (v <= 0 if field in positive else v < 0):
            need = "a number > 0" if field in positive else "a number >= 0"
            raise ConfigError(f"{kind} {name!r}: {field}={v!r} must be {need}")


@dataclass(frozen=True)
class GPU:
    """One accelerator. A GPU without fp8 tensor cores (fp8_flops None) runs fp8 weights at its
    bf16 rate: weight-only fp8, read as 1 byte, multiplied in bf16."""

    name: str
    bf16_flops: float  # dense FLOP/s
    hbm_bandwidth_bps: float  # bytes/s
    hbm_bytes: int
    nvlink_bandwidth_bps: float  # bytes/s per direction to the switch
    fp8_flops: float | None = None  # dense FLOP/s; None: no fp8 tensor cores

    def __post_init__(self) -> None:
        _check(self, ("bf16_flops", "hbm_bandwidth_bps", "hbm_bytes", "nvlink_bandwidth_bps"))
        if self.fp8_flops is not None:
            _check(self, ("fp8_flops",))
        if self.hbm_bytes != int(self.hbm_bytes):
            raise ConfigError(f"GPU {self.name!r}: hbm_bytes={self.hbm_bytes!r} must be whole")
        object.__setattr__(self, "hbm_bytes", int(self.hbm_bytes))  # 80e9 in a file is a float

    def flops(self, dtype: str) -> float:
        if dtype == "fp8":
            return self.bf16_flops if self.fp8_flops is None else self.fp8_flops
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

    def __post_init__(self) -> None:
        _check(self, ("bandwidth_gbps",), ("latency_s", "op_cost_s"))

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
# NVIDIA A100 Tensor Core GPU datasheet (80GB SXM): BF16 312 TFLOP/s dense (624 with sparsity),
# no FP8; 80 GB HBM2e at 2,039 GB/s; NVLink 600 GB/s in both directions together
A100_SXM_80GB = GPU(
    "A100-SXM-80GB",
    bf16_flops=312e12,
    hbm_bandwidth_bps=2039 * GB,
    hbm_bytes=80 * 10**9,
    nvlink_bandwidth_bps=300 * GB,
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

GPUS = {g.name.lower(): g for g in (A100_SXM_80GB, H100_SXM, H200_SXM)}
NICS = {n.name.lower(): n for n in (CONNECTX_7, EFA, CUDA_H200, NVLINK_H200)}
# the catalogue's GPUs by the name CUDA gives the device (torch.cuda.get_device_name): the SXM
# boards only, as PCIe and NVL boards of one chip run at other clocks and bandwidths
DEVICE_NAMES = {
    "NVIDIA A100-SXM4-80GB": A100_SXM_80GB,
    "NVIDIA H100 80GB HBM3": H100_SXM,
    "NVIDIA H200": H200_SXM,
}


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


def from_table(kind: type[T], table: Mapping[str, Any]) -> T:
    """A custom GPU or NIC from an experiment file's table: every field of `kind` given (a
    GPU's fp8_flops may be left out), and a name no catalogue entry has."""
    fields = {f.name: f for f in dataclasses.fields(kind)}
    optional = {n for n, f in fields.items() if f.default is not dataclasses.MISSING}
    unknown = sorted(set(table) - set(fields))
    missing = [n for n in fields if n not in table and n not in optional]
    every, where = ", ".join(fields), f"custom {kind.__name__}"
    if unknown:
        raise ConfigError(f"{where}: unknown field {unknown[0]!r}; its fields: {every}")
    if missing:
        raise ConfigError(
            f"{where}: field {missing[0]!r} missing; give every one of {every}"
            + (f" ({', '.join(sorted(optional))} optional)" if optional else "")
        )
    catalogue: Mapping[str, GPU | NIC] = GPUS if kind is GPU else NICS
    if isinstance(table["name"], str) and table["name"].lower() in catalogue:
        raise ConfigError(
            f"{where}: name {table['name']!r} is a catalogue {kind.__name__}: name the entry "
            "(a string) to use it, or give the custom one another name"
        )
    return kind(**table)

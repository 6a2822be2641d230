"""The one transport interface that the tcp, cuda and verbs wires implement.

A wire moves bytes one way: a sender posts writes from its registered regions into a peer's
registered regions; the last write of each posted unit may carry a 32-bit immediate, which the
receiver sees once every byte of that unit (and of every unit posted before it to the same peer)
has landed. This is RDMA WRITE / WRITE_WITH_IMM semantics on a reliable connection, and the
tcp and cuda wires reproduce it.

Lifecycle on each side:
    wire = make_transport(...)
    desc = wire.register("kv.layer0", buffer)      # -> Descriptor, sent to the peer
    wire.connect(peer_name, peer_info)              # peer_info from the peer's local_info()
    wire.post(peer_name, units, wr_id)              # sender
    wire.poll() -> Polled(completions, immediates)  # both sides
    wire.close()
Descriptors and `local_info()` are plain JSON-able dicts carried by the control plane.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, overload

import numpy as np

from disagg.errors import TransportError


@dataclass(frozen=True)
class Descriptor:
    """What a peer needs to write into a registered region (JSON-able via `to_dict`)."""

    wire: str
    region: str
    nbytes: int
    info: dict[str, Any] = field(default_factory=dict)  # rkey/address, IPC handle, ...

    def to_dict(self) -> dict[str, Any]:
        return {"wire": self.wire, "region": self.region, "nbytes": self.nbytes, "info": self.info}

    @staticmethod
    def from_dict(d: dict[str, Any]) -> Descriptor:
        return Descriptor(d["wire"], d["region"], int(d["nbytes"]), dict(d.get("info", {})))


@dataclass(frozen=True)
class Write:
    """Copy `nbytes` from local region `src` at `src_offset` to the peer's region `dst`."""

    src: str
    src_offset: int
    dst: str
    dst_offset: int
    nbytes: int


class WriteArray(Sequence[Write]):
    """Many writes between one pair of regions, as integer arrays (optional, for speed).

    Write i copies `nbytes[i]` bytes from `src` at `src_offsets[i]` to `dst` at `dst_offsets[i]`
    (numpy int64 arrays or lists of equal length). It is a Sequence[Write], so every wire accepts
    it inside a Unit; a wire may instead read the arrays and skip building one Write per element
    (the cuda wire does: a 4k-token Llama-8B request is 8192 page writes).
    """

    def __init__(self, src: str, dst: str, src_offsets: Any, dst_offsets: Any, nbytes: Any) -> None:
        if not len(src_offsets) == len(dst_offsets) == len(nbytes):
            raise ValueError("WriteArray: offsets and sizes must have equal lengths")
        self.src, self.dst = src, dst
        self.src_offsets, self.dst_offsets, self.nbytes = src_offsets, dst_offsets, nbytes

    def __len__(self) -> int:
        return len(self.nbytes)

    @overload
    def __getitem__(self, i: int) -> Write: ...

    @overload
    def __getitem__(self, i: slice) -> Sequence[Write]: ...

    def __getitem__(self, i: int | slice) -> Write | Sequence[Write]:
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        return Write(
            self.src,
            int(self.src_offsets[i]),
            self.dst,
            int(self.dst_offsets[i]),
            int(self.nbytes[i]),
        )


Runs = tuple[np.ndarray, np.ndarray, np.ndarray]  # src offsets, dst offsets, sizes (int64)


def coalesce(wa: WriteArray) -> Runs:
    """Merge consecutive writes that continue each other on both sides into one run."""
    s, d, n = (np.asarray(x, dtype=np.int64) for x in (wa.src_offsets, wa.dst_offsets, wa.nbytes))
    if len(n) < 2:
        return s, d, n
    cont = (s[:-1] + n[:-1] == s[1:]) & (d[:-1] + n[:-1] == d[1:])
    starts = np.flatnonzero(np.concatenate([[True], ~cont]))
    return s[starts], d[starts], np.add.reduceat(n, starts)


def coalesced(writes: Sequence[Write]) -> Sequence[Write]:
    """A WriteArray's writes with contiguous neighbours merged (others are returned as given)."""
    if not isinstance(writes, WriteArray):
        return writes
    s, d, n = coalesce(writes)
    return WriteArray(writes.src, writes.dst, s, d, n)


def total_bytes(writes: Sequence[Write]) -> int:
    """Bytes of `writes`, without building one Write per element of a WriteArray."""
    if isinstance(writes, WriteArray):
        return int(np.sum(np.asarray(writes.nbytes, dtype=np.int64)))
    return sum(w.nbytes for w in writes)


@dataclass(frozen=True)
class Unit:
    """Writes posted together; `imm` (if not None) rides on the last one."""

    writes: Sequence[Write]
    imm: int | None = None


@dataclass(frozen=True)
class Completion:
    """A posted batch (identified by the sender's `wr_id`) finished, or failed with `error`."""

    wr_id: int
    ok: bool
    error: str = ""


@dataclass
class Polled:
    completions: list[Completion] = field(default_factory=list)
    immediates: list[int] = field(default_factory=list)
    # when each immediate reached this endpoint (time.time(), as its wire's receiving thread
    # saw it), one per immediate
    arrived_s: list[float] = field(default_factory=list)


class Transport(ABC):
    """One endpoint of a wire. Not thread-safe unless a subclass says so."""

    name: str = "abstract"

    @abstractmethod
    def register(self, region: str, buffer: Any) -> Descriptor:
        """Register memory (bytearray/numpy/torch tensor, per wire) under a region name."""

    @abstractmethod
    def local_info(self) -> dict[str, Any]:
        """Connection data a peer passes to `connect` (address, QP numbers, ...)."""

    @abstractmethod
    def connect(self, peer: str, info: dict[str, Any], regions: Sequence[Descriptor]) -> None:
        """Connect to `peer` and learn the peer's registered regions."""

    @abstractmethod
    def post(self, peer: str, units: Sequence[Unit], wr_id: int) -> None:
        """Queue units of writes to `peer`; one Completion with `wr_id` reports them all."""

    @abstractmethod
    def poll(self) -> Polled:
        """Completions of posted batches and immediates received since the last poll."""

    def wake_fd(self) -> int | None:
        """A file descriptor that turns readable when immediates arrive (poll() clears it), for
        a loop that sleeps until then; None if this wire has none (poll it instead)."""
        return None

    # -- faults (disagg.faults), on the wires that can inject them
    def reset(self, peer: str) -> None:
        """Drop the connection to `peer`: its posts in flight fail; the next reconnects."""
        raise TransportError(f"the {self.name} wire cannot drop a connection on request")

    def impair(self, for_s: float, bytes_per_s: float = 0.0) -> None:
        """For `for_s`, move nothing (0) or at most `bytes_per_s` to any peer."""
        raise TransportError(f"the {self.name} wire cannot take its NIC down on request")

    @abstractmethod
    def close(self) -> None:
        """Release connections and registrations; idempotent."""

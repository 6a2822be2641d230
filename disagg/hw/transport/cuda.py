"""The cuda wire: GPU memory between processes of one host, through CUDA IPC.

A registered tensor's descriptor carries its CUDA IPC handle (torch's own sharing format,
pickled and base64-encoded). The sender maps the peer's regions in `connect`, and `post` issues
device copies on the wire's own stream at once: writes that continue each other are coalesced
into one copy, and the remaining runs of a unit go out as one batched copy (`_foreach_copy_`),
or, from GATHER_MIN_RUNS runs of whole rows (scattered pages), as one gather into a temporary
and one scatter into place (`gather`: 843 against 42-52 GB/s for 2048 pages on an H200).
Writes given as a WriteArray are validated and coalesced with numpy, not one by one.

After each unit with an immediate the sender records an event; a worker thread waits for it
and only then sends the immediate to the receiver over a TCP side channel, so the receiver sees
an immediate only once the bytes of that unit and every earlier one are in its memory. Batches
complete when the receiver has acknowledged them; a dead receiver fails them with its name.

A peer whose regions live on another GPU is mapped differently: torch would map them in a
context of *that* GPU, and the driver stages copies into such a mapping through the host. The
descriptor also carries a driver IPC handle (`cudadriver.export`), which the sender opens in its
own GPU's context with peer access, and copies go out as cuMemcpyDtoDAsync (NVLink peer copies),
one per run. Pages scattered on both sides would cost one driver call each (17-24 GB/s for
64 KiB pages on two H200s), so by default (`peer_kernels`) the mapping is also wrapped as a
tensor of the sender's GPU, and a group of several runs goes out as one batched copy like a
local peer's: kernels on the sender's GPU that write through the peer mapping (195 GB/s for the
same 4k-token request); a single run stays one driver copy.

Units of one post that repeat the same runs in regions lying at one distance from each other on
both sides (the layers of a KV cache allocated as one tensor, when a post carries several layers)
go out as one copy per run instead, a row per layer (`stack`): between two storages of this GPU
a strided torch copy of 16-byte words (as fast as one plain copy of the same bytes, where one
copy per layer reaches 73% for a 4k-token Llama-8B request), into a region mapped by address a
driver 2D copy. A local peer's layers stack only up to STACK_MAX_RUNS runs per layer (more go
better as batched copies), and a group that would go as a gather (below) does not stack, into a
mapped peer either: one gather per layer beat the stacked 2D copies at 32k scattered tokens on
two H200s (298 against 265 GB/s). One event then vouches for every unit of the stack.

The copies do not wait for other streams: post only bytes already written (the layer counter
guarantees this for KV pages) or synchronise first.
"""

from __future__ import annotations

import base64
import contextlib
import itertools
import os
import pickle
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch.multiprocessing.reductions import rebuild_cuda_tensor, reduce_tensor

from disagg.errors import TransportError
from disagg.hw.transport import cudadriver
from disagg.hw.transport._wire import IMM, Link, SocketWire, check_imm, frame
from disagg.hw.transport.base import (
    Descriptor,
    Runs,
    Unit,
    Write,
    WriteArray,
    coalesce,
)

Events = tuple[list[tuple[torch.cuda.Event, int]], torch.cuda.Event]


@dataclass(frozen=True)
class Mapped:
    """A peer region on another GPU, mapped in this endpoint's context: copied by address, or
    (`view`, a tensor of this GPU over the mapping) by kernels when a group has many runs."""

    ptr: int
    nbytes: int
    view: torch.Tensor | None = field(default=None, compare=False)
    base: int = 0  # the mapped allocation's address: one 2D copy stays within one allocation

    def numel(self) -> int:
        return self.nbytes


Group = tuple[torch.Tensor, torch.Tensor | Mapped, Runs]  # source, destination, runs
STACK_MAX_RUNS = 16  # runs per layer up to which a local peer's layers go as stacked copies


WORD = 16  # bytes per element of a stacked local copy (complex128): the fastest measured
# runs of whole rows from which a group goes as one gather and one scatter: on one H200, 256
# scattered 64 KiB pages moved at 670 GB/s as a batched copy and 541 as a gather, 2048 at 42-52
# against 843-845 (benchmarks/results/gpu_2026-11-29f.md)
GATHER_MIN_RUNS = 512
GATHER_MIN_ROW = 1024  # bytes: smaller rows (a run much shorter than the others) stay batched


def _address(t: torch.Tensor | Mapped) -> int:
    return t.ptr if isinstance(t, Mapped) else t.data_ptr()


def _same_storage(a: torch.Tensor | Mapped, b: torch.Tensor | Mapped) -> bool:
    """Both are views of one torch storage (a region mapped by address is none)."""
    if isinstance(a, Mapped) or isinstance(b, Mapped):
        return False
    return bool(a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr())


def _same_base(a: torch.Tensor | Mapped, b: torch.Tensor | Mapped) -> bool:
    return isinstance(a, Mapped) and isinstance(b, Mapped) and a.base == b.base


def _unaligned(src: torch.Tensor, dst: torch.Tensor | Mapped, *offsets: np.ndarray) -> bool:
    """True unless both regions and every offset and size are whole 16-byte words."""
    starts = (src.data_ptr(), _address(dst))
    return any(a % WORD for a in starts) or any(bool((o % WORD).any()) for o in offsets)


def _whole_rows(src: torch.Tensor, dst: torch.Tensor | Mapped, runs: Runs) -> int:
    """The shortest run's size in bytes if every run of `runs` is whole rows of it, at
    row-aligned offsets of 8-byte-aligned tensors whose sizes are whole rows; else 0."""
    s, d, n = runs
    row = int(n.min())
    whole = (
        row % 8 == 0
        and not (n % row).any()
        and all(
            t.numel() % row == 0 and _address(t) % 8 == 0 and not (o % row).any()
            for t, o in ((src, s), (dst, d))
        )
    )
    return row if whole else 0


def _rows(t: torch.Tensor, first: int, pitch: int, width: int, rows: int) -> torch.Tensor:
    """`rows` rows of `width` bytes, `pitch` bytes apart from byte `first` of the flat uint8
    region `t`, as 16-byte words: a view of t's storage (which must hold every row)."""
    view = t.as_strided((rows, width), (pitch, 1), t.storage_offset() + first)
    return view.view(torch.complex128)


def _row_numbers(offsets: np.ndarray, sizes: np.ndarray, row: int) -> np.ndarray:
    """The rows of `row` bytes that runs at `offsets` of `sizes` bytes (whole rows) cover."""
    per, first = sizes // row, offsets // row
    if (per == 1).all():
        return first
    return np.repeat(first - (np.cumsum(per) - per), per) + np.arange(int(per.sum()))


def row_index(runs: Runs, row: int, device: torch.device) -> torch.Tensor:
    """[2, rows] row numbers (source, destination) of runs of whole `row`-byte rows, on
    `device` (from pinned memory on a GPU, so that the copy does not wait for the stream)."""
    s, d, n = runs
    index = torch.from_numpy(np.stack([_row_numbers(s, n, row), _row_numbers(d, n, row)]))
    if device.type == "cuda":
        index = index.pin_memory().to(device, non_blocking=True)
    return index


def gather_copy(src: torch.Tensor, dst: torch.Tensor, index: torch.Tensor, row: int) -> None:
    """Copy the `row`-byte rows that `index` names between flat uint8 regions of one device as
    two kernels on the current stream: gather the source rows into a temporary, scatter them
    into place. Thousands of runs in one batched copy go slowly; this moves every byte twice.
    Destination rows must not repeat (as for any batched copy, the order would be undefined)."""
    width = row // 8
    rows = src.view(torch.int64).view(-1, width).index_select(0, index[0])
    dst.view(torch.int64).view(-1, width).index_copy_(0, index[1], rows)


def as_arrays(writes: Sequence[Write]) -> list[WriteArray]:
    """`writes` grouped by (src, dst) region pair as arrays, in order within each pair."""
    if isinstance(writes, WriteArray):
        return [writes]
    groups: dict[tuple[str, str], list[Write]] = {}
    for w in writes:
        groups.setdefault((w.src, w.dst), []).append(w)
    return [
        WriteArray(
            src, dst, [w.src_offset for w in ws], [w.dst_offset for w in ws], [w.nbytes for w in ws]
        )
        for (src, dst), ws in groups.items()
    ]


def tensor_at(ptr: int, nbytes: int, device: torch.device) -> torch.Tensor:
    """A uint8 tensor of `device` over `nbytes` of memory at `ptr` that torch did not allocate
    and will not free (here: a peer's region mapped in this GPU's context)."""
    make = getattr(torch._C, "_construct_storage_from_data_pointer", None)
    if make is None:
        raise TransportError(f"cuda wire: torch {torch.__version__} cannot wrap a mapped region")
    return torch.empty(0, dtype=torch.uint8, device=device).set_(make(ptr, device, nbytes))


def _wait_and_notify(link: Link, job: Events) -> None:
    """Worker side: send each immediate once its unit's copies are done, then finish. The
    immediates of one event (a stacked copy's units) leave in one send."""
    marks, final = job
    for _, same in itertools.groupby(marks, key=lambda mark: id(mark[0])):
        group = list(same)
        group[0][0].synchronize()
        link.send(b"".join(frame(IMM, imm) for _, imm in group))
    final.synchronize()


class CudaTransport(SocketWire):
    """One cuda endpoint; all of its registered regions live on one GPU."""

    name = "cuda"

    def __init__(
        self,
        endpoint: str = "",
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        by_address: bool = False,
        peer_kernels: bool | None = None,
        stack: bool | None = None,
        gather: bool | None = None,
    ) -> None:
        """`by_address` maps every peer region through the driver, also on this GPU (tests use
        it to run the two-GPU copy path on one GPU); by default only other GPUs' regions.
        `peer_kernels` copies groups of several runs into such regions with kernels of this GPU
        instead of one driver copy per run (default: on, unless DISAGG_WIRE_PEER_KERNELS=0, or
        torch cannot wrap the mapping). `stack` sends the units of one post that repeat the
        same runs in regions at a uniform distance (the layers of one KV allocation) as one
        copy per run, a row per unit (default: on, unless DISAGG_WIRE_STACK=0). `gather` sends a
        group of at least GATHER_MIN_RUNS runs of whole rows (scattered pages) as one gather
        and one scatter kernel instead of one batched copy, or a stacked one (default: on,
        unless DISAGG_WIRE_GATHER=0)."""
        if not torch.cuda.is_available():
            raise TransportError("the cuda wire needs a CUDA GPU, and torch sees none")
        super().__init__(endpoint, host, port, {})
        self.by_address = by_address
        if peer_kernels is None:
            peer_kernels = os.environ.get("DISAGG_WIRE_PEER_KERNELS", "1") != "0"
        self.peer_kernels = peer_kernels
        if stack is None:
            stack = os.environ.get("DISAGG_WIRE_STACK", "1") != "0"
        self.stack = stack
        if gather is None:
            gather = os.environ.get("DISAGG_WIRE_GATHER", "1") != "0"
        self.gather = gather
        self.device: torch.device | None = None
        self._stream: torch.cuda.Stream | None = None
        self._local: dict[str, torch.Tensor] = {}
        self._remote: dict[str, dict[str, torch.Tensor | Mapped]] = {}
        self._opened: dict[bytes, int] = {}  # driver IPC handle -> base address mapped here
        self._rows: dict[tuple[int, int, int], tuple[torch.Tensor, tuple[torch.Tensor, ...]]] = {}
        self._indexes: dict[int, tuple[Runs, torch.Tensor]] = {}  # gathers' row numbers, per post

    def register(self, region: str, buffer: Any) -> Descriptor:
        self._check_open()
        if not isinstance(buffer, torch.Tensor) or buffer.device.type != "cuda":
            raise TransportError("the cuda wire registers CUDA tensors only")
        if not buffer.is_contiguous():
            raise TransportError("the cuda wire needs a contiguous tensor")
        if region in self._local:
            raise TransportError(f"region {region!r} is already registered")
        if self.device is None:
            self.device = buffer.device
            self._stream = torch.cuda.Stream(buffer.device)
        elif buffer.device != self.device:
            raise TransportError(f"all regions of one endpoint live on {self.device}")
        flat = buffer.reshape(-1).view(torch.uint8)
        self._local[region] = flat
        _, args = reduce_tensor(flat)
        info = {"ipc": base64.b64encode(pickle.dumps(args)).decode(), "device": flat.device.index}
        try:  # a handle for senders on other GPUs (not for torch's expandable segments)
            with torch.cuda.device(flat.device):
                handle, offset = cudadriver.export(flat.data_ptr())
            info |= {"cu_ipc": base64.b64encode(handle).decode(), "cu_offset": offset}
        except TransportError:
            pass
        return Descriptor(self.name, region, flat.numel(), info)

    def connect(self, peer: str, info: dict[str, Any], regions: Sequence[Descriptor]) -> None:
        self._check_new_peer(peer)
        mapped: dict[str, torch.Tensor | Mapped] = {}
        for d in regions:
            try:
                other_gpu = self.device is not None and d.info["device"] != self.device.index
                if (other_gpu or self.by_address) and "cu_ipc" in d.info:
                    mapped[d.region] = self._map(d)
                    continue
                mapped[d.region] = rebuild_cuda_tensor(
                    *pickle.loads(base64.b64decode(d.info["ipc"]))
                )
            except (RuntimeError, KeyError) as e:
                raise TransportError(
                    f"cuda: cannot map region {d.region!r} of {peer!r}: {e}"
                ) from e
        self._remote[peer] = mapped
        self._links[peer] = Link(self.name, peer, info, self.endpoint, _wait_and_notify, self._done)

    def _map(self, d: Descriptor) -> Mapped:
        """A region on another GPU, opened in this endpoint's context (each allocation once):
        its address, and (`peer_kernels`) a tensor of this GPU over it."""
        handle = base64.b64decode(d.info["cu_ipc"])
        if handle not in self._opened:
            with torch.cuda.device(self.device):
                self._opened[handle] = cudadriver.open_handle(handle)
        ptr = self._opened[handle] + int(d.info["cu_offset"])
        view = None
        if self.peer_kernels:
            assert self.device is not None
            with contextlib.suppress(TransportError):  # a torch that cannot wrap it: by address
                view = tensor_at(ptr, d.nbytes, self.device)
        return Mapped(ptr, d.nbytes, view, self._opened[handle])

    @property
    def stream(self) -> torch.cuda.Stream | None:
        """The stream the copies run on (None until a region is registered)."""
        return self._stream

    def _resolve(
        self, peer: str, wa: WriteArray, seen: dict[tuple[int, ...], tuple[Any, ...]]
    ) -> tuple[torch.Tensor, torch.Tensor | Mapped, Runs]:
        """The two regions and the coalesced runs of `wa`; TransportError if out of bounds.
        `seen` keeps the runs of arrays already coalesced in this post: the units of a
        multi-layer post share one set of offsets (the same pages in every layer). It holds
        the arrays too, so that no id is reused while it lives."""
        src, dst = self._local.get(wa.src), self._remote[peer].get(wa.dst)
        if src is None or dst is None:
            raise TransportError(f"unknown region {wa.src!r} -> {wa.dst!r} (local, or of {peer!r})")
        key = (id(wa.src_offsets), id(wa.dst_offsets), id(wa.nbytes))
        if key not in seen:
            s, d, n = runs = coalesce(wa)
            if len(n) and min(s.min(), d.min(), n.min() - 1) < 0:
                raise TransportError(f"a write {wa.src!r} -> {wa.dst!r} is out of bounds")
            ends = (int((s + n).max()), int((d + n).max())) if len(n) else (0, 0)
            seen[key] = (runs, *ends, (wa.src_offsets, wa.dst_offsets, wa.nbytes))
        runs, src_end, dst_end, _ = seen[key]
        if src_end > src.numel() or dst_end > dst.numel():
            raise TransportError(f"a write {wa.src!r} -> {wa.dst!r} is out of bounds")
        return src, dst, runs

    def _views(
        self, t: torch.Tensor, offsets: np.ndarray, sizes: np.ndarray, row: int, words: bool
    ) -> list[torch.Tensor]:
        """Byte ranges of `t`: uint8 slices, or (`words`) int64 views where single rows of
        `row` bytes come from a cached split (one list lookup each instead of a new slice)."""
        spans = zip(offsets.tolist(), sizes.tolist(), strict=True)
        if not words:
            return [t[o : o + k] for o, k in spans]
        key = (t.data_ptr(), t.numel(), row)
        if key not in self._rows:
            w = t.view(torch.int64)
            self._rows[key] = (w, w.view(-1, row // 8).unbind(0))
        w, rows = self._rows[key]
        return [rows[o // row] if k == row else w[o // 8 : (o + k) // 8] for o, k in spans]

    def _copy(self, src: torch.Tensor, dst: torch.Tensor | Mapped, runs: Runs) -> None:
        """Issue one group's copies on the current (wire) stream: one copy, or one batched copy
        (another GPU's region: one driver copy per run, or kernels through its view)."""
        s, d, n = runs
        if isinstance(dst, Mapped) and dst.view is not None and len(n) > 1:
            dst = dst.view
        if isinstance(dst, Mapped):
            assert self._stream is not None
            base, stream = src.data_ptr(), self._stream.cuda_stream
            for so, do, k in zip(s.tolist(), d.tolist(), n.tolist(), strict=True):
                cudadriver.copy_async(dst.ptr + do, base + so, k, stream)
        elif len(n) == 1:
            dst[d[0] : d[0] + n[0]].copy_(src[s[0] : s[0] + n[0]], non_blocking=True)
        elif len(n):
            row = _whole_rows(src, dst, runs)
            if self._gathers(src, dst, len(n), row):
                key = id(runs)  # the same runs for every layer of a post: one index
                if key not in self._indexes:  # (held with its runs, so the id stays theirs)
                    self._indexes[key] = (runs, row_index(runs, row, src.device))
                gather_copy(src, dst, self._indexes[key][1], row)
                return
            dsts, srcs = (self._views(t, o, n, row, row > 0) for t, o in ((dst, d), (src, s)))
            torch._foreach_copy_(dsts, srcs, non_blocking=True)

    def _gathers(self, src: torch.Tensor, dst: torch.Tensor | Mapped, runs: int, row: int) -> bool:
        """Whether a group of `runs` runs of whole `row`-byte rows (0: not whole rows) goes as
        a gather: into a tensor of this device (another GPU's region through this GPU's view
        of it, not a peer tensor of the other's context)."""
        if isinstance(dst, Mapped):
            if dst.view is None:
                return False
            dst = dst.view
        return (
            self.gather
            and runs >= GATHER_MIN_RUNS
            and row >= GATHER_MIN_ROW
            and src.device == dst.device
        )

    def post(self, peer: str, units: Sequence[Unit], wr_id: int) -> None:
        self._check_open()
        self._indexes = {}
        if peer not in self._links or self._stream is None:
            raise TransportError(f"not connected to peer {peer!r} (or nothing registered)")
        plan: list[tuple[list[Group], int | None]] = []
        seen: dict[tuple[int, ...], tuple[Any, ...]] = {}
        for unit in units:  # validate everything before issuing anything
            check_imm(unit)
            groups = [self._resolve(peer, wa, seen) for wa in as_arrays(unit.writes)]
            plan.append((groups, unit.imm))
        marks = []
        with torch.cuda.stream(self._stream):
            i = 0
            while i < len(plan):
                k = self._stackable(plan, i) if self.stack and i + 1 < len(plan) else 1
                if k > 1:
                    self._copy_stacked([groups[0] for groups, _ in plan[i : i + k]])
                else:
                    for src, dst, runs in plan[i][0]:
                        self._copy(src, dst, runs)
                imms = [imm for _, imm in plan[i : i + k] if imm is not None]
                if imms:  # one event vouches for every unit of a stacked copy
                    event = torch.cuda.Event()
                    event.record(self._stream)
                    marks += [(event, imm) for imm in imms]
                i += k
            final = torch.cuda.Event()
            final.record(self._stream)
        self._links[peer].submit((marks, final), wr_id)

    def _stackable(self, plan: list[tuple[list[Group], int | None]], i: int) -> int:
        """How many units from `plan[i]` on write the same runs between regions that lie at
        one distance from each other on both sides (the layers of one KV allocation): they go
        out as one copy per run, a row per unit (`_copy_stacked`). 1 if none can join."""
        if len(plan[i][0]) != 1:
            return 1
        src0, dst0, runs0 = plan[i][0][0]
        s0, d0, n0 = runs0
        mapped = isinstance(dst0, Mapped)
        if not len(n0):
            return 1
        if len(n0) >= GATHER_MIN_RUNS and self._gathers(
            src0, dst0, len(n0), _whole_rows(src0, dst0, runs0)
        ):
            return 1  # many scattered pages: a gather per unit beats a stacked copy per run
        if mapped:
            assert self.device is not None
            limit = cudadriver.max_pitch(self.device.index or 0)
        elif len(n0) > STACK_MAX_RUNS or _unaligned(src0, dst0, s0, d0, n0):
            return 1
        else:
            limit = 1 << 62
        k, pitches = 1, (0, 0)
        while i + k < len(plan) and len(plan[i + k][0]) == 1:
            src, dst, (s, d, n) = plan[i + k][0][0]
            if isinstance(dst, Mapped) != mapped or not _same_storage(src, src0):
                break  # a strided view (or 2D copy) spans one allocation
            if not (_same_base(dst, dst0) if mapped else _same_storage(dst, dst0)):
                break
            step = (src.data_ptr() - src0.data_ptr(), _address(dst) - _address(dst0))
            if k == 1:
                if min(step) < int(n0.max()) or max(step) > limit or step[0] % WORD:
                    break  # pitch >= width, within the device's limit
                if step[1] < int((d0 + n0).max() - d0.min()):
                    break  # one unit's rows would overwrite another's: keep the units' order
                if step[1] % WORD and not mapped:
                    break
                pitches = step
            elif step != (k * pitches[0], k * pitches[1]):
                break
            if not all(a is b or np.array_equal(a, b) for a, b in ((s, s0), (d, d0), (n, n0))):
                break
            k += 1
        return k

    def _copy_stacked(self, groups: list[Group]) -> None:
        """One copy per run of `groups[0]`, a row per group (see `_stackable`): a strided torch
        copy of 16-byte words between two storages of this GPU (as fast as one plain copy of
        the same bytes on an H200), a driver 2D copy into a region mapped by address."""
        (src0, dst0, (s, d, n)), (src1, dst1, _) = groups[0], groups[1]
        sp, dp, rows = (
            src1.data_ptr() - src0.data_ptr(),
            _address(dst1) - _address(dst0),
            len(groups),
        )
        spans = zip(s.tolist(), d.tolist(), n.tolist(), strict=True)
        if isinstance(dst0, Mapped):
            assert self._stream is not None
            base_s, stream = src0.data_ptr(), self._stream.cuda_stream
            for so, do, k in spans:
                cudadriver.copy_2d_async(dst0.ptr + do, dp, base_s + so, sp, k, rows, stream)
            return
        for so, do, k in spans:
            _rows(dst0, do, dp, k, rows).copy_(_rows(src0, so, sp, k, rows), non_blocking=True)

    def close(self) -> None:
        super().close()
        self._remote.clear()
        self._rows.clear()
        for ptr in self._opened.values():
            with contextlib.suppress(TransportError):
                cudadriver.close_handle(ptr)
        self._opened.clear()

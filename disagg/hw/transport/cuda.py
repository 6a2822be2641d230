"""The cuda wire: GPU memory between processes of one host, through CUDA IPC.

A registered tensor's descriptor carries its CUDA IPC handle: what torch's own sharing sends,
as plain JSON values checked on arrival (`IpcHandle`; nothing a peer sends is unpickled). The
sender maps the peer's regions in `connect`; `post` validates every unit, groups each unit's
writes by region pair and coalesces writes that continue each other into runs (a WriteArray
with numpy, not one write at a time), then issues device copies on the wire's own stream at
once. Which copies carry a group is the copy planner's choice (`copyplan`), issuing them the
copier's (`copier`): one batched copy of the runs (`_foreach_copy_`), or, from GATHER_MIN_RUNS
runs of whole rows (scattered pages), one gather into a temporary and one scatter into place
(`gather`).

After each unit with an immediate the sender records an event; a worker thread waits for it
and only then sends the immediate to the receiver over a TCP side channel, so the receiver sees
an immediate only once the bytes of that unit and every earlier one are in its memory. Batches
complete when the receiver has acknowledged them; a dead receiver fails them with its name.

A peer whose regions live on another GPU is mapped differently: torch would map them in a
context of *that* GPU, and the driver stages copies into such a mapping through the host. The
descriptor also carries a driver IPC handle (`cudadriver.export`), which the sender opens in its
own GPU's context with peer access, and copies go out as cuMemcpyDtoDAsync (NVLink peer copies),
one per run. Pages scattered on both sides would cost one driver call each, so by default
(`peer_kernels`) the mapping is also wrapped as a tensor of the sender's GPU, and a group of
several runs goes out as one batched copy like a local peer's: kernels on the sender's GPU that
write through the peer mapping; a single run stays one driver copy.

Units of one post that repeat the same runs in regions lying at one distance from each other on
both sides (the layers of a KV cache allocated as one tensor, when a post carries several layers)
go out as one copy per run instead, a row per layer (`stack`): between two storages of this GPU
a strided torch copy of 16-byte words, into a region mapped by address a driver 2D copy. A local
peer's layers stack only up to STACK_MAX_RUNS runs per layer (more go as batched copies), and a
group that would go as a gather does not stack, into a mapped peer either (a gather per layer
is chosen over stacked 2D copies there). One event then vouches for every unit of the stack.
docs/gpu-runs.md gives the measurements behind these choices.

A node of several ranks on GPUs (disagg.hw.ranks) has each follower export its KV pages
(`export_info`) and its leader map them (`map_exported`); the leader's one endpoint registers
them with the follower's export (`register_mapped`), which its peers map, as they would the
follower's own registration.

The copies do not wait for other streams: post only bytes already written (the layer counter
guarantees this for KV pages) or synchronise first.
"""

from __future__ import annotations

import base64
import contextlib
import itertools
import re
from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Any

import torch
from torch.multiprocessing.reductions import rebuild_cuda_tensor, reduce_tensor

from disagg.errors import TransportError
from disagg.hw.transport import cudadriver
from disagg.hw.transport._wire import IMM, Link, SocketWire, check_imm, frame
from disagg.hw.transport.base import Descriptor, Runs, Unit, WriteArray, coalesce
from disagg.hw.transport.copier import Copier
from disagg.hw.transport.copyplan import Mapped, Plan, Region, as_arrays, stackable

Events = tuple[list[tuple[torch.cuda.Event, int]], torch.cuda.Event]


def tensor_at(ptr: int, nbytes: int, device: torch.device) -> torch.Tensor:
    """A uint8 tensor of `device` over `nbytes` of memory at `ptr` that torch did not allocate
    and will not free (here: a peer's region mapped in this GPU's context)."""
    make = getattr(torch._C, "_construct_storage_from_data_pointer", None)
    if make is None:
        raise TransportError(f"cuda wire: torch {torch.__version__} cannot wrap a mapped region")
    return torch.empty(0, dtype=torch.uint8, device=device).set_(make(ptr, device, nbytes))


_HANDLE_MAX_BYTES = 1 << 20  # torch's allocation handle (longer for expandable segments)
_IPC_HANDLE_BYTES = 64  # CUDA_IPC_HANDLE_SIZE: an event handle
_SHM_NAME = re.compile(rb"/?[A-Za-z0-9_.-]{1,250}")  # torch's ref counter: a shared-memory name
_MAX_DEVICE = 1 << 10
_MAX_SIZE = 1 << 62


@dataclass(frozen=True)
class IpcHandle:
    """What a peer needs to map a flat uint8 CUDA tensor through torch's IPC (the fields of
    `UntypedStorage._share_cuda_()` and where the tensor lies in its storage), as plain values.
    `to_json` gives JSON values (bytes as base64); `from_json` checks a peer's, so that nothing
    but these values reaches torch; `rebuild_args` are `rebuild_cuda_tensor`'s arguments."""

    device: int  # the GPU's index
    handle: bytes | None  # the allocation's (None: an empty storage)
    storage_nbytes: int
    storage_offset: int  # bytes from the allocation's start
    ref_counter: bytes | None  # the shared-memory name of the producer's reference counter
    ref_counter_offset: int
    event: bytes | None  # an IPC event handle to wait on (when `event_sync`)
    event_sync: bool | None
    tensor_offset: int  # bytes from the storage's start
    numel: int  # bytes

    @staticmethod
    def of(flat: torch.Tensor) -> IpcHandle:
        """The handle of `flat`, a contiguous 1-D uint8 CUDA tensor."""
        _, args = reduce_tensor(flat)
        _, size, _, offset, _, _, device, handle, nbytes, storage_offset, _, *rest = args
        ref_counter, ref_offset, event, event_sync = rest
        return IpcHandle(
            device=device,
            handle=handle,
            storage_nbytes=nbytes,
            storage_offset=storage_offset,
            ref_counter=ref_counter,
            ref_counter_offset=ref_offset,
            event=event,
            event_sync=event_sync,
            tensor_offset=offset,
            numel=int(size[0]),
        )

    def to_json(self) -> dict[str, Any]:
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        return {
            k: base64.b64encode(v).decode() if isinstance(v, bytes) else v
            for k, v in values.items()
        }

    @staticmethod
    def from_json(data: Any, nbytes: int) -> IpcHandle:
        """The handle a peer sent for a region of `nbytes`; TransportError naming the first field
        that is missing, of the wrong type, or out of range."""
        if not isinstance(data, dict):
            raise TransportError(f"cuda: an IPC handle is an object, not {type(data).__name__}")
        names = [f.name for f in fields(IpcHandle)]
        if set(data) != set(names):
            got = sorted(str(k) for k in data)
            raise TransportError(f"cuda: an IPC handle has the fields {names}, not {got}")
        ints = {
            n: _int_field(data, n, _MAX_DEVICE if n == "device" else _MAX_SIZE)
            for n in names
            if n not in ("handle", "ref_counter", "event", "event_sync")
        }
        handle = _bytes_field(data, "handle", _HANDLE_MAX_BYTES)
        ref_counter = _bytes_field(data, "ref_counter", 255)
        event = _bytes_field(data, "event", _IPC_HANDLE_BYTES)
        sync = data["event_sync"]
        if sync is not None and not isinstance(sync, bool):
            raise TransportError(f"cuda: IPC handle field event_sync is {type(sync).__name__}")
        if ref_counter is not None and not _SHM_NAME.fullmatch(ref_counter):
            raise TransportError("cuda: IPC handle field ref_counter is not a shared-memory name")
        if event is not None and len(event) != _IPC_HANDLE_BYTES:
            raise TransportError(f"cuda: IPC handle field event is {len(event)} bytes, not 64")
        if (handle is None or ref_counter is None) and ints["storage_nbytes"]:
            raise TransportError("cuda: an IPC handle of a non-empty storage lacks its handle")
        if ints["numel"] != nbytes:
            raise TransportError(f"cuda: IPC handle field numel {ints['numel']} != {nbytes} bytes")
        if ints["tensor_offset"] + ints["numel"] > ints["storage_nbytes"]:
            raise TransportError("cuda: IPC handle fields tensor_offset + numel pass the storage")
        return IpcHandle(
            handle=handle, ref_counter=ref_counter, event=event, event_sync=sync, **ints
        )

    def rebuild_args(self) -> tuple[Any, ...]:
        """`rebuild_cuda_tensor`'s arguments (as `reduce_tensor` gives them for a flat uint8
        tensor): the tensor over this handle's bytes."""
        return (
            torch.Tensor, torch.Size([self.numel]), (1,), self.tensor_offset,
            torch.storage.TypedStorage, torch.uint8, self.device, self.handle,
            self.storage_nbytes, self.storage_offset, False, self.ref_counter,
            self.ref_counter_offset, self.event, self.event_sync,
        )  # fmt: skip


def _int_field(data: dict[str, Any], name: str, end: int) -> int:
    value = data.get(name)
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < end:
        raise TransportError(
            f"cuda: IPC handle field {name} must be an int in [0, {end}), not {value!r:.40}"
        )
    return value


def _bytes_field(data: dict[str, Any], name: str, max_bytes: int) -> bytes | None:
    """A base64 field of at most `max_bytes` bytes, or None."""
    value = data.get(name)
    if value is None:
        return None
    if not isinstance(value, str) or len(value) > 4 * (max_bytes // 3 + 1):
        raise TransportError(
            f"cuda: IPC handle field {name} must be base64 of at most {max_bytes} bytes"
        )
    try:
        return base64.b64decode(value, validate=True)
    except ValueError as e:
        raise TransportError(f"cuda: IPC handle field {name} is not base64") from e


def export_info(flat: torch.Tensor) -> dict[str, Any]:
    """What a process of this host needs to map `flat`, a flat uint8 CUDA tensor this process
    allocated, as plain JSON values: torch's IPC handle (`IpcHandle`), its GPU, and, where the
    driver gives one (not for torch's expandable segments), a driver IPC handle for processes
    on other GPUs (`map_exported`, `CudaTransport.connect`)."""
    info: dict[str, Any] = {"ipc": IpcHandle.of(flat).to_json(), "device": flat.device.index}
    try:
        with torch.cuda.device(flat.device):
            handle, offset = cudadriver.export(flat.data_ptr())
        info |= {"cu_ipc": base64.b64encode(handle).decode(), "cu_offset": offset}
    except TransportError:
        pass
    return info


def map_exported(info: Any, nbytes: int, device: torch.device) -> torch.Tensor:
    """A uint8 tensor of `device` over the `nbytes` that another process of this host exported
    as `info` (`export_info`): through torch's IPC if they lie on `device`, else opened in
    `device`'s context with peer access and wrapped (copies on `device` read and write them
    over NVLink). The mapping lasts as long as this process; the owner must keep the memory.
    TransportError naming the field or the failure if it cannot be mapped."""
    if not isinstance(info, dict):
        raise TransportError(f"cuda: an export is an object, not {type(info).__name__}")
    owner = _int_field(info, "device", _MAX_DEVICE)
    try:
        if owner == device.index:
            ipc = IpcHandle.from_json(info.get("ipc"), nbytes)
            return rebuild_cuda_tensor(*ipc.rebuild_args())
        handle = _bytes_field(info, "cu_ipc", _IPC_HANDLE_BYTES)
        if handle is None or len(handle) != _IPC_HANDLE_BYTES:
            raise TransportError(f"memory of GPU {owner} came without a driver IPC handle")
        offset = _int_field(info, "cu_offset", _MAX_SIZE)
        with torch.cuda.device(device):
            ptr = cudadriver.open_handle(handle) + offset
        return tensor_at(ptr, nbytes, device)
    except (RuntimeError, TransportError) as e:
        raise TransportError(f"cuda: cannot map GPU {owner}'s memory on {device}: {e}") from e


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
        peer_kernels: bool = True,
        stack: bool = True,
        gather: bool = True,
    ) -> None:
        """`by_address` maps every peer region through the driver, also on this GPU (tests use
        it to run the two-GPU copy path on one GPU); by default only other GPUs' regions.
        `peer_kernels` copies groups of several runs into such regions with kernels of this GPU
        instead of one driver copy per run (unless torch cannot wrap the mapping). `stack`
        sends the units of one post that repeat the same runs in regions at a uniform distance
        (the layers of one KV allocation) as one copy per run, a row per unit. `gather` sends a
        group of at least GATHER_MIN_RUNS runs of whole rows (scattered pages) as one gather
        and one scatter kernel instead of one batched copy, or a stacked one. The experiment's
        `[hw.cuda]` sets the three."""
        if not torch.cuda.is_available():
            raise TransportError("the cuda wire needs a CUDA GPU, and torch sees none")
        super().__init__(endpoint, host, port, {})
        self.by_address = by_address
        self.peer_kernels, self.stack = peer_kernels, stack
        self._copier = Copier(gather)
        self.device: torch.device | None = None
        self._stream: torch.cuda.Stream | None = None
        self._local: dict[str, torch.Tensor] = {}
        self._remote: dict[str, dict[str, Region]] = {}
        self._opened: dict[bytes, int] = {}  # driver IPC handle -> base address mapped here

    def register(self, region: str, buffer: Any) -> Descriptor:
        flat = self._add(region, buffer)
        return Descriptor(self.name, region, flat.numel(), export_info(flat))

    def register_mapped(self, region: str, buffer: Any, info: dict[str, Any]) -> Descriptor:
        """Register `buffer`, this process's mapping (`map_exported`) of memory that another
        process of this host allocated and exported as `info` (`export_info`): a node's leader
        registering its followers' pages. Copies read `buffer`; peers map the owner's memory
        from `info`, since a process cannot export again what it only maps (CUDA IPC)."""
        flat = self._add(region, buffer)
        try:
            IpcHandle.from_json(info.get("ipc"), flat.numel())  # the owner's, of these bytes
        except TransportError:
            del self._local[region]
            raise
        return Descriptor(self.name, region, flat.numel(), info)

    def _add(self, region: str, buffer: Any) -> torch.Tensor:
        """`buffer` as a local region's flat bytes (the endpoint's GPU set by the first)."""
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
            self._copier.stream = self._stream.cuda_stream
        elif buffer.device != self.device:
            raise TransportError(f"all regions of one endpoint live on {self.device}")
        flat = buffer.reshape(-1).view(torch.uint8)
        self._local[region] = flat
        return flat

    def connect(self, peer: str, info: dict[str, Any], regions: Sequence[Descriptor]) -> None:
        self._check_new_peer(peer)
        mapped: dict[str, Region] = {}
        for d in regions:
            try:
                device = _int_field(d.info, "device", _MAX_DEVICE)
                other_gpu = self.device is not None and device != self.device.index
                if (other_gpu or self.by_address) and "cu_ipc" in d.info:
                    mapped[d.region] = self._map(d)
                    continue
                ipc = IpcHandle.from_json(d.info.get("ipc"), d.nbytes)
                mapped[d.region] = rebuild_cuda_tensor(*ipc.rebuild_args())
            except (RuntimeError, TransportError) as e:
                raise TransportError(
                    f"cuda: cannot map region {d.region!r} of {peer!r}: {e}"
                ) from e
        self._remote[peer] = mapped
        self._links[peer] = Link(self.name, peer, info, self.endpoint, _wait_and_notify, self._done)

    def _map(self, d: Descriptor) -> Mapped:
        """A region on another GPU, opened in this endpoint's context (each allocation once):
        its address, and (`peer_kernels`) a tensor of this GPU over it."""
        handle = _bytes_field(d.info, "cu_ipc", _IPC_HANDLE_BYTES)
        if handle is None or len(handle) != _IPC_HANDLE_BYTES:
            raise TransportError("a driver IPC handle (cu_ipc) is 64 bytes")
        offset = _int_field(d.info, "cu_offset", _MAX_SIZE)
        if handle not in self._opened:
            with torch.cuda.device(self.device):
                self._opened[handle] = cudadriver.open_handle(handle)
        ptr = self._opened[handle] + offset
        view = None
        if self.peer_kernels:
            assert self.device is not None
            with contextlib.suppress(TransportError):  # a torch that cannot wrap it: by address
                view = tensor_at(ptr, d.nbytes, self.device)
        return Mapped(ptr, d.nbytes, view, self._opened[handle])

    def _max_pitch(self) -> int:
        """The largest pitch in bytes of a 2D copy on this endpoint's GPU."""
        assert self.device is not None
        return cudadriver.max_pitch(self.device.index or 0)

    @property
    def gather(self) -> bool:
        """Whether a group of many runs of whole rows goes as one gather and one scatter."""
        return self._copier.gather

    @property
    def stream(self) -> torch.cuda.Stream | None:
        """The stream the copies run on (None until a region is registered)."""
        return self._stream

    def _resolve(
        self, peer: str, wa: WriteArray, seen: dict[tuple[int, ...], tuple[Any, ...]]
    ) -> tuple[torch.Tensor, Region, Runs]:
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

    def post(self, peer: str, units: Sequence[Unit], wr_id: int) -> None:
        self._check_open()
        self._copier.start_post()
        if peer not in self._links or self._stream is None:
            raise TransportError(f"not connected to peer {peer!r} (or nothing registered)")
        plan: Plan = []
        seen: dict[tuple[int, ...], tuple[Any, ...]] = {}
        for unit in units:  # validate everything before issuing anything
            check_imm(unit)
            groups = [self._resolve(peer, wa, seen) for wa in as_arrays(unit.writes)]
            plan.append((groups, unit.imm))
        marks = []
        with torch.cuda.stream(self._stream):
            i = 0
            while i < len(plan):
                k = 1
                if self.stack and i + 1 < len(plan):
                    k = stackable(plan, i, gather=self.gather, max_pitch=self._max_pitch)
                if k > 1:
                    self._copier.copy_stacked([groups[0] for groups, _ in plan[i : i + k]])
                else:
                    for src, dst, runs in plan[i][0]:
                        self._copier.copy(src, dst, runs)
                imms = [imm for _, imm in plan[i : i + k] if imm is not None]
                if imms:  # one event vouches for every unit of a stacked copy
                    event = torch.cuda.Event()
                    event.record(self._stream)
                    marks += [(event, imm) for imm in imms]
                i += k
            final = torch.cuda.Event()
            final.record(self._stream)
        self._links[peer].submit((marks, final), wr_id)

    def close(self) -> None:
        super().close()
        self._remote.clear()
        self._copier.clear()
        for ptr in self._opened.values():
            with contextlib.suppress(TransportError):
                cudadriver.close_handle(ptr)
        self._opened.clear()

"""The tcp wire: CPU memory between processes over TCP sockets (loopback by default).

A background thread per incoming connection writes each WRITE frame's payload straight into the
registered buffer and records its immediate after the bytes landed; frames of one connection
are applied in order, so an immediate also implies every earlier unit from that sender landed.
Batches complete when the receiver acknowledges them; a broken connection fails every open
batch with an error naming the peer (`_wire` says how senders authenticate, how receivers check
frames and how a broken link reconnects). A write longer than MAX_FRAME_BYTES goes as several
frames.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from disagg.errors import TransportError
from disagg.hw.transport._wire import (
    HAS_IMM,
    IMM,
    MAX_FRAME_BYTES,
    SMALL,
    WRITE,
    Link,
    SocketWire,
    check_imm,
    frame,
)
from disagg.hw.transport.base import (
    Descriptor,
    Unit,
    coalesced,
)

FLUSH_BYTES = 1 << 20


def byte_view(buffer: Any) -> memoryview:
    """A writable flat byte view of a bytearray, numpy array or contiguous CPU torch tensor."""
    if hasattr(buffer, "untyped_storage"):  # a torch tensor, without importing torch here
        if buffer.device.type != "cpu":
            raise TransportError("the tcp wire moves CPU memory; use the cuda wire for GPU tensors")
        if not buffer.is_contiguous():
            raise TransportError("the tcp wire needs a contiguous tensor")
        import torch

        buffer = buffer.reshape(-1).view(torch.uint8).numpy()
    try:
        view = memoryview(buffer)
    except TypeError as e:
        raise TransportError(
            f"cannot register a {type(buffer).__name__}: need a bytearray, "
            "numpy array or CPU tensor"
        ) from e
    if view.readonly or not view.c_contiguous:
        raise TransportError("a registered buffer must be writable and contiguous")
    return view.cast("B")


def _send_job(link: Link, job: list[tuple[bytes, memoryview]]) -> None:
    """Send WRITE frames, coalescing small payloads with their headers."""
    buf = bytearray()
    for header, payload in job:
        buf += header
        if len(payload) < SMALL:
            buf += payload
        else:
            link.send(buf)
            buf = bytearray()
            link.send(payload)
        if len(buf) >= FLUSH_BYTES:
            link.send(buf)
            buf = bytearray()
    if buf:
        link.send(buf)


class TcpTransport(SocketWire):
    """One tcp endpoint: listens on (host, port) for writers, connects to peers to write.

    endpoint names this side in the peer's errors; port 0 picks a free port. Thread-safe.
    """

    name = "tcp"

    def __init__(self, endpoint: str = "", host: str = "127.0.0.1", port: int = 0) -> None:
        self._views: dict[str, memoryview] = {}
        self._by_id: dict[int, memoryview] = {}
        super().__init__(endpoint, host, port, self._by_id)
        self._peer_regions: dict[str, dict[str, Descriptor]] = {}

    def register(self, region: str, buffer: Any) -> Descriptor:
        self._check_open()
        if region in self._views:
            raise TransportError(f"region {region!r} is already registered")
        view = byte_view(buffer)
        rid = len(self._views)
        self._views[region] = view
        self._by_id[rid] = view
        return Descriptor(self.name, region, len(view), {"id": rid})

    def connect(self, peer: str, info: dict[str, Any], regions: Sequence[Descriptor]) -> None:
        self._check_new_peer(peer)
        self._peer_regions[peer] = {d.region: d for d in regions}
        self._links[peer] = Link(self.name, peer, info, self.endpoint, _send_job, self._done)

    def _job(self, peer: str, units: Sequence[Unit]) -> list[tuple[bytes, memoryview]]:
        remote = self._peer_regions[peer]
        job = []
        for unit in units:
            check_imm(unit)
            if not unit.writes and unit.imm is not None:
                job.append((frame(IMM, unit.imm), memoryview(b"")))
            writes = coalesced(unit.writes)  # one frame per run
            for i, w in enumerate(writes):
                src, dst = self._views.get(w.src), remote.get(w.dst)
                if src is None or dst is None:
                    raise TransportError(f"unknown region in write {w} (local or of peer {peer!r})")
                if w.src_offset + w.nbytes > len(src) or w.dst_offset + w.nbytes > dst.nbytes:
                    raise TransportError(f"write {w} is out of bounds")
                for start in range(0, max(w.nbytes, 1), MAX_FRAME_BYTES):
                    nbytes = min(MAX_FRAME_BYTES, w.nbytes - start)
                    last = i == len(writes) - 1 and start + nbytes == w.nbytes
                    imm = unit.imm if last else None
                    header = frame(
                        WRITE,
                        imm or 0,
                        dst.info["id"],
                        w.dst_offset + start,
                        nbytes,
                        HAS_IMM if imm is not None else 0,
                    )
                    at = w.src_offset + start
                    job.append((header, src[at : at + nbytes]))
        return job

    def post(self, peer: str, units: Sequence[Unit], wr_id: int) -> None:
        self._check_open()
        if peer not in self._links:
            raise TransportError(f"not connected to peer {peer!r}")
        self._links[peer].submit(self._job(peer, units), wr_id)

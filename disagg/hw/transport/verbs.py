"""The verbs wire: RDMA WRITE / WRITE_WITH_IMM on reliable-connected (RC) queue pairs, via pyverbs.

Connecting (`rendezvous`): `local_info()` names the endpoint's GID and its rendezvous QP, a
small UD queue pair. `connect(peer, info, regions)` creates one RC QP for that peer and sends a
request (QP number, PSN, GID, MTU) to the peer's rendezvous QP; the peer's background thread
answers with a QP of its own already moved to RTS, and our QP goes to RTS. Only the sender calls
`connect`: the receiver just registers, publishes `local_info()` and its descriptors, and polls.
A peer that never answers raises TransportError after `connect_timeout_s`.

Sending: each Write becomes an RDMA WRITE work request; adjacent writes into one contiguous
remote range share a WR as a scatter-gather list, and a unit's immediate rides on its last WR as
WRITE_WITH_IMM. One QP per peer keeps every unit in order, which is what makes an immediate mean
"this unit and all before it have landed" (several QPs per peer would break that). Only every
`sq_depth // 2`-th WR and the last WR of each `post` are signalled; WRs beyond the send queue's
depth wait in a software backlog. A background thread (and every `poll`) drains the completion
queues, refills the send queue from the backlog and reposts the receives that immediates
consume. A failed work completion fails every batch still queued to that peer, with an error
naming the peer and the status (IBV_WC_REM_ACCESS_ERR, IBV_WC_RETRY_EXC_ERR, ...).

Memory: host memory (bytearray, numpy, CPU torch tensors) is registered as ordinary MRs; CUDA
tensors through dma-buf (`DmaBufMR`), where remote addresses are offsets from the exported
range's base. pyverbs is imported lazily: Debian's 44 (`pyverbs.enums`) and PyPI's 59
(`pyverbs.libibverbs_enums`) both work.

Device (`nics`): the one named by `device` or DISAGG_VERBS_DEVICE, else the one nearest GPU `gpu`
on the PCIe tree, else the first; port `port` or DISAGG_VERBS_PORT (1); GID index `gid_index`
or DISAGG_VERBS_GID_INDEX, else a RoCE v2 GID of that port (0 on InfiniBand).
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib
import os
import random
import socket
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from disagg.errors import TransportError
from disagg.hw.transport.base import Completion, Descriptor, Polled, Transport, Unit, coalesced
from disagg.hw.transport.nics import (
    choose_nic,
    device_names,
    pick_gid_index,
)
from disagg.hw.transport.rendezvous import (
    Rendezvous,
    Reply,
    Request,
    drain,
    local_info,
    peer_address,
    rts_attrs,
    to_rts,
)

_CONN_SHIFT = 40  # a send wr_id is (connection number << 40) | WR sequence number
_MAX_WR_BYTES = 1 << 30
_WC_STATUS = [
    "SUCCESS", "LOC_LEN_ERR", "LOC_QP_OP_ERR", "LOC_EEC_OP_ERR", "LOC_PROT_ERR", "WR_FLUSH_ERR",
    "MW_BIND_ERR", "BAD_RESP_ERR", "LOC_ACCESS_ERR", "REM_INV_REQ_ERR", "REM_ACCESS_ERR",
    "REM_OP_ERR", "RETRY_EXC_ERR", "RNR_RETRY_EXC_ERR", "LOC_RDD_VIOL_ERR", "REM_INV_RD_REQ_ERR",
    "REM_ABORT_ERR", "INV_EECN_ERR", "INV_EEC_STATE_ERR", "FATAL_ERR", "RESP_TIMEOUT_ERR",
    "GENERAL_ERR",
]  # fmt: skip
_WC_HINT = {
    4: "a local range lies outside its registered region",
    5: "flushed: the queue pair was already in the error state",
    10: "remote access error: the peer's rkey/address does not cover this write "
    "(rkey mismatch, or the peer's region is gone)",
    12: "transport retry count exceeded: the peer does not answer "
    "(its process or QP is gone, or the link is down)",
    13: "receiver not ready: the peer posted no receive for an immediate",
}


def wc_status_name(status: int) -> str:
    name = _WC_STATUS[status] if 0 <= status < len(_WC_STATUS) else f"status {status}"
    return f"IBV_WC_{name}"


def load_pyverbs() -> SimpleNamespace:
    """The pyverbs names this wire uses; TransportError naming the fix when pyverbs is absent."""
    try:
        mods = {m: importlib.import_module(f"pyverbs.{m}") for m in ("addr", "cq", "device")}
        mods |= {m: importlib.import_module(f"pyverbs.{m}") for m in ("mr", "pd", "qp", "wr")}
        err = importlib.import_module("pyverbs.pyverbs_error")
    except ImportError as ex:
        raise TransportError(
            f"the verbs wire needs pyverbs ({ex}): `apt-get install python3-pyverbs` (and put "
            "/usr/lib/python3/dist-packages/pyverbs on the path) or `pip install pyverbs`"
        ) from ex
    try:
        enums = importlib.import_module("pyverbs.libibverbs_enums")  # rdma-core >= 59
    except ImportError:
        enums = importlib.import_module("pyverbs.enums")  # rdma-core 44 (Debian bookworm)
    a, m, q, w = mods["addr"], mods["mr"], mods["qp"], mods["wr"]
    return SimpleNamespace(
        e=enums, Error=err.PyverbsError, get_device_list=mods["device"].get_device_list,
        Context=mods["device"].Context, PD=mods["pd"].PD, CQ=mods["cq"].CQ, MR=m.MR,
        DmaBufMR=getattr(m, "DmaBufMR", None), QP=q.QP, QPAttr=q.QPAttr, QPCap=q.QPCap,
        QPInitAttr=q.QPInitAttr, AHAttr=a.AHAttr, GlobalRoute=a.GlobalRoute, GID=a.GID,
        SGE=w.SGE, SendWR=w.SendWR, RecvWR=w.RecvWR, AH=a.AH,
    )  # fmt: skip


def buffer_address(buffer: Any) -> tuple[int, int, bool]:
    """(address, nbytes, is_cuda) of a contiguous writable buffer or torch tensor."""
    if hasattr(buffer, "data_ptr") and hasattr(buffer, "is_contiguous"):
        if not buffer.is_contiguous():
            raise TransportError("verbs: only contiguous tensors can be registered")
        return buffer.data_ptr(), buffer.numel() * buffer.element_size(), bool(buffer.is_cuda)
    try:
        view = memoryview(buffer)
    except TypeError as ex:
        raise TransportError(f"verbs: cannot register a {type(buffer).__name__}") from ex
    if view.readonly or not view.c_contiguous:
        raise TransportError("verbs: registered memory must be writable and contiguous")
    return ctypes.addressof(ctypes.c_char.from_buffer(view)), view.nbytes, False


@dataclass
class _Region:
    addr: int  # what the NIC sees: the virtual address, or the offset in a dma-buf
    nbytes: int
    mr: Any
    keep: Any = None  # the buffer itself, kept alive while registered
    fd: int = -1  # the dma-buf, closed after the MR


@dataclass
class _Remote:
    addr: int
    rkey: int
    nbytes: int


@dataclass
class _WR:
    """One work request to post: a gather list written to one contiguous remote range."""

    sges: list[tuple[int, int, int]]  # (address, length, lkey)
    raddr: int
    rkey: int
    imm: int | None = None
    batch: int | None = None  # the post's wr_id, on its last WR

    @property
    def nbytes(self) -> int:
        return sum(s[1] for s in self.sges)


@dataclass
class _Peer:
    """Our sending side of one connection: its QP, the peer's regions, and queued writes."""

    name: str
    info: dict[str, Any]
    qp: Any
    conn: int  # this connection's number, in the high bits of every wr_id posted on it
    remote: dict[str, _Remote]
    backlog: deque[_WR] = field(default_factory=deque)
    signalled: deque[tuple[int, int, int | None]] = field(default_factory=deque)  # seq, WRs, batch
    in_flight: int = 0
    seq: int = 0
    unsignalled: int = 0
    error: str = ""


class VerbsTransport(Transport):
    """RDMA WRITE / WRITE_WITH_IMM to connected peers. Thread-safe: a background thread accepts
    connections and moves the queues; every public method holds the same lock."""

    name = "verbs"

    def __init__(
        self,
        endpoint: str = "",
        *,
        device: str | None = None,
        gpu: int | None = None,
        port: int | None = None,
        gid_index: int | None = None,
        sq_depth: int = 256,
        rq_depth: int = 256,
        connect_timeout_s: float = 30.0,
        ack_timeout: int = 14,
        sysfs: Path = Path("/sys"),
    ) -> None:
        if sq_depth < 2 or rq_depth < 1:
            raise TransportError(f"verbs: sq_depth {sq_depth} must be >= 2, rq_depth >= 1")
        self.endpoint = endpoint or f"{socket.gethostname()}:{os.getpid()}"
        self.sq_depth, self.rq_depth = sq_depth, rq_depth
        self.connect_timeout_s, self.ack_timeout = connect_timeout_s, ack_timeout
        self._pv = pv = load_pyverbs()
        names = device_names(pv)
        self.device = choose_nic(names, device, gpu, sysfs)
        self.port = port or 1
        self._ctx = pv.Context(name=self.device)
        self._check_port()
        if gid_index is None:
            gid_index = pick_gid_index(self.device, self.port, sysfs)
        self.gid_index = gid_index
        self.gid = self._query_gid()
        dev = self._ctx.query_device()
        self._max_sge = min(dev.max_sge, 16)
        self._cqe = min(dev.max_cqe, 1 << 16)
        self._pd = pv.PD(self._ctx)
        self._send_cq = pv.CQ(self._ctx, self._cqe, None, None, 0)
        self._recv_cq = pv.CQ(self._ctx, self._cqe, None, None, 0)
        self._scratch = pv.MR(self._pd, 64, self._access)
        self._recv_wr = pv.RecvWR(num_sge=1, sg=[pv.SGE(self._scratch.buf, 0, self._scratch.lkey)])
        self._rendezvous = Rendezvous(pv, self._ctx, self._pd, self.port, self.gid_index)
        self._regions: dict[str, _Region] = {}
        self._peers: dict[str, _Peer] = {}
        self._by_qpn: dict[int, _Peer] = {}  # our sending QPs
        self._accepted: dict[tuple[str, int, int, str], Reply] = {}  # Request.key -> reply
        self._receiving: dict[int, Any] = {}  # QPs that peers write into, by number
        self._replies: dict[int, Reply] = {}  # by request id
        self._conns = 0
        self._out = Polled()
        self._lock = threading.RLock()
        self._stop = threading.Event()
        self._closed = False
        self._broken = ""  # why the progress thread stopped, if it did
        self._thread = threading.Thread(
            target=self._run, name=f"verbs-{self.endpoint}", daemon=True
        )
        self._thread.start()

    # --- setup -----------------------------------------------------------------------------
    @property
    def _access(self) -> int:
        e = self._pv.e
        return int(e.IBV_ACCESS_LOCAL_WRITE | e.IBV_ACCESS_REMOTE_WRITE)

    def _check_port(self) -> None:
        attr = self._ctx.query_port(self.port)
        if attr.state != self._pv.e.IBV_PORT_ACTIVE:
            states = {1: "DOWN", 2: "INIT", 3: "ARMED", 5: "ACTIVE_DEFER"}
            raise TransportError(
                f"verbs: port {self.port} of {self.device} is {states.get(attr.state, attr.state)}"
                " (not ACTIVE): check the link (`rdma link`, `ibv_devinfo`)"
            )
        self._mtu = int(attr.active_mtu)

    def _query_gid(self) -> str:
        try:
            gid = str(self._ctx.query_gid(self.port, self.gid_index))
        except self._pv.Error as ex:
            raise TransportError(
                f"verbs: GID index {self.gid_index} not found on {self.device} "
                f"port {self.port}: {ex}"
            ) from ex
        if not gid.strip("0:"):
            raise TransportError(
                f"verbs: GID index {self.gid_index} of {self.device} port {self.port} is empty "
                f"(leave hw.verbs.gid_index unset to pick one)"
            )
        return gid

    def _new_qp(self, recv_wr: int) -> Any:
        pv = self._pv
        queued = (len(self._by_qpn) + 1) * self.sq_depth, (len(self._receiving) + 1) * recv_wr
        if max(queued) > self._cqe:
            raise TransportError(f"verbs: {self.device}'s CQs ({self._cqe}) cannot take more QPs")
        cap = pv.QPCap(max_send_wr=self.sq_depth, max_recv_wr=recv_wr, max_send_sge=self._max_sge)
        init = pv.QPInitAttr(
            qp_type=pv.e.IBV_QPT_RC, scq=self._send_cq, rcq=self._recv_cq, cap=cap, sq_sig_all=0
        )
        attr = pv.QPAttr()
        attr.qp_access_flags, attr.port_num, attr.pkey_index = self._access, self.port, 0
        return pv.QP(self._pd, init, attr)  # returned in INIT

    def _to_rts(self, qp: Any, gid: str, remote: Request | Reply, sq_psn: int) -> None:
        """INIT -> RTR -> RTS towards the `remote` end's QP at `gid`."""
        attrs = rts_attrs(
            access=self._access, port=self.port, local_mtu=self._mtu, remote=remote,
            sq_psn=sq_psn, ack_timeout=self.ack_timeout,
        )  # fmt: skip
        to_rts(self._pv, qp, attrs, gid, self.port, self.gid_index)

    # --- Transport -------------------------------------------------------------------------
    def register(self, region: str, buffer: Any) -> Descriptor:
        """Register host memory (bytearray, numpy, CPU tensor) or a CUDA tensor (dma-buf)."""
        addr, nbytes, is_cuda = buffer_address(buffer)
        with self._lock:
            self._check_open()
            if region in self._regions:
                raise TransportError(f"verbs: region {region!r} is already registered")
            if nbytes < 1:
                raise TransportError(f"verbs: region {region!r} is empty")
            if is_cuda:
                reg = self._register_dmabuf(addr, nbytes)
            else:
                try:
                    mr = self._pv.MR(self._pd, nbytes, self._access, address=addr)
                except self._pv.Error as ex:
                    raise TransportError(f"verbs: registering {region!r} failed: {ex}") from ex
                reg = _Region(addr, nbytes, mr)
            reg.keep = buffer
            self._regions[region] = reg
        return Descriptor("verbs", region, nbytes, {"addr": reg.addr, "rkey": reg.mr.rkey})

    def _register_dmabuf(self, ptr: int, nbytes: int) -> _Region:
        if self._pv.DmaBufMR is None:
            raise TransportError("verbs: this pyverbs has no DmaBufMR (rdma-core >= 34 needed)")
        page = os.sysconf("SC_PAGE_SIZE")
        base = ptr - ptr % page
        size = -(-(ptr + nbytes - base) // page) * page
        fd = _cuda_dmabuf_fd(base, size)
        try:
            mr = self._pv.DmaBufMR(self._pd, size, self._access, dmabuf=fd, offset=0)
        except self._pv.Error as ex:
            os.close(fd)
            raise TransportError(
                f"verbs: {self.device} cannot register GPU memory through dma-buf: {ex} "
                "(needs a NIC driver with dma-buf support, e.g. mlx5 on Linux >= 5.12)"
            ) from ex
        return _Region(ptr - base, nbytes, mr, fd=fd)  # iova 0 is the exported range's base

    def local_info(self) -> dict[str, Any]:
        """Where peers send connection requests: our GID and rendezvous (UD) QP number."""
        return local_info(self.endpoint, self.device, self.port, self.gid, self._rendezvous.qpn)

    def connect(self, peer: str, info: dict[str, Any], regions: Sequence[Descriptor]) -> None:
        """Open a QP to `peer` (a request over its rendezvous QP, answered by its thread)."""
        remote = {}
        for d in regions:
            if d.wire != "verbs":
                raise TransportError(f"verbs: region {d.region!r} of {peer!r} is a {d.wire} one")
            remote[d.region] = _Remote(int(d.info["addr"]), int(d.info["rkey"]), d.nbytes)
        gid, _ = peer_address(peer, info)  # before any QP is made
        with self._lock:
            old = self._peers.get(peer)
            self._check_open()
            if old is not None and not old.error and old.info == info:
                old.remote.update(remote)  # a connected peer announcing more regions
                return
            qp, psn = self._new_qp(1), random.randrange(1 << 24)
            self._conns += 1
            conn = self._conns
        request = Request(
            conn, self.endpoint, self.gid, self._rendezvous.qpn, qp.qp_num, psn, self._mtu
        )
        reply = self._request(peer, info, request, qp)
        with self._lock:
            self._to_rts(qp, gid, reply, psn)
            if old is not None:
                self._retire(old)
            self._peers[peer] = self._by_qpn[qp.qp_num] = _Peer(peer, dict(info), qp, conn, remote)

    def _request(self, peer: str, info: dict[str, Any], req: Request, qp: Any) -> Reply:
        """Send `req` every 0.2 s until the peer's thread replies; TransportError on timeout."""
        gid, ud_qpn = peer_address(peer, info)
        deadline = time.monotonic() + self.connect_timeout_s
        while time.monotonic() < deadline:
            with self._lock:
                self._rendezvous.send(req, gid, ud_qpn)
            resend = time.monotonic() + 0.2
            while time.monotonic() < resend:
                with self._lock:
                    reply = self._replies.pop(req.id, None)
                if reply is not None and reply.error:
                    qp.close()
                    raise TransportError(f"verbs: peer {peer!r} refused to connect: {reply.error}")
                if reply is not None:
                    return reply
                time.sleep(0.001)
        qp.close()
        raise TransportError(
            f"verbs: peer {peer!r} never connected within {self.connect_timeout_s:g} s (no reply "
            f"from its endpoint {info.get('endpoint')!r} at {gid}, UD QP "
            f"{ud_qpn}): is it running, with an ACTIVE port on the same network?"
        )

    def _accept(self, req: Request) -> None:
        """A peer's connection request: a receiving QP towards its QP, then our reply."""
        reply = self._accepted.get(req.key)
        if reply is None:  # not a resent request
            try:
                qp, psn = self._new_qp(self.rq_depth), random.randrange(1 << 24)
                for _ in range(self.rq_depth):
                    qp.post_recv(self._recv_wr)
                self._to_rts(qp, req.gid, req, psn)
            except (TransportError, self._pv.Error) as ex:
                reply = Reply.refusal(req.id, str(ex))
            else:
                reply = Reply(req.id, qp.qp_num, psn, self._mtu)
                self._receiving[qp.qp_num] = qp
                self._accepted[req.key] = reply
        self._rendezvous.send(reply, req.gid, req.ud_qpn)

    def _retire(self, p: _Peer) -> None:
        self._by_qpn.pop(p.qp.qp_num, None)
        with contextlib.suppress(Exception):
            p.qp.close()

    def post(self, peer: str, units: Sequence[Unit], wr_id: int) -> None:
        """Queue `units` to `peer`; Completion(wr_id) comes from `poll` once all have landed."""
        with self._lock:
            self._check_open()
            p = self._peers.get(peer)
            if p is None:
                raise TransportError(
                    f"verbs: not connected to {peer!r}; connected: {list(self._peers)}"
                )
            if p.error:
                self._out.completions.append(Completion(wr_id, False, p.error))
                return
            wrs = [wr for unit in units for wr in self._plan(p, unit)]
            if not wrs:
                wrs.append(self._empty_write(p))
            wrs[-1].batch = wr_id
            p.backlog.extend(wrs)
            self._pump(p)

    def poll(self) -> Polled:
        with self._lock:
            self._check_open()
            self._progress()
            out, self._out = self._out, Polled()
        return out

    def close(self) -> None:
        if getattr(self, "_closed", True):
            return
        self._closed = True
        self._stop.set()
        self._thread.join(timeout=5)
        qps = [p.qp for p in self._peers.values()] + list(self._receiving.values())
        mrs = [r.mr for r in self._regions.values()] + [self._scratch, self._rendezvous.mr]
        for obj in [*qps, self._rendezvous.qp, *mrs]:
            with contextlib.suppress(Exception):
                obj.close()
        for r in self._regions.values():
            if r.fd >= 0:
                os.close(r.fd)
        for obj in (self._send_cq, self._recv_cq, self._rendezvous.cq, self._pd, self._ctx):
            with contextlib.suppress(Exception):
                obj.close()
        self._regions.clear()
        self._peers.clear()

    # --- writes ----------------------------------------------------------------------------
    def _plan(self, p: _Peer, unit: Unit) -> list[_WR]:
        wrs: list[_WR] = []
        for w in coalesced(unit.writes):  # contiguous pages: one work request per run
            src, dst = self._regions.get(w.src), p.remote.get(w.dst)
            if src is None:
                raise TransportError(
                    f"verbs: no local region {w.src!r}; have {list(self._regions)}"
                )
            if dst is None:
                raise TransportError(f"verbs: peer {p.name!r} has no region {w.dst!r}")
            if min(w.src_offset, w.dst_offset, w.nbytes) < 0 or (
                w.src_offset + w.nbytes > src.nbytes or w.dst_offset + w.nbytes > dst.nbytes
            ):
                raise TransportError(f"verbs: {w} falls outside {src.nbytes} / {dst.nbytes} bytes")
            for off in range(0, w.nbytes, _MAX_WR_BYTES):
                n = min(_MAX_WR_BYTES, w.nbytes - off)
                self._add(wrs, src.addr + w.src_offset + off, n, src.mr.lkey,
                          dst.addr + w.dst_offset + off, dst.rkey)  # fmt: skip
        if unit.imm is not None:
            if not 0 <= unit.imm < 1 << 32:
                raise TransportError(f"verbs: immediate {unit.imm} does not fit in 32 bits")
            if not wrs:
                wrs.append(self._empty_write(p))
            wrs[-1].imm = unit.imm
        return wrs

    def _add(self, wrs: list[_WR], laddr: int, n: int, lkey: int, raddr: int, rkey: int) -> None:
        """Append a write, extending the last WR where the remote range continues it."""
        last = wrs[-1] if wrs else None
        if last and (last.rkey, last.raddr + last.nbytes) == (rkey, raddr):
            a, length, key = last.sges[-1]
            if last.nbytes + n > _MAX_WR_BYTES:
                pass
            elif (key, a + length) == (lkey, laddr):  # contiguous on both sides: one SGE
                last.sges[-1] = (a, length + n, key)
                return
            elif len(last.sges) < self._max_sge:  # gather into the same remote range
                last.sges.append((laddr, n, lkey))
                return
        wrs.append(_WR([(laddr, n, lkey)], raddr, rkey))

    def _empty_write(self, p: _Peer) -> _WR:
        """A zero-byte write: carries an immediate or a completion when there is nothing else."""
        some = next(iter(p.remote.values()), _Remote(0, 0, 0))
        return _WR([(self._scratch.buf, 0, self._scratch.lkey)], some.addr, some.rkey)

    def _pump(self, p: _Peer) -> None:
        """Post backlog WRs while the send queue has room; signal every sq_depth/2 and batch end."""
        pv, e = self._pv, self._pv.e
        while p.backlog and p.in_flight < self.sq_depth:
            w = p.backlog[0]
            signal = w.batch is not None or p.unsignalled + 1 >= self.sq_depth // 2
            wr = pv.SendWR(
                wr_id=p.conn << _CONN_SHIFT | (p.seq + 1),
                num_sge=len(w.sges), sg=[pv.SGE(*s) for s in w.sges],
                opcode=e.IBV_WR_RDMA_WRITE if w.imm is None else e.IBV_WR_RDMA_WRITE_WITH_IMM,
                imm_data=w.imm or 0, send_flags=e.IBV_SEND_SIGNALED if signal else 0,
            )  # fmt: skip
            wr.set_wr_rdma(w.rkey, w.raddr)
            try:
                p.qp.post_send(wr)
            except pv.Error as ex:
                raise TransportError(f"verbs: posting to {p.name!r} failed: {ex}") from ex
            p.backlog.popleft()
            p.seq += 1
            p.in_flight += 1
            p.unsignalled += 1
            if signal:
                p.signalled.append((p.seq, p.unsignalled, w.batch))
                p.unsignalled = 0

    # --- progress (the background thread, and every poll) ------------------------------------
    def _run(self) -> None:
        idle_s = 0.0005
        while not self._stop.wait(idle_s):
            with self._lock:
                try:
                    busy = self._progress()
                except Exception as ex:  # reported by the next call instead of lost
                    self._broken = f"verbs: the progress thread stopped: {ex}"
                    return
            idle_s = 0.0 if busy else min(0.002, idle_s * 2 or 0.0001)

    def _check_open(self) -> None:
        if self._closed or self._broken:
            raise TransportError(self._broken or "verbs: this wire is closed")

    def _progress(self) -> bool:
        busy = False
        for msg in self._rendezvous.receive():
            busy = True
            if isinstance(msg, Request):
                self._accept(msg)
            else:
                self._replies[msg.id] = msg
        for wc in drain(self._send_cq):
            busy = True
            self._on_send(wc)
        for wc in drain(self._recv_cq):
            busy = True
            self._on_recv(wc)
        for p in self._peers.values():
            if p.backlog and p.in_flight < self.sq_depth:
                self._pump(p)
        return busy

    def _on_send(self, wc: Any) -> None:
        p = self._by_qpn.get(wc.qp_num)
        if p is None or wc.wr_id >> _CONN_SHIFT != p.conn or p.error:
            return  # a connection replaced since, or the rest of a failed queue, flushed
        if wc.status != self._pv.e.IBV_WC_SUCCESS:
            self._fail(p, wc)
            return
        seq = wc.wr_id & ((1 << _CONN_SHIFT) - 1)
        while p.signalled:
            s, n, batch = p.signalled.popleft()
            p.in_flight -= n
            if batch is not None:
                self._out.completions.append(Completion(batch, True))
            if s == seq:
                break

    def _fail(self, p: _Peer, wc: Any) -> None:
        hint = _WC_HINT.get(wc.status, "")
        p.error = (
            f"verbs: writes to peer {p.name!r} failed: {wc_status_name(wc.status)}"
            f" (vendor error {wc.vendor_err}, QP {wc.qp_num}){': ' + hint if hint else ''}"
        )
        batches = [b for _, _, b in p.signalled] + [w.batch for w in p.backlog]
        for b in batches:
            if b is not None:
                self._out.completions.append(Completion(b, False, p.error))
        p.signalled.clear()
        p.backlog.clear()
        p.in_flight = 0

    def _on_recv(self, wc: Any) -> None:
        e = self._pv.e
        qp = self._receiving.get(wc.qp_num)
        if wc.status != e.IBV_WC_SUCCESS or qp is None:
            return  # flushed: the sender's connection failed and this QP is dead
        if wc.opcode == e.IBV_WC_RECV_RDMA_WITH_IMM:  # stamped as the progress thread sees it
            self._out.immediates.append(int(wc.imm_data))
            self._out.arrived_s.append(time.time())
        qp.post_recv(self._recv_wr)


def _cuda_dmabuf_fd(base: int, size: int) -> int:
    """A dma-buf fd for [base, base + size) of CUDA memory (driver API, CUDA >= 11.7)."""
    try:
        cuda = ctypes.CDLL("libcuda.so.1")
        get_handle = cuda.cuMemGetHandleForAddressRange
    except (OSError, AttributeError) as ex:
        raise TransportError(
            f"verbs: no CUDA driver with dma-buf export (CUDA >= 11.7): {ex}"
        ) from ex
    fd = ctypes.c_int(-1)
    rc = get_handle(
        ctypes.byref(fd), ctypes.c_uint64(base), ctypes.c_size_t(size), ctypes.c_int(1),
        ctypes.c_ulonglong(0),
    )  # fmt: skip
    if rc != 0:
        raise TransportError(
            f"verbs: CUDA cannot export GPU memory as dma-buf (CUresult {rc}): needs the open "
            "NVIDIA kernel module (R515+) on Linux >= 5.12; CPU memory still works"
        )
    return fd.value

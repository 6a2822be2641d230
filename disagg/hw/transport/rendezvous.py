"""How two verbs endpoints connect: a request and a reply over a rendezvous queue pair.

Each endpoint owns a small unreliable-datagram (UD) queue pair, the rendezvous QP, named in its
`local_info` (GID and QP number) that the control plane carries to peers. To connect, a sender
creates a reliable-connected (RC) QP and sends a `Request` (its QP number, first packet sequence
number (PSN), GID, path MTU and its own rendezvous address) to the peer's rendezvous QP, again
until answered; the peer creates an RC QP of its own, brings it to RTS towards the sender's QP
and answers with a `Reply` (its QP number, PSN, MTU, or the error that stopped it); the sender
then brings its QP to RTS towards the peer's. A resent request gets the same reply again
(`Request.key` names a request across resends).

Each message is one JSON datagram of at most MAX_MESSAGE bytes. The message format, its checks
(`encode`, `decode`, `peer_address`) and the QP attributes of a connection (`rts_attrs`) are
plain data; only `Rendezvous`, `to_rts` and `drain` touch pyverbs, which they are handed
(`pv`, from verbs.load_pyverbs()), never import.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

from disagg.errors import TransportError

SLOTS = 32  # receive slots of a rendezvous QP, and as many send slots
SLOT = 1024  # bytes per slot
GRH = 40  # bytes of global route header in front of every received UD datagram
MAX_MESSAGE = SLOT - GRH  # bytes of JSON per datagram
MAX_ERROR = 400  # bytes of JSON of a refusal's error kept in its reply
QKEY = 0x0D15A66


@dataclass(frozen=True)
class Request:
    """A connection request: `id` is the sender's connection number, echoed by the reply;
    `gid`/`ud_qpn` its rendezvous address; `qpn`/`psn`/`mtu` its new RC QP (the MTU as the
    verbs enum, 1-5 for 256-4096 bytes)."""

    id: int
    endpoint: str
    gid: str
    ud_qpn: int
    qpn: int
    psn: int
    mtu: int

    @property
    def key(self) -> tuple[str, int, int, str]:
        """What a resent request repeats and a new one (a new QP) does not."""
        return (self.gid, self.qpn, self.psn, self.endpoint)

    def to_dict(self) -> dict[str, Any]:
        return {
            "t": "req", "id": self.id, "endpoint": self.endpoint, "gid": self.gid,
            "ud_qpn": self.ud_qpn, "qpn": self.qpn, "psn": self.psn, "mtu": self.mtu,
        }  # fmt: skip


@dataclass(frozen=True)
class Reply:
    """The answer to request `id`: the peer's RC QP (`qpn`, `psn`, `mtu`), or `error`, why it
    refused (then the other fields are 0)."""

    id: int
    qpn: int = 0
    psn: int = 0
    mtu: int = 0
    error: str = ""

    @staticmethod
    def refusal(id: int, why: str) -> Reply:
        """A refusal whose error is `why` cut to at most MAX_ERROR bytes of JSON (a reply is one
        datagram; escapes can make a character six bytes)."""
        text = why[:MAX_ERROR]
        while len(json.dumps(text)) > MAX_ERROR:
            text = text[:-1]
        return Reply(id, error=text or "refused")

    def to_dict(self) -> dict[str, Any]:
        if self.error:
            return {"t": "rep", "id": self.id, "error": self.error}
        return {"t": "rep", "id": self.id, "qpn": self.qpn, "psn": self.psn, "mtu": self.mtu}


Message = Request | Reply


def encode(msg: Message) -> bytes:
    """One datagram's bytes; TransportError if they exceed MAX_MESSAGE."""
    data = json.dumps(msg.to_dict()).encode()
    if len(data) > MAX_MESSAGE:
        raise TransportError(
            f"verbs: a rendezvous message of {len(data)} bytes exceeds {MAX_MESSAGE}: {msg}"
        )
    return data


def decode(raw: bytes) -> Message | None:
    """The message in a datagram's bytes; None for anything else (not JSON, another type, a
    field missing or of the wrong type), which the receiver drops as the network may."""
    try:
        d = json.loads(raw)
        if not isinstance(d, dict):
            return None
        if d.get("t") == "req":
            return Request(
                _int(d["id"]), _str(d["endpoint"]), _str(d["gid"]), _int(d["ud_qpn"]),
                _int(d["qpn"]), _int(d["psn"]), _int(d["mtu"]),
            )  # fmt: skip
        if d.get("t") == "rep":
            if "error" in d:
                return Reply.refusal(_int(d["id"]), _str(d["error"]))
            return Reply(_int(d["id"]), _int(d["qpn"]), _int(d["psn"]), _int(d["mtu"]))
    except (ValueError, KeyError, TypeError):
        pass
    return None


def _int(v: Any) -> int:
    if not isinstance(v, int) or isinstance(v, bool):
        raise TypeError(f"not an int: {v!r}")
    return v


def _str(v: Any) -> str:
    if not isinstance(v, str):
        raise TypeError(f"not a str: {v!r}")
    return v


def local_info(endpoint: str, device: str, port: int, gid: str, ud_qpn: int) -> dict[str, Any]:
    """What peers need to reach this endpoint's rendezvous QP (JSON-able)."""
    return {
        "wire": "verbs", "endpoint": endpoint, "device": device, "port": port, "gid": gid,
        "ud_qpn": ud_qpn,
    }  # fmt: skip


def peer_address(peer: str, info: dict[str, Any]) -> tuple[str, int]:
    """(GID, rendezvous QP number) from peer `peer`'s `local_info`; TransportError naming the
    peer when it is not a verbs endpoint's or lacks them."""
    if info.get("wire") != "verbs":
        raise TransportError(f"verbs: {peer!r} sent connection data of {info.get('wire')!r}")
    try:
        return str(info["gid"]), int(info["ud_qpn"])
    except (KeyError, TypeError, ValueError) as ex:
        raise TransportError(
            f"verbs: {peer!r}'s connection data lacks a GID or rendezvous QP number: {info}"
        ) from ex


def rts_attrs(
    *,
    access: int,
    port: int,
    local_mtu: int,
    remote: Request | Reply,
    sq_psn: int,
    ack_timeout: int,
) -> dict[str, int]:
    """The QP attributes (pyverbs QPAttr field names) that bring an RC QP to RTS towards the
    `remote` end's QP: its PSN is the one we receive from, `sq_psn` the one we send from, the
    path MTU the smaller of both ends' (verbs enums). `ack_timeout` is the verbs exponent
    (4.096 us * 2**ack_timeout per try)."""
    return {
        "qp_access_flags": access, "port_num": port, "pkey_index": 0,
        "path_mtu": min(local_mtu, remote.mtu), "dest_qp_num": remote.qpn,
        "rq_psn": remote.psn, "sq_psn": sq_psn, "max_dest_rd_atomic": 1, "max_rd_atomic": 1,
        "min_rnr_timer": 12, "timeout": ack_timeout,
        "retry_cnt": 6,  # rxe takes 7 as "retry forever", which would hide a dead peer
        "rnr_retry": 7,  # forever: a receiver that is slow to repost receives only stalls us
    }  # fmt: skip


def to_rts(
    pv: SimpleNamespace, qp: Any, attrs: dict[str, int], gid: str, port: int, gid_index: int
) -> None:
    """INIT -> RTR -> RTS with `attrs` (`rts_attrs`), routed to the remote end at `gid` from
    our GID `gid_index` of `port`."""
    attr = pv.QPAttr()
    for name, value in attrs.items():
        setattr(attr, name, value)
    route = pv.GlobalRoute(dgid=pv.GID(gid), sgid_index=gid_index)
    attr.ah_attr = pv.AHAttr(port_num=port, is_global=1, gr=route, dlid=0)
    qp.to_rts(attr)


def drain(cq: Any) -> Iterator[Any]:
    """Every work completion now in completion queue `cq`, polled 64 at a time."""
    while True:
        n, wcs = cq.poll(num_entries=64)
        if not n:
            return
        yield from wcs[:n]


class Rendezvous:
    """A UD queue pair that carries connection requests and replies, one datagram each: SLOTS
    receives posted, and as many send slots reused in turn."""

    def __init__(self, pv: SimpleNamespace, ctx: Any, pd: Any, port: int, gid_index: int) -> None:
        self._pv, self._pd, self._port, self._gid_index = pv, pd, port, gid_index
        self.cq = pv.CQ(ctx, 2 * SLOTS, None, None, 0)
        cap = pv.QPCap(max_send_wr=SLOTS, max_recv_wr=SLOTS)
        init = pv.QPInitAttr(qp_type=pv.e.IBV_QPT_UD, scq=self.cq, rcq=self.cq, cap=cap)
        attr = pv.QPAttr()
        attr.qkey, attr.port_num, attr.pkey_index = QKEY, port, 0
        self.qp = pv.QP(pd, init, attr)  # a UD QP comes back in RTS
        self.mr = pv.MR(pd, 2 * SLOTS * SLOT, pv.e.IBV_ACCESS_LOCAL_WRITE)
        self._ahs: dict[str, Any] = {}
        self._sent = 0
        for slot in range(SLOTS):
            self._post_recv(slot)

    @property
    def qpn(self) -> int:
        return int(self.qp.qp_num)

    def _post_recv(self, slot: int) -> None:
        sge = self._pv.SGE(self.mr.buf + slot * SLOT, SLOT, self.mr.lkey)
        self.qp.post_recv(self._pv.RecvWR(wr_id=slot, num_sge=1, sg=[sge]))

    def send(self, msg: Message, gid: str, qpn: int) -> None:
        """Send `msg` to the rendezvous QP `qpn` at `gid`; a full send queue drops it, as the
        network may (requests are resent until answered)."""
        pv = self._pv
        if gid not in self._ahs:
            route = pv.GlobalRoute(dgid=pv.GID(gid), sgid_index=self._gid_index)
            ah_attr = pv.AHAttr(port_num=self._port, is_global=1, gr=route, dlid=0)
            self._ahs[gid] = pv.AH(self._pd, attr=ah_attr)
        data = encode(msg)
        slot = SLOTS + self._sent % SLOTS
        self._sent += 1
        self.mr.write(data, len(data), slot * SLOT)
        sge = pv.SGE(self.mr.buf + slot * SLOT, len(data), self.mr.lkey)
        wr = pv.SendWR(wr_id=slot, opcode=pv.e.IBV_WR_SEND, num_sge=1, sg=[sge])
        wr.set_wr_ud(self._ahs[gid], qpn, QKEY)
        with contextlib.suppress(pv.Error):
            self.qp.post_send(wr)

    def receive(self) -> list[Message]:
        """The messages received since the last call (malformed datagrams dropped)."""
        msgs = []
        for wc in drain(self.cq):
            if wc.wr_id >= SLOTS:
                continue  # a send finished
            if wc.status == self._pv.e.IBV_WC_SUCCESS:
                msg = decode(self.mr.read(wc.byte_len - GRH, wc.wr_id * SLOT + GRH))
                if msg is not None:
                    msgs.append(msg)
            self._post_recv(wc.wr_id)
        return msgs

"""How two verbs endpoints connect: the rendezvous messages and their checks, the attributes that
bring a QP to RTS, and the rendezvous QP itself over a fake fabric. No pyverbs, no NIC."""

from __future__ import annotations

import json
from types import SimpleNamespace
from typing import Any

import pytest

from disagg.errors import TransportError
from disagg.hw.transport.rendezvous import (
    GRH,
    MAX_ERROR,
    MAX_MESSAGE,
    QKEY,
    SLOT,
    SLOTS,
    Rendezvous,
    Reply,
    Request,
    decode,
    drain,
    encode,
    local_info,
    peer_address,
    rts_attrs,
    to_rts,
)

GID_A = "fe80:0000:0000:0000:0202:c9ff:fe00:0001"
GID_B = "fe80:0000:0000:0000:0202:c9ff:fe00:0002"
REQ = Request(id=3, endpoint="prefill0", gid=GID_A, ud_qpn=17, qpn=42, psn=0xABCDE, mtu=3)


def test_messages_are_the_json_the_peer_reads() -> None:
    assert json.loads(encode(REQ)) == {
        "t": "req", "id": 3, "endpoint": "prefill0", "gid": GID_A, "ud_qpn": 17, "qpn": 42,
        "psn": 0xABCDE, "mtu": 3,
    }  # fmt: skip
    accept = Reply(3, qpn=99, psn=7, mtu=5)
    assert json.loads(encode(accept)) == {"t": "rep", "id": 3, "qpn": 99, "psn": 7, "mtu": 5}
    refuse = Reply.refusal(3, "no room")
    assert json.loads(encode(refuse)) == {"t": "rep", "id": 3, "error": "no room"}
    for msg in (REQ, accept, refuse):
        assert decode(encode(msg)) == msg


def test_a_resent_request_has_the_same_key_and_a_new_qp_another() -> None:
    assert REQ.key == (GID_A, 42, 0xABCDE, "prefill0")
    resent = Request(4, "prefill0", GID_A, 17, 42, 0xABCDE, 3)  # another id: still one request
    assert resent.key == REQ.key
    assert Request(3, "prefill0", GID_A, 17, 43, 0xABCDE, 3).key != REQ.key


def test_a_refusal_keeps_a_bounded_nonempty_error() -> None:
    assert Reply.refusal(1, "x" * 1000).error == "x" * (MAX_ERROR - 2)  # and two quotes
    assert Reply.refusal(1, "").error == "refused"
    accented = Reply.refusal(1, "\u00e9" * 1000).error  # JSON writes each as \u00e9
    assert accented == "\u00e9" * 66 and len(encode(Reply.refusal(1, accented))) <= MAX_MESSAGE


def test_a_message_over_one_datagram_is_refused() -> None:
    big = Request(1, "e" * MAX_MESSAGE, GID_A, 1, 1, 1, 1)
    with pytest.raises(TransportError, match=f"exceeds {MAX_MESSAGE}"):
        encode(big)
    assert MAX_MESSAGE == SLOT - GRH == 984


@pytest.mark.parametrize(
    "raw",
    [
        b"not json",
        b"[1, 2]",
        b'{"t": "hello", "id": 1}',
        b'{"t": "req", "id": 1, "endpoint": "a", "gid": "g", "ud_qpn": 1, "qpn": 2, "psn": 3}',
        b'{"t": "req", "id": 1, "endpoint": "a", "gid": "g", "ud_qpn": 1, "qpn": "2", "psn": 3, '
        b'"mtu": 3}',
        b'{"t": "rep", "id": true, "qpn": 1, "psn": 2, "mtu": 3}',
        b'{"t": "rep", "id": 1, "qpn": 1, "psn": 2}',
        b'{"t": "rep", "id": 1, "error": 5}',
        b"\xff\xfe",
    ],
    ids=["text", "list", "type", "missing", "str-int", "bool", "rep-missing", "error-int", "bytes"],
)
def test_malformed_datagrams_decode_to_nothing(raw: bytes) -> None:
    assert decode(raw) is None


def test_local_info_gives_the_peer_its_address() -> None:
    info = local_info("decode0", "mlx5_0", 1, GID_B, 21)
    assert info == {
        "wire": "verbs", "endpoint": "decode0", "device": "mlx5_0", "port": 1, "gid": GID_B,
        "ud_qpn": 21,
    }  # fmt: skip
    assert peer_address("decode0", json.loads(json.dumps(info))) == (GID_B, 21)
    with pytest.raises(TransportError, match="'decode0' sent connection data of 'tcp'"):
        peer_address("decode0", {**info, "wire": "tcp"})
    with pytest.raises(TransportError, match=r"'decode0'.*lacks a GID or rendezvous QP number"):
        peer_address("decode0", {"wire": "verbs", "gid": GID_B})


def test_rts_attributes_point_at_the_remote_qp_with_the_smaller_mtu() -> None:
    reply = Reply(3, qpn=99, psn=7, mtu=5)
    attrs = rts_attrs(access=7, port=1, local_mtu=3, remote=reply, sq_psn=11, ack_timeout=14)
    assert attrs == {
        "qp_access_flags": 7, "port_num": 1, "pkey_index": 0, "path_mtu": 3, "dest_qp_num": 99,
        "rq_psn": 7, "sq_psn": 11, "max_dest_rd_atomic": 1, "max_rd_atomic": 1,
        "min_rnr_timer": 12, "timeout": 14, "retry_cnt": 6, "rnr_retry": 7,
    }  # fmt: skip
    # the accepting side points at the requester's QP, from its request
    back = rts_attrs(access=7, port=2, local_mtu=5, remote=REQ, sq_psn=7, ack_timeout=14)
    assert (back["dest_qp_num"], back["rq_psn"], back["sq_psn"], back["path_mtu"]) == (
        42, 0xABCDE, 7, 3,
    )  # fmt: skip


def test_to_rts_sets_every_attribute_and_the_route() -> None:
    moved: list[Any] = []
    pv = SimpleNamespace(
        QPAttr=SimpleNamespace,
        GID=lambda gid: ("GID", gid),
        GlobalRoute=lambda **kw: ("route", kw),
        AHAttr=lambda **kw: ("ah", kw),
    )
    qp = SimpleNamespace(to_rts=moved.append)
    attrs = {"dest_qp_num": 99, "path_mtu": 3}
    to_rts(pv, qp, attrs, GID_B, 1, 2)
    (attr,) = moved
    assert (attr.dest_qp_num, attr.path_mtu) == (99, 3)
    route = ("route", {"dgid": ("GID", GID_B), "sgid_index": 2})
    assert attr.ah_attr == ("ah", {"port_num": 1, "is_global": 1, "gr": route, "dlid": 0})


class FakeCQ:
    def __init__(self) -> None:
        self.wcs: list[SimpleNamespace] = []

    def poll(self, num_entries: int) -> tuple[int, list[SimpleNamespace]]:
        out, self.wcs = self.wcs[:num_entries], self.wcs[num_entries:]
        return len(out), out


def test_drain_polls_until_the_queue_is_empty() -> None:
    cq = FakeCQ()
    cq.wcs = [SimpleNamespace(wr_id=i) for i in range(150)]
    assert [wc.wr_id for wc in drain(cq)] == list(range(150))
    assert list(drain(cq)) == []


class Fabric:
    """UD delivery between fake QPs: a send lands in the next posted receive of the QP it names,
    after a GRH's worth of bytes, as the NIC writes it; the datagram is dropped if none."""

    def __init__(self) -> None:
        self.qps: dict[int, FakeQP] = {}
        self.mrs: list[FakeMR] = []

    def memory(self, addr: int) -> tuple[FakeMR, int]:
        (mr,) = [m for m in self.mrs if m.buf <= addr < m.buf + len(m.data)]
        return mr, addr - mr.buf

    def pv(self) -> SimpleNamespace:
        e = SimpleNamespace(IBV_QPT_UD=4, IBV_ACCESS_LOCAL_WRITE=1, IBV_WR_SEND=2, IBV_WC_SUCCESS=0)
        return SimpleNamespace(
            e=e, Error=RuntimeError, CQ=lambda ctx, n, *_: FakeCQ(), QPCap=dict,
            QPInitAttr=SimpleNamespace, QPAttr=SimpleNamespace,
            QP=lambda pd, init, attr: FakeQP(self, init, attr),
            MR=lambda pd, n, access: FakeMR(self, n), SGE=lambda a, n, key: (a, n),
            RecvWR=SimpleNamespace, SendWR=FakeSendWR, GID=str, GlobalRoute=SimpleNamespace,
            AHAttr=SimpleNamespace, AH=lambda pd, attr: attr,
        )  # fmt: skip


class FakeMR:
    def __init__(self, fabric: Fabric, n: int) -> None:
        self.buf, self.lkey, self.data = 0x10000 * (len(fabric.mrs) + 1), 5, bytearray(n)
        fabric.mrs.append(self)

    def write(self, data: bytes, n: int, offset: int) -> None:
        self.data[offset : offset + n] = data[:n]

    def read(self, n: int, offset: int) -> bytes:
        return bytes(self.data[offset : offset + n])


class FakeSendWR:
    def __init__(self, wr_id: int, opcode: int, num_sge: int, sg: list[tuple[int, int]]) -> None:
        self.wr_id, self.sg = wr_id, sg

    def set_wr_ud(self, ah: Any, qpn: int, qkey: int) -> None:
        self.qpn, self.qkey = qpn, qkey


class FakeQP:
    def __init__(self, fabric: Fabric, init: Any, attr: Any) -> None:
        self.fabric, self.cq, self.qkey = fabric, init.rcq, attr.qkey
        self.qp_num = 100 + len(fabric.qps)
        self.recvs: list[Any] = []
        fabric.qps[self.qp_num] = self

    def post_recv(self, wr: Any) -> None:
        self.recvs.append(wr)

    def post_send(self, wr: FakeSendWR) -> None:
        (addr, n), dest = wr.sg[0], self.fabric.qps[wr.qpn]
        self.cq.wcs.append(SimpleNamespace(wr_id=wr.wr_id, status=0))
        if not dest.recvs or wr.qkey != dest.qkey:
            return
        src, at = self.fabric.memory(addr)
        recv = dest.recvs.pop(0)
        (raddr, room) = recv.sg[0]
        mr, rat = self.fabric.memory(raddr)
        datagram = bytes(GRH) + src.read(n, at)
        assert len(datagram) <= room, "the datagram would overrun its receive slot"
        mr.write(datagram, len(datagram), rat)
        dest.cq.wcs.append(SimpleNamespace(wr_id=recv.wr_id, status=0, byte_len=len(datagram)))


def test_two_rendezvous_qps_exchange_a_request_and_its_reply() -> None:
    """Over the fake fabric: a request reaches the peer, the reply comes back, both decoded;
    receives are reposted (more messages than slots all arrive) and junk is dropped."""
    fabric = Fabric()
    a = Rendezvous(fabric.pv(), None, None, port=1, gid_index=0)
    b = Rendezvous(fabric.pv(), None, None, port=1, gid_index=0)
    assert (a.qpn, b.qpn) == (100, 101) and a.qp.qkey == QKEY
    assert len(b.qp.recvs) == SLOTS
    a.send(REQ, GID_B, b.qpn)
    assert b.receive() == [REQ] and a.receive() == []  # a's send completion is no message
    assert len(b.qp.recvs) == SLOTS  # reposted
    reply = Reply(REQ.id, qpn=55, psn=9, mtu=3)
    b.send(reply, GID_A, a.qpn)
    assert a.receive() == [reply]
    for i in range(2 * SLOTS + 3):  # more than the send and receive slots, in turns
        a.send(Reply.refusal(i, f"busy {i}"), GID_B, b.qpn)
        assert [m.id for m in b.receive()] == [i]
    junk = FakeSendWR(SLOTS, 2, 1, [(b.mr.buf + SLOTS * SLOT, 13)])  # from something else
    junk.set_wr_ud(None, a.qpn, QKEY)
    b.mr.write(b'{"t": "junk"}', 13, SLOTS * SLOT)
    b.qp.post_send(junk)
    assert a.receive() == []  # dropped, and its slot reposted
    assert len(a.qp.recvs) == SLOTS

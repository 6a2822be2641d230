"""The verbs wire on a real verbs device (soft-RoCE rxe0 in the test VM): discovery, registration,
RDMA WRITE and WRITE_WITH_IMM, flow control past the send queue, and named failures."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import as_json, connect, wait_for, wire

from disagg.errors import TransportError
from disagg.hw.transport.base import Descriptor, Polled, Unit, Write
from disagg.hw.transport.verbs import VerbsTransport

pytestmark = pytest.mark.rdma
RNG = np.random.default_rng(7)


def random_bytes(n: int) -> np.ndarray:
    return RNG.integers(0, 256, n, dtype=np.uint8)


def test_discovery_prefers_the_ipv4_mapped_roce_v2_gid(rdma_device: str) -> None:
    t = wire("a")
    try:
        assert t.device == rdma_device
        assert t.gid.startswith("0000:0000:0000:0000:0000:ffff:")
        info = as_json(t.local_info())
        assert info["gid"] == t.gid and info["endpoint"] == "a" and info["ud_qpn"] > 1
    finally:
        t.close()


def test_a_gid_index_given_is_used(rdma_device: str) -> None:
    t = wire("a", gid_index=0)
    assert t.gid_index == 0 and t.gid.startswith("fe80:")  # the link-local RoCE v2 GID
    t.close()
    with pytest.raises(TransportError, match="GID index 9"):
        wire("a", gid_index=9)


def test_unknown_device_is_named(rdma_device: str) -> None:
    with pytest.raises(TransportError, match=r"'mlx5_7' not found; devices: \['rxe0'\]"):
        wire("a", device="mlx5_7")


def test_register_bytearray_numpy_and_memoryview(pair) -> None:
    a, _ = pair()
    d1 = a.register("ba", bytearray(4096))
    d2 = a.register("np", np.zeros((16, 128), dtype=np.float16))
    d3 = a.register("mv", memoryview(bytearray(100)))
    assert (d1.nbytes, d2.nbytes, d3.nbytes) == (4096, 4096, 100)
    assert all(d.wire == "verbs" and d.info["rkey"] and d.info["addr"] for d in (d1, d2, d3))
    with pytest.raises(TransportError, match="writable"):
        a.register("ro", b"read-only bytes")
    with pytest.raises(TransportError, match="already registered"):
        a.register("ba", bytearray(1))


def test_single_write_lands_and_completes(pair) -> None:
    a, b = pair()
    src, dst = random_bytes(1 << 20), np.zeros(2 << 20, dtype=np.uint8)
    a.register("src", src)
    db = b.register("dst", dst)
    connect(a, b, [db])
    posted = time.time()
    a.post("b", [Unit([Write("src", 0, "dst", 4096, 1 << 20)], imm=0xDEADBEEF)], wr_id=11)
    sent, got = wait_for([a, b], lambda s, g: bool(s.completions and g.immediates))
    assert [(c.wr_id, c.ok) for c in sent.completions] == [(11, True)]
    assert got.immediates == [0xDEADBEEF]
    assert len(got.arrived_s) == 1 and posted <= got.arrived_s[0] <= time.time()  # its stamp
    assert np.array_equal(dst[4096 : 4096 + (1 << 20)], src)
    assert not dst[:4096].any() and not dst[4096 + (1 << 20) :].any()


def test_scatter_gather_and_disjoint_writes_in_one_unit(pair) -> None:
    a, b = pair()
    src, dst = random_bytes(64 * 1024), np.zeros(64 * 1024, dtype=np.uint8)
    a.register("src", src)
    db = b.register("dst", dst)
    connect(a, b, [db])
    # eight 512-byte pieces, every other one of src, land back to back in dst: one gather WR;
    # then one write elsewhere: a second WR, carrying the immediate
    gather = [Write("src", i * 1024, "dst", i * 512, 512) for i in range(8)]
    unit = Unit([*gather, Write("src", 40960, "dst", 32768, 1000)], imm=5)
    wrs = a._plan(a._peers["b"], unit)
    assert [len(w.sges) for w in wrs] == [8, 1] and [w.imm for w in wrs] == [None, 5]
    a.post("b", [unit], wr_id=1)
    sent, got = wait_for([a, b], lambda s, g: bool(s.completions and g.immediates))
    assert sent.completions[0].ok and got.immediates == [5]
    expect = np.concatenate([src[i * 1024 : i * 1024 + 512] for i in range(8)])
    assert np.array_equal(dst[:4096], expect)
    assert np.array_equal(dst[32768:33768], src[40960:41960])


def test_thousands_of_immediates_arrive_once_in_order(pair) -> None:
    n = 3000
    a, b = pair(sq_depth=64, rq_depth=32)  # more immediates in flight than receives posted
    src, dst = random_bytes(n * 64), np.zeros(n * 64, dtype=np.uint8)
    a.register("src", src)
    db = b.register("dst", dst)
    connect(a, b, [db])
    units = [Unit([Write("src", i * 64, "dst", i * 64, 64)], imm=i) for i in range(n)]
    for k in range(0, n, 500):
        a.post("b", units[k : k + 500], wr_id=k)

    def done(sent: Polled, got: Polled) -> bool:
        return len(got.immediates) >= n and len(sent.completions) == n // 500

    sent, got = wait_for([a, b], done, timeout_s=120)
    assert got.immediates == list(range(n))
    assert [c.wr_id for c in sent.completions] == list(range(0, n, 500))
    assert all(c.ok for c in sent.completions)
    assert np.array_equal(dst, src)
    assert b.poll().immediates == []


def test_a_queue_deeper_than_the_send_queue(pair) -> None:
    a, b = pair(sq_depth=8)
    src, dst = random_bytes(1000 * 256), np.zeros(1000 * 256, dtype=np.uint8)
    a.register("src", src)
    db = b.register("dst", dst)
    connect(a, b, [db])
    # 1000 writes to alternating halves: no two adjacent, so 1000 WRs through an 8-deep queue
    order = [*range(0, 1000, 2), *range(1, 1000, 2)]
    writes = [Write("src", i * 256, "dst", i * 256, 256) for i in order]
    a.post("b", [Unit(writes, imm=77)], wr_id=3)
    assert len(a._peers["b"].backlog) > 900  # most of it waits in software
    sent, got = wait_for([a, b], lambda s, g: bool(s.completions and g.immediates), 60)
    assert [(c.wr_id, c.ok) for c in sent.completions] == [(3, True)]
    assert got.immediates == [77]
    assert np.array_equal(dst, src)


def test_an_immediate_alone_and_an_empty_post(pair) -> None:
    a, b = pair()
    db = b.register("dst", bytearray(64))
    connect(a, b, [db])
    a.post("b", [Unit([], imm=42)], wr_id=1)
    a.post("b", [], wr_id=2)
    sent, got = wait_for([a, b], lambda s, g: len(s.completions) == 2 and bool(g.immediates))
    assert [(c.wr_id, c.ok) for c in sent.completions] == [(1, True), (2, True)]
    assert got.immediates == [42]


def test_bad_writes_are_refused_before_posting(pair) -> None:
    a, b = pair()
    a.register("src", bytearray(1024))
    db = b.register("dst", bytearray(1024))
    connect(a, b, [db])
    with pytest.raises(TransportError, match="no region 'nope'"):
        a.post("b", [Unit([Write("src", 0, "nope", 0, 8)])], wr_id=1)
    with pytest.raises(TransportError, match="falls outside"):
        a.post("b", [Unit([Write("src", 0, "dst", 1000, 100)])], wr_id=1)
    with pytest.raises(TransportError, match="32 bits"):
        a.post("b", [Unit([], imm=1 << 32)], wr_id=1)
    with pytest.raises(TransportError, match="not connected to 'c'"):
        a.post("c", [], wr_id=1)


def test_a_bad_rkey_fails_with_a_remote_access_error(pair) -> None:
    a, b = pair()
    a.register("src", bytearray(4096))
    db = b.register("dst", bytearray(4096))
    forged = Descriptor("verbs", "dst", 4096, {**db.info, "rkey": db.info["rkey"] ^ 0x5A5A00})
    connect(a, b, [forged])
    a.post("b", [Unit([Write("src", 0, "dst", 0, 4096)], imm=1)], wr_id=9)
    a.post("b", [Unit([Write("src", 0, "dst", 0, 64)])], wr_id=10)
    (sent,) = wait_for([a], lambda s: len(s.completions) == 2)
    assert [(c.wr_id, c.ok) for c in sent.completions] == [(9, False), (10, False)]
    err = sent.completions[0].error
    assert "peer 'b'" in err and "IBV_WC_REM_ACCESS_ERR" in err and "rkey" in err
    a.post("b", [], wr_id=11)  # the connection stays failed, and says so
    assert a.poll().completions[0].error == err


def test_a_peer_that_never_answers_times_out(pair) -> None:
    a, b = pair(connect_timeout_s=2.0)
    info = as_json(b.local_info())
    b.close()  # its rendezvous QP is gone: requests go unanswered
    start = time.monotonic()
    with pytest.raises(TransportError, match=r"peer 'b' never connected within 2 s"):
        a.connect("b", info, [])
    assert time.monotonic() - start < 10
    c = wire("c")  # and the wire still connects elsewhere
    try:
        dc = c.register("dst", bytearray(8))
        a.connect("c", c.local_info(), [dc])
        a.post("c", [Unit([], imm=3)], wr_id=1)
        assert wait_for([a, c], lambda s, g: bool(g.immediates))[1].immediates == [3]
    finally:
        c.close()


def test_connection_data_is_checked(pair) -> None:
    a, b = pair()
    with pytest.raises(TransportError, match="connection data of 'tcp'"):
        a.connect("b", {"wire": "tcp"}, [])
    with pytest.raises(TransportError, match="is a tcp one"):
        a.connect("b", b.local_info(), [Descriptor("tcp", "x", 8, {})])
    b.close()
    b.close()  # idempotent
    with pytest.raises(TransportError, match="this wire is closed"):
        b.poll()


def start_peer(nbytes: int) -> tuple[subprocess.Popen[str], dict]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    peer = subprocess.Popen(
        [sys.executable, str(Path(__file__).with_name("peer.py")), str(nbytes)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env,
    )  # fmt: skip
    assert peer.stdout is not None
    return peer, json.loads(peer.stdout.readline())


def connect_to_peer(a: VerbsTransport, hello: dict) -> None:
    """Connect to the peer process, which is blocked reading stdin: its wire's thread answers."""
    a.connect("peer", hello["info"], [Descriptor.from_dict(d) for d in hello["regions"]])


def test_two_processes_write_and_signal(rdma_device: str) -> None:
    n = 4 << 20
    peer, hello = start_peer(n)
    a = wire("a")
    try:
        src = random_bytes(n)
        a.register("src", src)
        connect_to_peer(a, hello)
        units = [
            Unit([Write("src", k, "kv", k, 1 << 20)], imm=k >> 20) for k in range(0, n, 1 << 20)
        ]
        a.post("peer", units, wr_id=1)
        assert wait_for([a], lambda s: bool(s.completions))[0].completions[0].ok
        peer.stdin.write('{"wait": 4}\n')
        peer.stdin.flush()
        report = json.loads(peer.stdout.readline())
        assert report["immediates"] == [0, 1, 2, 3]
        assert report["sha256"] == hashlib.sha256(src.tobytes()).hexdigest()
    finally:
        peer.kill()
        peer.wait()
        a.close()


def test_a_peer_killed_mid_transfer_fails_named_without_hanging(rdma_device: str) -> None:
    n = 16 << 20
    peer, hello = start_peer(n)
    a = wire("a")
    try:
        a.register("src", random_bytes(n))
        connect_to_peer(a, hello)
        batch = [Unit([Write("src", k, "kv", k, 1 << 20)]) for k in range(0, n, 1 << 20)]
        a.post("peer", batch, wr_id=0)
        assert wait_for([a], lambda s: bool(s.completions))[0].completions[0].ok
        for wr_id in range(1, 4):
            a.post("peer", batch, wr_id=wr_id)
        peer.kill()  # the kernel destroys its QP while our writes are in flight
        peer.wait()
        start = time.monotonic()
        while True:  # keep the wire busy until it notices
            failed = [c for c in a.poll().completions if not c.ok]
            if failed:
                break
            assert time.monotonic() - start < 60, "no failure within 60 s"
            a.post("peer", batch[:1], wr_id=99)
            time.sleep(0.01)
        assert "peer 'peer'" in failed[0].error
        assert "IBV_WC_RETRY_EXC_ERR" in failed[0].error, failed[0].error
    finally:
        peer.kill()
        a.close()


def test_a_port_that_is_down_is_named(rdma_device: str) -> None:
    state = Path(f"/sys/class/infiniband/{rdma_device}/ports/1/state")
    link = ["ip", "link", "set", "veth1"]
    if not Path("/sys/class/net/veth1").exists():
        pytest.skip("needs the VM's veth pair (rxe0 on veth0)")
    subprocess.run([*link, "down"], check=True)
    try:
        deadline = time.monotonic() + 10
        while "DOWN" not in state.read_text() and time.monotonic() < deadline:
            time.sleep(0.05)
        with pytest.raises(TransportError, match=r"port 1 of rxe0 is DOWN \(not ACTIVE\)"):
            wire("a")
    finally:
        subprocess.run([*link, "up"], check=True)
        deadline = time.monotonic() + 10
        while "ACTIVE" not in state.read_text() and time.monotonic() < deadline:
            time.sleep(0.05)

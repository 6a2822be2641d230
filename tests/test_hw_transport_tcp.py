"""The tcp wire between two real processes: writes land, immediates count and keep order,
a dead peer fails by name, a broken connection reconnects, close is idempotent."""

from __future__ import annotations

import contextlib
import random
import socket
import threading
import time
from collections.abc import Iterator

import numpy as np
import pytest

from disagg.errors import ConfigError, TransportError
from disagg.hw.transport import make_transport
from disagg.hw.transport._wire import FRAME, HAS_IMM, MAX_FRAME_BYTES, RECONNECT_ATTEMPTS, WRITE
from disagg.hw.transport.base import Completion, Descriptor, Transport, Unit, Write
from disagg.hw.transport.peer import SLOT, ReceiverProcess, slot_bytes, wait_completions
from disagg.hw.transport.tcp import TcpTransport

SIZE = 1 << 16


@pytest.fixture
def receiver() -> Iterator[ReceiverProcess]:
    r = ReceiverProcess("tcp", (SIZE,), endpoint="decode0")
    yield r
    r.close()


def connected(r: ReceiverProcess, src: object) -> Transport:
    wire = make_transport("tcp", endpoint="prefill0")
    wire.register("src", src)
    wire.connect("decode0", r.info, r.descs)
    return wire


def test_registration_describes_the_region() -> None:
    wire = TcpTransport()
    d = wire.register("kv", np.zeros(100, dtype=np.float32))
    assert (d.wire, d.region, d.nbytes) == ("tcp", "kv", 400)
    assert Descriptor.from_dict(d.to_dict()) == d
    with pytest.raises(TransportError, match="already registered"):
        wire.register("kv", bytearray(4))
    with pytest.raises(TransportError, match="writable"):
        wire.register("ro", b"read only")
    wire.close()


def test_scatter_writes_land_where_asked(receiver: ReceiverProcess) -> None:
    rng = random.Random(0)
    src = bytes(rng.getrandbits(8) for _ in range(SIZE))
    wire = connected(receiver, bytearray(src))
    starts = sorted(rng.sample(range(0, SIZE - 64, 64), 300))  # disjoint 64-byte slots
    writes = [Write("src", rng.randrange(SIZE - 40), "r0", s, rng.randrange(1, 40)) for s in starts]
    wire.post("decode0", [Unit(writes[:150]), Unit(writes[150:], imm=7)], wr_id=1)
    assert wait_completions(wire, 1) == [Completion(1, True)]
    assert receiver.ask("wait", 1, False, 10) == ([7], 0)
    want = bytearray(SIZE)
    for w in writes:
        want[w.dst_offset : w.dst_offset + w.nbytes] = src[w.src_offset : w.src_offset + w.nbytes]
    assert receiver.ask("read", 0) == bytes(want)
    wire.close()


def test_thousands_of_immediates_arrive_in_order_after_their_bytes(
    receiver: ReceiverProcess,
) -> None:
    n, per_batch = 4000, 100
    src = bytearray(b"".join(slot_bytes(k) for k in range(n)))
    wire = connected(receiver, src)
    for b in range(n // per_batch):
        units = [
            Unit([Write("src", k * SLOT, "r0", k * SLOT, SLOT)], imm=k)
            for k in range(b * per_batch, (b + 1) * per_batch)
        ]
        wire.post("decode0", units, wr_id=b)
    imms, violations = receiver.ask("wait", n, True, 30)  # type: ignore[misc]
    assert imms == list(range(n)) and violations == 0
    done = wait_completions(wire, n // per_batch)
    assert [c.wr_id for c in done] == list(range(n // per_batch)) and all(c.ok for c in done)
    wire.close()


def test_a_dead_peer_fails_with_its_name() -> None:
    r = ReceiverProcess("tcp", (SIZE,), endpoint="decode0")
    wire = connected(r, bytearray(SIZE))
    r.proc.kill()
    r.proc.join(10)
    failed: list[Completion] = []
    deadline = time.monotonic() + 20
    wr_id = 0
    while not failed and time.monotonic() < deadline:
        wire.post("decode0", [Unit([Write("src", 0, "r0", 0, 4096)], imm=1)], wr_id=wr_id)
        wr_id += 1
        failed = [c for c in wait_completions(wire, 1, timeout_s=0.5) if not c.ok]
    assert failed and "decode0" in failed[0].error
    wire.post("decode0", [Unit([], imm=2)], wr_id=99)  # later posts fail too, never hang
    [late] = [c for c in wait_completions(wire, 1) if c.wr_id == 99]
    assert not late.ok and f"{RECONNECT_ATTEMPTS} reconnect attempts" in late.error
    wire.close()


class Relay:
    """A TCP relay between a sender and a receiver that a test can hold and cut. While `held`
    is set, what senders send is swallowed (counted in `swallowed`); `cut` ends every relayed
    connection, both ways; `close` also stops accepting new ones."""

    def __init__(self, upstream: tuple[str, int]) -> None:
        self.upstream = upstream
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.held = threading.Event()
        self.swallowed = 0
        self.lock = threading.Lock()
        self.socks: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                down, _ = self.listener.accept()
            except OSError:
                return
            up = socket.create_connection(self.upstream)
            with self.lock:
                self.socks += [down, up]
            threading.Thread(target=self._pump, args=(down, up, True), daemon=True).start()
            threading.Thread(target=self._pump, args=(up, down, False), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, from_sender: bool) -> None:
        with contextlib.suppress(OSError):
            while data := src.recv(1 << 16):
                if from_sender and self.held.is_set():
                    with self.lock:
                        self.swallowed += len(data)
                else:
                    dst.sendall(data)

    def cut(self) -> None:
        with self.lock:
            socks, self.socks = self.socks, []
        for s in socks:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            s.close()

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.listener.shutdown(socket.SHUT_RDWR)
        self.listener.close()
        self.cut()


def test_a_broken_connection_fails_its_batch_by_name_then_reconnects() -> None:
    """A batch in flight when the connection breaks fails naming the peer; the next post
    reconnects and lands; once the receiver is unreachable, posts fail after the reconnect
    attempts, naming the peer and how many attempts were made."""
    recv, send = TcpTransport(endpoint="decode0"), TcpTransport(endpoint="prefill0")
    dst = bytearray(64)
    desc = recv.register("dst", dst)
    send.register("src", bytearray(range(64)))
    info = recv.local_info()
    relay = Relay((info["host"], info["port"]))
    send.connect("decode0", {**info, "port": relay.port}, [desc])
    one = [Unit([Write("src", 0, "dst", 0, 16)], imm=1)]
    send.post("decode0", one, wr_id=1)
    assert wait_completions(send, 1) == [Completion(1, True)]

    relay.held.set()
    send.post("decode0", [Unit([Write("src", 16, "dst", 16, 16)], imm=2)], wr_id=2)
    deadline = time.monotonic() + 20
    while relay.swallowed < 2 * FRAME.size + 16 and time.monotonic() < deadline:
        time.sleep(1e-3)  # until the whole batch left the sender: it is in flight
    relay.held.clear()
    relay.cut()
    [lost] = wait_completions(send, 1)
    assert lost.wr_id == 2 and not lost.ok
    assert f"tcp: peer 'decode0' at 127.0.0.1:{relay.port}: connection lost" in lost.error

    send.post("decode0", [Unit([Write("src", 32, "dst", 32, 16)], imm=3)], wr_id=3)
    assert wait_completions(send, 1) == [Completion(3, True)]
    assert recv.poll().immediates == [1, 3]
    assert dst == bytes(range(16)) + bytes(16) + bytes(range(32, 48)) + bytes(16)

    relay.close()
    send.post("decode0", one, wr_id=4)  # on the cut connection, or refused: it fails
    assert [c.ok for c in wait_completions(send, 1)] == [False]
    for wr_id in (5, 6):  # the attempts fail; then the peer is dead
        send.post("decode0", one, wr_id=wr_id)
        [c] = wait_completions(send, 1)
        assert (c.wr_id, c.ok) == (wr_id, False)
        assert c.error.startswith(f"tcp: peer 'decode0' at 127.0.0.1:{relay.port}: ")
        assert f"no connection after {RECONNECT_ATTEMPTS} reconnect attempts" in c.error
    send.close()
    recv.close()


def test_a_write_longer_than_a_frame_goes_as_several_frames() -> None:
    """The receiver refuses frames over MAX_FRAME_BYTES, so the sender splits such a write;
    the immediate rides on the last piece. (np.zeros: only the pages touched are mapped.)"""
    recv, send = TcpTransport(endpoint="decode0"), TcpTransport(endpoint="prefill0")
    n = MAX_FRAME_BYTES + 100
    desc = recv.register("dst", np.zeros(n + 8, dtype=np.uint8))
    src = np.zeros(n + 4, dtype=np.uint8)
    src[4], src[4 + MAX_FRAME_BYTES] = 1, 2
    send.register("src", src)
    send.connect("decode0", recv.local_info(), [desc])
    job = send._job("decode0", [Unit([Write("src", 4, "dst", 8, n)], imm=5)])
    headers = [FRAME.unpack(h) for h, _ in job]
    assert [(k, fl, off, nb, v) for k, fl, _, _, off, nb, v in headers] == [
        (WRITE, 0, 8, MAX_FRAME_BYTES, 0),
        (WRITE, HAS_IMM, 8 + MAX_FRAME_BYTES, 100, 5),
    ]
    assert [(len(p), p[0]) for _, p in job] == [(MAX_FRAME_BYTES, 1), (100, 2)]
    send.close()
    recv.close()


def test_bad_writes_are_refused_at_post(receiver: ReceiverProcess) -> None:
    wire = connected(receiver, bytearray(64))
    with pytest.raises(TransportError, match="out of bounds"):
        wire.post("decode0", [Unit([Write("src", 0, "r0", SIZE - 8, 16)])], wr_id=0)
    with pytest.raises(TransportError, match="unknown region"):
        wire.post("decode0", [Unit([Write("nope", 0, "r0", 0, 8)])], wr_id=0)
    with pytest.raises(TransportError, match="not connected"):
        wire.post("prefill9", [], wr_id=0)
    with pytest.raises(TransportError, match="32 bits"):
        wire.post("decode0", [Unit([], imm=2**32)], wr_id=0)
    wire.close()


def test_close_is_idempotent_and_final() -> None:
    wire = make_transport("tcp")
    wire.close()
    wire.close()
    with pytest.raises(TransportError, match="closed"):
        wire.register("x", bytearray(8))


def test_unknown_wires_are_config_errors() -> None:
    with pytest.raises(ConfigError, match="unknown wire"):
        make_transport("carrier-pigeon")


def test_the_wake_fd_wakes_a_waiting_control_loop_when_immediates_arrive() -> None:
    """A decode loop sleeps in Control.recv on its control socket and the wire's wake fd: an
    immediate ends the wait at once (not at the timeout), poll() clears the fd, and gives
    the time the immediate arrived (before the wake), not its own."""
    import select

    pytest.importorskip("zmq")
    from disagg.hw.control import Control

    recv, send = TcpTransport(endpoint="decode0"), TcpTransport(endpoint="prefill0")
    ctl = Control("decode0")
    try:
        desc = recv.register("dst", bytearray(64))
        send.register("src", bytearray(range(64)))
        send.connect("decode0", recv.local_info(), [desc])
        fd = recv.wake_fd()
        assert fd is not None and not select.select([fd], [], [], 0)[0]
        assert ctl.recv(0.05, fd) is None  # nothing came: the timeout ends the wait
        unit = Unit([Write("src", 0, "dst", 0, 64)], imm=7)
        later = threading.Timer(0.2, send.post, ("decode0", [unit], 1))  # lands mid-wait
        t, started = time.monotonic(), time.time()
        later.start()
        assert ctl.recv(10.0, fd) is None
        waited, woke = time.monotonic() - t, time.time()
        later.join()
        assert 0.15 < waited < 2.0  # woken by the immediate, long before the timeout
        time.sleep(0.05)
        polled = recv.poll()
        assert polled.immediates == [7]
        assert len(polled.arrived_s) == 1 and started < polled.arrived_s[0] <= woke
        assert not select.select([fd], [], [], 0)[0]  # cleared until the next immediate
    finally:
        ctl.close()
        send.close()
        recv.close()

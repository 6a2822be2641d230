"""The tcp wire between two real processes: writes land, immediates count and keep order,
a dead peer fails by name, close is idempotent."""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Iterator

import numpy as np
import pytest

from disagg.errors import ConfigError, TransportError
from disagg.hw.transport import make_transport
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
    assert [c.ok for c in wait_completions(wire, 1) if c.wr_id == 99] == [False]
    wire.close()


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
    immediate ends the wait at once (not at the timeout), and poll() clears the fd."""
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
        t = time.monotonic()
        later.start()
        assert ctl.recv(10.0, fd) is None
        waited = time.monotonic() - t
        later.join()
        assert 0.15 < waited < 2.0  # woken by the immediate, long before the timeout
        assert recv.poll().immediates == [7]
        assert not select.select([fd], [], [], 0)[0]  # cleared until the next immediate
    finally:
        ctl.close()
        send.close()
        recv.close()

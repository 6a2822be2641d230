"""Hostile peers on the socket wire (tcp; the cuda wire shares its server): a sender that does
not know the receiver's token gets nothing applied, a bad frame closes its connection, and
neither stops the server serving a legitimate peer. Each refusal is counted and said on stderr
with the peer. Real sockets on loopback, a receiving TcpTransport's threads on the other end."""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import socket
import threading
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from disagg.errors import TransportError
from disagg.hw.transport._wire import (
    ACK,
    END,
    FRAME,
    HAS_IMM,
    HELLO,
    IMM,
    MAX_FRAME_BYTES,
    NONCE_BYTES,
    WRITE,
    frame,
)
from disagg.hw.transport.base import Completion, Descriptor, Unit, Write
from disagg.hw.transport.peer import wait_completions
from disagg.hw.transport.tcp import TcpTransport

FILL = 0xEE  # what the guards around the registered region hold, and never lose


class Receiver:
    """A tcp endpoint "decode0" whose region r0 (64 bytes) lies between two 64-byte guards of
    one buffer, so that a write outside it shows; a legitimate sender is connected to it."""

    def __init__(self) -> None:
        self.buf = bytearray([FILL]) * 192
        self.wire = TcpTransport(endpoint="decode0")
        self.desc = self.wire.register("r0", memoryview(self.buf)[64:128])
        self.info = self.wire.local_info()
        self.sender = TcpTransport(endpoint="prefill0")
        self.sender.register("src", bytearray(range(64)))
        self.sender.connect("decode0", self.info, [self.desc])
        self.wr_id = 0

    @property
    def region(self) -> bytes:
        return bytes(self.buf[64:128])

    def guards_intact(self) -> bool:
        return self.buf[:64] == self.buf[128:] == bytearray([FILL]) * 64

    def serves_the_sender(self) -> bool:
        """The legitimate sender's write and immediate still land."""
        self.wire.poll()
        self.wr_id += 1
        unit = Unit([Write("src", 8, "r0", 16, 8)], imm=1000 + self.wr_id)
        self.sender.post("decode0", [unit], self.wr_id)
        ok = wait_completions(self.sender, 1) == [Completion(self.wr_id, True)]
        return ok and self.region[16:24] == bytes(range(8, 16)) and self.immediates() == [unit.imm]

    def immediates(self) -> list[int]:
        return self.wire.poll().immediates

    def close(self) -> None:
        self.sender.close()
        self.wire.close()


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    r = Receiver()
    yield r
    r.close()


def dial(info: dict[str, Any]) -> socket.socket:
    return socket.create_connection((info["host"], info["port"]), timeout=10)


def recv_exact(sock: socket.socket, n: int) -> bytes:
    out = b""
    while len(out) < n:
        chunk = sock.recv(n - len(out))
        assert chunk, "the server closed the connection during the handshake"
        out += chunk
    return out


def authenticated(info: dict[str, Any], name: bytes = b"mallory") -> socket.socket:
    """A raw connection that did the handshake as the protocol says (it knows the token)."""
    sock = dial(info)
    nonce = recv_exact(sock, NONCE_BYTES)
    mac = hmac.new(bytes.fromhex(info["token"]), nonce + name, hashlib.sha256).digest()
    sock.sendall(frame(HELLO, nbytes=len(name)) + name + mac)
    assert FRAME.unpack(recv_exact(sock, FRAME.size))[0] == HELLO
    return sock


def until_closed(sock: socket.socket, data: bytes = b"", end: bool = False) -> bytes:
    """Send `data` (as much as the server takes), end our side if `end`, then read what the
    server sends until it closes the connection (or 10 s pass: a server that keeps it open)."""
    got = b""
    with contextlib.suppress(ConnectionResetError, BrokenPipeError, TimeoutError):
        sock.sendall(data)
        if end:
            sock.shutdown(socket.SHUT_WR)
        while chunk := sock.recv(1 << 16):
            got += chunk
    sock.close()
    return got


def test_each_endpoint_publishes_its_own_random_token() -> None:
    a, b = TcpTransport(), TcpTransport()
    tokens = [bytes.fromhex(w.local_info()["token"]) for w in (a, b)]
    assert [len(t) for t in tokens] == [32, 32] and tokens[0] != tokens[1]
    a.close()
    b.close()


def test_a_raw_write_without_the_handshake_is_refused_unapplied_and_logged(
    receiver: Receiver, capsys: pytest.CaptureFixture[str]
) -> None:
    sock = dial(receiver.info)
    port = sock.getsockname()[1]
    attack = frame(WRITE, 7, 0, 0, 16, HAS_IMM) + b"\x66" * 16 + frame(END, 1)
    got = until_closed(sock, attack)
    assert len(got) == NONCE_BYTES  # the nonce; no ACK
    assert receiver.region == bytes([FILL]) * 64 and receiver.immediates() == []
    assert receiver.wire.refused == {"auth": 1, "frame": 0}
    err = capsys.readouterr().err
    assert f"127.0.0.1:{port} (not authenticated)" in err and "before authenticating" in err
    assert receiver.serves_the_sender()


def test_a_hello_without_the_right_token_is_refused(
    receiver: Receiver, capsys: pytest.CaptureFixture[str]
) -> None:
    forged = {**receiver.info, "token": bytes(32).hex()}
    sock = dial(forged)
    nonce = recv_exact(sock, NONCE_BYTES)
    mac = hmac.new(bytes(32), nonce + b"prefill0", hashlib.sha256).digest()
    hello = frame(HELLO, nbytes=8) + b"prefill0" + mac
    got = until_closed(sock, hello + frame(WRITE, 0, 0, 0, 16) + b"\x66" * 16 + frame(END, 1))
    assert got == b"" and receiver.region == bytes([FILL]) * 64
    assert receiver.wire.refused == {"auth": 1, "frame": 0}
    assert "a wrong token proof from 'prefill0'" in capsys.readouterr().err

    wire = TcpTransport(endpoint="prefill1")
    refused = r"peer 'decode0' at .*: cannot connect: the handshake"
    with pytest.raises(TransportError, match=refused):
        wire.connect("decode0", forged, [receiver.desc])
    wire.close()
    assert receiver.wire.refused == {"auth": 2, "frame": 0}
    assert receiver.serves_the_sender()


BAD_FRAMES = {
    "unknown kind": (frame(9), "unknown kind 9"),
    "an ACK": (frame(ACK, 1), "unknown kind 4"),
    "a second HELLO": (frame(HELLO, nbytes=4) + b"evil", "a second HELLO"),
    "an unregistered region": (frame(WRITE, 0, 5, 0, 8) + bytes(8), "region 5, which is not"),
    "past the region's end": (frame(WRITE, 0, 0, 60, 8) + bytes(8), "past the end of region 0"),
    "an offset past 2**63": (frame(WRITE, 0, 0, 2**64 - 4, 8) + bytes(8), "past the end"),
    "an immediate of 33 bits": (frame(IMM, 2**32), "immediate 4294967296 does not fit"),
    "a write's 40-bit immediate": (
        frame(WRITE, 2**40, 0, 0, 8, HAS_IMM) + bytes(8),
        "immediate 1099511627776 does not fit",
    ),
    "an IMM with a payload": (frame(IMM, 3, nbytes=2**30), "with a region, offset or payload"),
    "unknown flags": (frame(WRITE, 0, 0, 0, 8, flags=6) + bytes(8), "with flags 6"),
}


@pytest.mark.parametrize("bad", BAD_FRAMES, ids=list(BAD_FRAMES))
def test_a_bad_frame_closes_its_connection_unapplied_with_the_reason(
    receiver: Receiver, capsys: pytest.CaptureFixture[str], bad: str
) -> None:
    data, reason = BAD_FRAMES[bad]
    sock = authenticated(receiver.info)
    port = sock.getsockname()[1]
    assert until_closed(sock, data + frame(END, 1)) == b""  # closed before the END: no ACK
    assert receiver.region == bytes([FILL]) * 64 and receiver.guards_intact()
    assert receiver.immediates() == []
    assert receiver.wire.refused == {"auth": 0, "frame": 1}
    err = capsys.readouterr().err
    assert f"'mallory' at 127.0.0.1:{port}: " in err and reason in err
    assert receiver.serves_the_sender()


def test_a_frame_over_the_size_limit_is_refused_before_its_payload(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Even into a region that could hold it (np.zeros: pages are only mapped when written)."""
    wire = TcpTransport(endpoint="decode0")
    wire.register("big", np.zeros(MAX_FRAME_BYTES + 4096, dtype=np.uint8))
    sock = authenticated(wire.local_info())
    assert until_closed(sock, frame(WRITE, 0, 0, 0, MAX_FRAME_BYTES + 1)) == b""
    assert wire.refused == {"auth": 0, "frame": 1}
    assert f"a frame of {MAX_FRAME_BYTES + 1} bytes (at most" in capsys.readouterr().err
    wire.close()


@pytest.fixture(scope="module")
def fuzzed() -> Iterator[Receiver]:
    r = Receiver()
    yield r
    r.close()


@pytest.fixture(scope="module")
def thread_errors() -> Iterator[list[BaseException | None]]:
    """Exceptions that ended any thread (the server's included) while the fuzz ran."""
    errors: list[BaseException | None] = []
    hook = threading.excepthook
    threading.excepthook = lambda args: errors.append(args.exc_value)
    yield errors
    threading.excepthook = hook


_headers = st.builds(
    FRAME.pack,
    st.integers(0, 6),  # kind
    st.sampled_from([0, HAS_IMM, 2, 255]),  # flags
    st.sampled_from([0, 0, 1]),  # pad
    st.sampled_from([0, 0, 1, 2**32 - 1]),  # region
    st.integers(0, 80) | st.integers(0, 2**64 - 1),  # offset
    st.integers(0, 80) | st.sampled_from([MAX_FRAME_BYTES + 1, 2**63, 2**64 - 1]),  # nbytes
    st.integers(0, 2**32 + 1) | st.integers(0, 2**64 - 1),  # value
)
_streams = st.lists(
    st.binary(max_size=48) | _headers | st.tuples(_headers, st.binary(max_size=80)).map(b"".join),
    max_size=6,
).map(b"".join)


@settings(max_examples=60, deadline=None)
@given(stream=_streams, authenticate=st.booleans())
def test_fuzzed_streams_never_write_outside_regions_nor_stop_the_server(
    fuzzed: Receiver, thread_errors: list[BaseException | None], stream: bytes, authenticate: bool
) -> None:
    before_region, before = fuzzed.region, fuzzed.wire.refused
    fuzzed.immediates()
    sock = authenticated(fuzzed.info) if authenticate else dial(fuzzed.info)
    until_closed(sock, stream, end=True)
    assert fuzzed.guards_intact() and thread_errors == []
    if not authenticate:  # nothing applied, and one refusal more
        assert fuzzed.region == before_region and fuzzed.immediates() == []
        assert fuzzed.wire.refused == {**before, "auth": before["auth"] + 1}
    assert fuzzed.serves_the_sender()


def test_a_sender_whose_connection_the_receiver_closed_reconnects(receiver: Receiver) -> None:
    """A sender given a descriptor of a region id the receiver lacks: the receiver closes the
    connection, the batch fails naming the peer, and the next batch goes on a new connection."""
    wire = TcpTransport(endpoint="prefill1")
    wire.register("src", bytearray(range(8)))
    ghost = Descriptor("tcp", "ghost", 8, {"id": 3})
    wire.connect("decode0", receiver.info, [receiver.desc, ghost])
    wire.post("decode0", [Unit([Write("src", 0, "ghost", 0, 8)], imm=1)], wr_id=1)
    [failed] = wait_completions(wire, 1)
    assert not failed.ok and "peer 'decode0'" in failed.error
    assert receiver.wire.refused == {"auth": 0, "frame": 1}
    wire.post("decode0", [Unit([Write("src", 0, "r0", 0, 8)], imm=2)], wr_id=2)
    assert wait_completions(wire, 1) == [Completion(2, True)]
    assert receiver.region[:8] == bytes(range(8)) and receiver.immediates() == [2]
    wire.close()


def test_a_sender_that_connects_again_replaces_its_old_connection(receiver: Receiver) -> None:
    """Once a sender's new connection is authenticated, its old one is closed (what it had not
    applied is dropped): nothing of it is applied after the new connection's frames."""
    old = authenticated(receiver.info, b"prefill9")
    old.sendall(frame(WRITE, 0, 0, 0, 8) + b"half")  # a write cut short by the break
    new = authenticated(receiver.info, b"prefill9")
    assert until_closed(old, b"rest" + frame(IMM, 6) + frame(END, 1)) == b""
    new.sendall(frame(IMM, 7) + frame(END, 2))
    assert FRAME.unpack(recv_exact(new, FRAME.size))[::6] == (ACK, 2)
    assert receiver.immediates() == [7] and receiver.wire.refused == {"auth": 0, "frame": 0}
    new.close()
    assert receiver.serves_the_sender()

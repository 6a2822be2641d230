"""Hostile input on the control plane: whatever arrives on a server's socket (random bytes,
malformed or oversized messages, strangers), `Control.recv` drops it, counts it, says so on
stderr and returns the next good message; it never raises. Real ZeroMQ sockets on loopback."""

from __future__ import annotations

import json
import random
import time
from collections.abc import Iterator
from typing import Any

import pytest

zmq = pytest.importorskip("zmq")

from hypothesis import given, settings
from hypothesis import strategies as st

from disagg.core.messenger import PrefillRequest, TransferAborted
from disagg.errors import TransportError
from disagg.hw import protocol
from disagg.hw.control import _TYPES, MAX_MESSAGE_BYTES, Control, decode, encode

GOOD = TransferAborted(1, "the next good message")


class Peer:
    """A plain DEALER socket under a chosen identity, sending raw frames to `endpoint`."""

    def __init__(self, ctrl: Control, identity: bytes = b"prefill0") -> None:
        self.sock = ctrl.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.IDENTITY, identity)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(ctrl.endpoint)

    def send(self, frames: list[bytes]) -> None:
        self.sock.send_multipart(frames)

    def close(self) -> None:
        self.sock.close(0)


@pytest.fixture
def ctrl() -> Iterator[Control]:
    c = Control("decode0")
    yield c
    c.close()


@pytest.fixture
def peer(ctrl: Control) -> Iterator[Peer]:
    p = Peer(ctrl)
    yield p
    p.close()


def _survives(ctrl: Control, peer: Peer, frames: list[bytes], drops: int = 1) -> None:
    """Send `frames`, then a good message: recv returns the good one; `drops` more dropped."""
    before = ctrl.dropped
    peer.send(frames)
    peer.send(encode(GOOD))
    assert ctrl.recv(5.0) == ("prefill0", GOOD)
    assert ctrl.dropped == before + drops


def _await_drop(ctrl: Control) -> None:
    """Receive until one more message is dropped (one that may come before others sent later
    from other sockets): recv returns nothing meanwhile."""
    before, deadline = ctrl.dropped, time.monotonic() + 5.0
    while ctrl.dropped == before and time.monotonic() < deadline:
        assert ctrl.recv(0.01) is None
    assert ctrl.dropped == before + 1


def test_random_bytes_are_dropped_logged_and_counted(
    ctrl: Control, peer: Peer, capsys: pytest.CaptureFixture[str]
) -> None:
    junk = random.Random(17).randbytes(4096)
    _survives(ctrl, peer, [junk])
    _survives(ctrl, peer, [b"\xff\xfe" + junk])  # not UTF-8 at all (the crash)
    _survives(ctrl, peer, [b""])  # one empty frame
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 3
    assert all(line.startswith("decode0: dropped a message from prefill0") for line in lines)
    assert "not a message" in lines[0]


def test_a_sender_name_that_is_not_utf8_is_dropped(ctrl: Control) -> None:
    bad = Peer(ctrl, b"\xff\x00bad")
    bad.send(encode(GOOD))
    _await_drop(ctrl)
    bad.close()
    assert ctrl.last_seen == {}  # a dropped message does not vouch for its sender


def _json(**fields: Any) -> list[bytes]:
    return [json.dumps(fields).encode()]


MALFORMED = {
    "unknown type": _json(type="Exec", cmd="rm -rf /"),
    "no type": _json(req_id=1, reason="x"),
    "a JSON list": [b"[1, 2, 3]"],
    "deep nesting": [b"[" * 100_000 + b"]" * 100_000],
    "an int as a string": _json(type="TransferAborted", req_id="1", reason="x"),
    "a bool for an int": _json(type="TransferAborted", req_id=True, reason="x"),
    "a float for an int": _json(type="TransferAborted", req_id=1.0, reason="x"),
    "a huge int": _json(type="TransferAborted", req_id=10**30, reason="x"),
    "an int for a str": _json(type="TransferAborted", req_id=1, reason=5),
    "an extra field": _json(type="TransferAborted", req_id=1, reason="x", cmd="y"),
    "a missing field": _json(type="TransferAborted", req_id=1),
    "a str in a tuple of ints": _json(
        type="PrefillRequest", req_id=1, slot=0, decode_node=0, prompt_tokens=1, dst_pages=[1, "x"]
    ),
    "an object for a tuple": _json(
        type="PrefillRequest", req_id=1, slot=0, decode_node=0, prompt_tokens=1, dst_pages={}
    ),
    "a list for a dict": _json(type="NodeUp", name="n", endpoint="e", wire_info=[], regions=[]),
    "an int in a tuple of dicts": _json(type="Peers", peers=[{}, 3]),
    "a str in a dict of floats": _json(
        type="Finished", req_id=1, status="ok", reason="", tokens=[], times={"a": "b"}
    ),
    "a str in a tuple of tuples": _json(type="Records", name="n", steps=[[1], "x"], transfers=[]),
    "a str for a float": _json(type="Start", t0="now"),
}


@pytest.mark.parametrize("frames", MALFORMED.values(), ids=MALFORMED.keys())
def test_a_malformed_message_is_dropped(ctrl: Control, peer: Peer, frames: list[bytes]) -> None:
    _survives(ctrl, peer, frames)


def test_the_dropped_line_names_the_field(
    ctrl: Control, peer: Peer, capsys: pytest.CaptureFixture[str]
) -> None:
    _survives(ctrl, peer, MALFORMED["a str in a tuple of ints"])
    err = capsys.readouterr().err
    assert "from prefill0" in err and "PrefillRequest.dst_pages[1] must be an int, not str" in err


def test_field_types_follow_the_annotations() -> None:
    pages = _json(
        type="PrefillRequest", req_id=1, slot=0, decode_node=0, prompt_tokens=2, dst_pages=[3, 4]
    )
    assert decode(pages) == PrefillRequest(1, 0, 0, 2, (3, 4))
    steps = decode(_json(type="Records", name="n", steps=[[1, "a"]], transfers=[]))
    assert steps.steps == ((1, "a"),)  # tuples of tuples, as sent
    assert decode(_json(type="Start", t0=3)) == protocol.Start(3.0)  # an int is a number


def test_a_message_naming_frames_it_lacks_is_dropped(ctrl: Control, peer: Peer) -> None:
    frames = encode(PrefillRequest(7, 3, 1, 1000, tuple(range(1000)), 0))
    _survives(ctrl, peer, frames[:1])  # claims frame 1
    _survives(ctrl, peer, [frames[0].replace(b'"__i32__": 1', b'"__i32__": 9'), frames[1]])
    _survives(ctrl, peer, [frames[0], frames[1][:-1]])  # not whole int32 values
    _survives(ctrl, peer, [*frames, b"\0" * 8, b"\0" * 8])  # more than it has sequences


def test_an_oversized_message_is_dropped_by_the_socket_or_by_decode(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert MAX_MESSAGE_BYTES == 64 << 20
    with pytest.raises(TransportError, match="of 100 bytes"):
        decode([b"{}" * 50], max_bytes=99)
    c = Control("decode0", max_message_bytes=1 << 16)
    try:
        assert c.router.getsockopt(zmq.MAXMSGSIZE) == 1 << 16
        peer = Peer(c)
        # one frame over the limit: ZeroMQ drops it (and the connection, which comes back)
        _survives(c, peer, [b"x" * (1 << 17)], drops=0)
        # frames each under the limit, together over it: decode drops it
        frames = encode(PrefillRequest(7, 3, 1, 1, tuple(range(10_000)), 0, tuple(range(10_000))))
        assert len(frames) == 3 and all(len(f) < 1 << 16 for f in frames)
        _survives(c, peer, frames)
        assert "bytes (at most 65536)" in capsys.readouterr().err
        peer.close()
    finally:
        c.close()


def test_encode_refuses_a_message_peers_would_drop() -> None:
    huge = protocol.Records("n", (), (), error="x" * MAX_MESSAGE_BYTES)
    with pytest.raises(TransportError, match="exceeds MAX_MESSAGE_BYTES"):
        encode(huge)


def test_strangers_are_dropped_when_senders_are_checked(
    capsys: pytest.CaptureFixture[str],
) -> None:
    c = Control("decode0", allowed={"driver"})
    peers = {name: Peer(c, name.encode()) for name in ("driver", "prefill0", "intruder", "late0")}
    try:
        c.connect("prefill0", "tcp://127.0.0.1:1")  # a peer it was told about
        peers["driver"].send(encode(GOOD))
        assert c.recv(5.0) == ("driver", GOOD)
        peers["prefill0"].send(encode(GOOD))
        assert c.recv(5.0) == ("prefill0", GOOD)
        peers["intruder"].send(encode(GOOD))
        _await_drop(c)
        assert "intruder" not in c.last_seen
        err = capsys.readouterr().err
        assert "from intruder" in err and "not a known peer" in err
        c.allow(["late0"])
        peers["late0"].send(encode(GOOD))
        assert c.recv(5.0) == ("late0", GOOD)
    finally:
        for p in peers.values():
            p.close()
        c.close()


def test_anyone_is_accepted_by_default(ctrl: Control) -> None:
    anyone = Peer(ctrl, b"anyone")
    anyone.send(encode(GOOD))
    assert ctrl.recv(5.0) == ("anyone", GOOD) and ctrl.dropped == 0
    anyone.close()


# -- fuzzing

_json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner),
    max_leaves=12,
)


@st.composite
def _frame_lists(draw: st.DrawFn) -> list[bytes]:
    """Frames that look like messages: a registered type, its own field names (some left out,
    some extra) with arbitrary JSON values or packed references, then arbitrary frames."""
    if draw(st.booleans()):
        return draw(st.lists(st.binary(max_size=64), min_size=1, max_size=4))
    name = draw(st.sampled_from(sorted(_TYPES)))
    names = [*sorted(_TYPES[name].checks), "extra"]
    value = _json_values | st.builds(lambda i: {"__i32__": i}, st.integers(-2, 4))
    fields = draw(st.dictionaries(st.sampled_from(names), value, max_size=len(names)))
    rest = draw(st.lists(st.binary(max_size=16), max_size=3))
    return [json.dumps({"type": name, **fields}).encode(), *rest]


@settings(max_examples=300, deadline=None)
@given(_frame_lists())
def test_decode_raises_nothing_but_transport_error(frames: list[bytes]) -> None:
    try:
        msg = decode(frames)
    except TransportError:
        return
    assert type(msg).__name__ in _TYPES


@pytest.fixture(scope="module")
def fuzzed() -> Iterator[tuple[Control, Peer]]:
    c = Control("fuzzed")
    p = Peer(c)
    yield c, p
    p.close()
    c.close()


@settings(max_examples=200, deadline=None)
@given(identity=st.binary(max_size=12), frames=_frame_lists())
def test_accepting_raises_nothing(
    fuzzed: tuple[Control, Peer], identity: bytes, frames: list[bytes]
) -> None:
    c, _ = fuzzed
    before = c.dropped
    got = c._accept([identity, *frames])
    assert (got is None) == (c.dropped == before + 1)


@settings(max_examples=40, deadline=None)
@given(frames=_frame_lists())
def test_recv_returns_the_good_message_after_any_frames(
    fuzzed: tuple[Control, Peer], frames: list[bytes]
) -> None:
    c, peer = fuzzed
    peer.send(frames)
    peer.send(encode(GOOD))
    got = c.recv(5.0)
    while got is not None and got[1] != GOOD:  # the fuzzed frames may be a good message
        got = c.recv(5.0)
    assert got == ("prefill0", GOOD)

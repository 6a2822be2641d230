"""The ZeroMQ control plane: typed messages between real processes, heartbeats, dead peers."""

import multiprocessing as mp
import time

import pytest

pytest.importorskip("zmq")

from disagg.core.messenger import PrefillRequest, TransferAborted
from disagg.errors import TransportError
from disagg.hw.control import PACK_MIN, Control, decode, encode
from disagg.hw.protocol import Finished


def test_messages_round_trip() -> None:
    msg = PrefillRequest(7, 3, 1, 100, (4, 5, 6), 0)
    assert decode(encode(msg)) == msg
    with pytest.raises(TransportError, match="not a registered message"):
        encode(object())


def test_long_integer_sequences_travel_packed_and_come_back_exact() -> None:
    prompt = tuple(range(-5, 40_000, 3))  # long: a raw int32 frame
    msg = PrefillRequest(7, 3, 1, len(prompt), prompt, 0)
    frames = encode(msg)
    assert len(frames) == 2 and len(frames[1]) == 4 * len(prompt)
    assert b"__i32__" in frames[0] and len(frames[0]) < 200
    assert decode(frames) == msg
    two = PrefillRequest(7, 3, 1, len(prompt), tuple(range(PACK_MIN)), 0, prompt)
    assert len(encode(two)) == 3 and decode(encode(two)) == two  # pages and prompt: two frames
    # too large for int32, or not integers: plain JSON, still exact
    halves = tuple(i / 2 for i in range(PACK_MIN))
    for odd in (
        PrefillRequest(7, 3, 1, 1, tuple(range(2**31, 2**31 + PACK_MIN)), 0),
        Finished(7, "ok", "", (), {}, logits=halves, metadata_sum=0.0),
    ):
        assert len(encode(odd)) == 1 and b"__i32__" not in encode(odd)[0]
        assert decode(encode(odd)) == odd


def test_a_malformed_message_is_a_clear_error() -> None:
    frames = encode(PrefillRequest(7, 3, 1, 1000, tuple(range(1000)), 0))
    with pytest.raises(TransportError, match="names frame 1 it lacks"):
        decode(frames[:1])
    for bad in ([b"not json"], [], [b'{"type": "Nope"}'], [b"[1, 2]"], [b'{"type": [1]}']):
        with pytest.raises(TransportError, match=r"not a message|unknown message"):
            decode(bad)
    with pytest.raises(TransportError, match="not whole int32 values"):
        decode([frames[0], frames[1][:-1]])
    with pytest.raises(TransportError, match="names frame True"):
        decode([frames[0].replace(b'{"__i32__": 1}', b'{"__i32__": true}'), frames[1]])
    with pytest.raises(TransportError, match="a malformed PrefillRequest"):
        decode([b'{"type": "PrefillRequest", "req_id": 1}'])


def _echo(endpoint: str, q: mp.Queue) -> None:
    c = Control("prefill0")
    q.put(c.endpoint)
    c.connect("decode0", endpoint)
    got = c.recv(10.0)
    assert got is not None
    sender, msg = got
    c.send(sender, TransferAborted(msg.req_id, f"echo from {c.name}"))
    for _ in range(20):  # 2 s of heartbeats only, then silence
        c.heartbeat(0.0)
        time.sleep(0.1)
    c.close()


def test_two_processes_exchange_messages_heartbeats_keep_a_peer_alive_and_silence_kills() -> None:
    ctx = mp.get_context("spawn")
    me = Control("decode0", dead_after_s=1.0)
    q: mp.Queue = ctx.Queue()
    p = ctx.Process(target=_echo, args=(me.endpoint, q))
    p.start()
    me.connect("prefill0", q.get(timeout=30))
    me.send("prefill0", PrefillRequest(9, 0, 0, 10, (1,), 0))
    got = me.recv(10.0)
    assert got == ("prefill0", TransferAborted(9, "echo from prefill0"))
    t = time.monotonic()
    while time.monotonic() - t < 1.5:  # longer than dead_after_s: only heartbeats arrive
        assert me.recv(0.1) is None  # heartbeats are not messages...
    assert me.dead_peers() == []  # ...but they keep the peer alive
    p.join(10)
    t = time.monotonic()
    while time.monotonic() - t < 1.2:  # still listening: silence, not a deaf loop, kills it
        me.recv(0.1)
    assert me.dead_peers() == ["prefill0"]
    me.close()

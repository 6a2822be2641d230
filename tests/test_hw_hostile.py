"""Hostile input to the servers of a real run (CPU, tcp wire, real processes): random bytes on
their control sockets, a stranger's Shutdown, a Submit with a token id outside the vocabulary
and one that reuses a request id. Each is dropped and counted (a prompt outside the vocabulary
fails, with the reason); no server crashes or stops, and the run's tokens are those of a run
that got none of it."""

import random
from pathlib import Path

import pytest

zmq = pytest.importorskip("zmq")
pytest.importorskip("torch")

from disagg.config import build_experiment
from disagg.core.request import Request
from disagg.hw.control import encode
from disagg.hw.driver import Driver, run_hw
from disagg.hw.protocol import Finished, Shutdown, Submit

DATA = {
    "name": "hostile",
    "seed": 3,
    "model": {"name": "tiny-gqa", "weight_dtype": "bf16"},
    "cluster": {
        "mode": "disagg",
        "prefill": {"nodes": 1, "tp": 1, "token_budget": 16},
        "decode": {"nodes": 1, "tp": 1, "max_batch": 8},
    },
    "kv": {"page_size": 4, "pages": 256},
    "hw": {"wire": "tcp"},
    "workload": {
        "rate_per_s": 10,
        "num_requests": 12,
        "prompt_tokens": {"dist": "uniform", "low": 6, "high": 40},
        "output_tokens": {"dist": "uniform", "low": 3, "high": 8},
    },
}


def attack(driver: Driver) -> int:
    """Send every hostile message to the running servers; return how many should drop."""
    endpoints = {
        name: sock.getsockopt_string(zmq.LAST_ENDPOINT)
        for name, sock in driver.control.dealers.items()
    }
    rng = random.Random(0)
    ctx = driver.control.ctx
    drops = 0
    for endpoint in endpoints.values():
        raw = ctx.socket(zmq.DEALER)
        raw.setsockopt(zmq.IDENTITY, b"mallory")
        raw.setsockopt(zmq.LINGER, 1000)
        raw.connect(endpoint)
        raw.send(rng.randbytes(4096))  # 4 KB of random bytes
        raw.send_multipart([rng.randbytes(64), b"\xff\xfe"])
        raw.send_multipart(encode(Shutdown()))  # a stranger's Shutdown
        raw.close()
        drops += 3
    vocab = driver.exp.model.spec.vocab
    bad_token = Submit(10_000, 0.0, (1, 2, vocab), 4)  # the driver's own socket, gone wrong:
    reused = Submit(0, 0.0, (7,) * 12, 4)  # request 0's id again, with other tokens: dropped
    # by the decoder while request 0 runs there, else its second Finished by the driver
    driver.control.send("decode0", bad_token)  # failed there; its Finished drops here
    driver.control.send("decode0", reused)
    return drops + 2


def test_hostile_messages_are_dropped_and_change_nothing(tmp_path: Path) -> None:
    summary, clean_run = run_hw(build_experiment(DATA), tmp_path / "clean")
    assert summary["messages_dropped"] == 0 and summary["completed"] == 12
    driver = Driver(build_experiment(DATA))
    sent: list[int] = []

    def once(done: int, total: int) -> None:
        if not sent and driver.run_state.sent:  # request 0 is out: the reuse comes after it
            sent.append(attack(driver))

    try:
        driver.start()
        state = driver.replay(once)
    finally:
        driver.stop()
    assert sent and not driver.stuck
    assert set(state.finished) == set(clean_run.finished) == set(range(12))
    assert all(f.status == "finished" for f in state.finished.values())
    for req_id, fin in clean_run.finished.items():  # request 0's tokens were not replaced
        assert state.finished[req_id].tokens == fin.tokens
    dropped = sum(r.counters["messages_dropped"] for r in state.records.values())
    # each server dropped the strangers' three; the decoder or the driver the reused id; the
    # driver the Finished of the request outside the vocabulary, which it never sent
    assert dropped + driver.control.dropped == sent[0]
    assert all(not r.error for r in state.records.values())


def test_the_driver_keeps_one_end_per_request_of_its_run() -> None:
    """A Finished for a request the run never sent, or a second one, is dropped and counted."""
    driver = Driver(build_experiment(DATA))
    try:
        driver.run_state.requests[0] = Request(0, 0.0, 10, 4, prefill_node=0, decode_node=0)
        first = Finished(0, "finished", "", (1, 2), {})
        driver.finish("decode0", first)
        driver.finish("decode0", Finished(0, "failed", "again", (), {}))
        driver.finish("decode0", Finished(99, "finished", "", (3,), {}))
        assert driver.run_state.finished == {0: first} and driver.control.dropped == 2
    finally:
        driver.control.close()

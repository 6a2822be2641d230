"""Fixtures for the tests that need a real verbs device (run inside the soft-RoCE VM).

On a machine without one every test here skips; `tests/test_verbs.py` boots the VM that runs them.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from disagg.errors import TransportError
from disagg.hw.transport.base import Descriptor, Polled
from disagg.hw.transport.verbs import VerbsTransport, device_names, load_pyverbs


@pytest.fixture(scope="session")
def rdma_device() -> str:
    try:
        return device_names(load_pyverbs())[0]
    except TransportError as ex:
        pytest.skip(f"needs a verbs device ({ex}); tests/test_verbs.py runs these in a VM")


def wire(name: str, **kw: Any) -> VerbsTransport:
    return VerbsTransport(name, **kw)


def as_json(obj: Any) -> Any:
    """What the control plane does to connection data: a JSON round trip."""
    return json.loads(json.dumps(obj))


def connect(a: VerbsTransport, b: VerbsTransport, b_regions: list[Descriptor]) -> None:
    """a connects to b (as "b"), with b's connection data and descriptors sent as JSON."""
    desc = [Descriptor.from_dict(as_json(d.to_dict())) for d in b_regions]
    a.connect("b", as_json(b.local_info()), desc)


def wait_for(
    wires: list[VerbsTransport], until: Callable[..., bool], timeout_s: float = 30.0
) -> list[Polled]:
    """Poll every wire (progress is poll-driven: a sender's backlog moves only when it is polled),
    accumulating each one's results, until `until(*results)`; fails the test on timeout."""
    got = [Polled() for _ in wires]
    deadline = time.monotonic() + timeout_s
    while not until(*got):
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout_s} s with {got}")
        idle = True
        for t, acc in zip(wires, got, strict=True):
            polled = t.poll()
            acc.completions += polled.completions
            acc.immediates += polled.immediates
            acc.arrived_s += polled.arrived_s
            idle = idle and not polled.completions and not polled.immediates
        if idle:
            time.sleep(0.0005)
    return got


@pytest.fixture
def pair(rdma_device: str) -> Iterator[Callable[..., tuple[VerbsTransport, VerbsTransport]]]:
    """A factory of connected (sender, receiver) pairs; every wire made is closed afterwards."""
    made: list[VerbsTransport] = []

    def make(**kw: Any) -> tuple[VerbsTransport, VerbsTransport]:
        a, b = wire("a", **kw), wire("b", **kw)
        made.extend((a, b))
        return a, b

    yield make
    for t in made:
        t.close()

"""A receiving endpoint in a child process, for tests and benchmarks of the wires.

`serve_receiver` is the body of a spawned process: it registers regions of the given sizes
(zeroed; CPU bytearrays for tcp, CUDA tensors for cuda; `stacked`: rows of one CUDA tensor, as
a KV cache's layers are), sends `(local_info, [descriptor
dicts])` through its pipe, then answers commands until told to close:
    ("wait", n, check_order, timeout_s) -> (immediates seen, order violations)
    ("read", region_index)              -> the region's bytes
    ("close",)                           -> closes the endpoint and returns
Order check: unit k is expected to have written slot k (16 bytes at k * 16 of region 0) with
the little-endian uint32 k four times; when immediate k arrives, every slot <= k must hold its
value, else it counts as a violation.
"""

from __future__ import annotations

import multiprocessing as mp
import time
from collections.abc import Sequence
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

from disagg.hw.transport import make_transport
from disagg.hw.transport.base import Completion, Descriptor, Transport

SLOT = 16


def slot_bytes(k: int) -> bytes:
    """What unit k writes in the order check: uint32 k, four times."""
    return np.full(4, k, dtype="<u4").tobytes()


def buffers(wire: str, sizes: Sequence[int], device: str, stacked: bool = False) -> list[Any]:
    """Zeroed regions of `sizes` bytes for `wire` (see the module doc)."""
    if wire != "cuda":
        return [bytearray(n) for n in sizes]
    import torch

    if stacked:
        if len(set(sizes)) != 1:
            raise ValueError(f"stacked regions have one size, got {sorted(set(sizes))}")
        return list(torch.zeros((len(sizes), sizes[0]), dtype=torch.uint8, device=device))
    return [torch.zeros(n, dtype=torch.uint8, device=device) for n in sizes]


def _host_bytes(buf: Any) -> bytes:
    return bytes(buf) if isinstance(buf, bytearray) else bytes(buf.cpu().numpy().tobytes())


def _violations(buf: Any, k: int) -> int:
    slots = np.frombuffer(_host_bytes(buf)[: (k + 1) * SLOT], dtype="<u4").reshape(-1, 4)
    return int((slots != np.arange(k + 1, dtype="<u4")[:, None]).any(axis=1).sum())


def _wait(wire: Any, buf: Any, n: int, check: bool, timeout_s: float) -> tuple[list[int], int]:
    seen: list[int] = []
    bad = 0
    deadline = time.monotonic() + timeout_s
    while len(seen) < n and time.monotonic() < deadline:
        imms = wire.poll().immediates
        if not imms:
            time.sleep(1e-4)
        if check and imms:
            bad += _violations(buf, max(imms))
        seen += imms
    return seen, bad


def serve_receiver(
    conn: Connection,
    wire_name: str,
    sizes: Sequence[int],
    device: str = "cpu",
    endpoint: str = "receiver",
    stacked: bool = False,
) -> None:
    """Child-process body: see the module doc for the protocol over `conn`."""
    wire = make_transport(wire_name, endpoint=endpoint)
    bufs = buffers(wire_name, sizes, device, stacked)
    descs = [wire.register(f"r{i}", b).to_dict() for i, b in enumerate(bufs)]
    conn.send((wire.local_info(), descs))
    while True:
        cmd = conn.recv()
        if cmd[0] == "wait":
            conn.send(_wait(wire, bufs[0], cmd[1], cmd[2], cmd[3]))
        elif cmd[0] == "read":
            conn.send(_host_bytes(bufs[cmd[1]]))
        else:
            wire.close()
            conn.send("closed")
            return


class ReceiverProcess:
    """A spawned child running `serve_receiver`; `info` and `descs` are its endpoint's."""

    def __init__(
        self,
        wire: str,
        sizes: Sequence[int],
        device: str = "cpu",
        endpoint: str = "receiver",
        stacked: bool = False,
    ) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(
            target=serve_receiver,
            args=(child, wire, list(sizes), device, endpoint, stacked),
            daemon=True,
        )
        self.proc.start()
        info, descs = self.conn.recv()
        self.info: dict[str, Any] = info
        self.descs = [Descriptor.from_dict(d) for d in descs]

    def ask(self, *cmd: Any) -> Any:
        """Send one command (see the module doc) and return the child's answer."""
        self.conn.send(cmd)
        return self.conn.recv()

    def close(self) -> None:
        if self.proc.is_alive():
            self.ask("close")
        self.proc.join(10)


def wait_completions(
    wire: Transport, n: int, timeout_s: float = 20, poll_s: float = 1e-4
) -> list[Completion]:
    """Poll `wire` every `poll_s` (a sleep, which lets the wire's threads take the GIL) until
    `n` completions arrived or `timeout_s` passed; returns them."""
    done: list[Completion] = []
    deadline = time.monotonic() + timeout_s
    while len(done) < n and time.monotonic() < deadline:
        done += wire.poll().completions
        time.sleep(poll_s)
    return done


def await_completion(wire: Transport, wr_id: int, timeout_s: float = 20) -> None:
    """Until batch `wr_id`, the only one in flight, completes, polling every 10 us (fine
    enough to time a post end to end); RuntimeError if it failed (or another completed),
    TimeoutError after `timeout_s`."""
    done = wait_completions(wire, 1, timeout_s, poll_s=1e-5)
    if not done:
        raise TimeoutError(f"batch {wr_id} did not complete in {timeout_s} s")
    if done != [Completion(wr_id, True)]:
        raise RuntimeError(f"waiting for batch {wr_id}: {done}")

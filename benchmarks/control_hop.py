"""One control-plane hop between two processes: how long a request takes to cross it.

    python benchmarks/control_hop.py --out DIR                  # any machine, no GPU
    python benchmarks/control_hop.py --prompts 16,2048 --count 50 --out DIR

gpu_ttft.py's hops table times each hop inside a run, where a hop costs far more than encoding
and decoding the prompt it carries (docs/results.md). This times the hop alone: a sender process
sends `Submit` messages (the same encoding as the servers'), spaced so that the receiver idles
between them as a server does between requests; the receiver stamps each on arrival, after
decoding it. Both share the host's clock. For each prompt length, the receiver waits as an idle
server does (in its poll, up to 2 ms at a time) or spins (`DISAGG_SPIN`), with and without a PM
QoS request holding the host's cores out of deep idle states (`DISAGG_CPU_LATENCY_US=0`, if the
host allows it); over ZeroMQ on loopback TCP (the servers' default), over ZeroMQ on a Unix
socket (ipc), and, as the floor, the same frames over a plain Unix socket read by the receiving
thread itself (`raw`: no ZeroMQ I/O threads to wake); optionally (`--pin on`) with each side's
thread and its ZeroMQ I/O thread pinned to one core of their own. Each case runs in two fresh
processes. Writes control_hop.md and control_hop.json into --out: the median and 90th percentile
one-way time of each case."""

from __future__ import annotations

import argparse
import itertools
import json
import multiprocessing as mp
import os
import socket
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd
import zmq

from disagg.hw.control import Control, decode, encode
from disagg.hw.latency import hold_cpu_latency
from disagg.hw.protocol import Submit

BINDS = {"tcp": "tcp://127.0.0.1:*", "ipc": "ipc://{dir}/hop"}
WARM_UP = 5  # messages that warm the path up, left out


@dataclass(frozen=True)
class Case:
    transport: str  # tcp | ipc | raw
    prompt: int  # tokens in each message's prompt
    spin: bool  # the receiver polls without waiting
    latency: bool  # a PM QoS request holds the cores' wake-up latency at 0 us
    pin: bool  # each side's thread and its ZeroMQ I/O thread on one core of their own


def _pin(case: Case, side: int) -> None:
    """Pin this process (and, made next, its ZeroMQ context's I/O thread) to core `side` of
    those it may use."""
    if not case.pin:
        return
    cores = sorted(os.sched_getaffinity(0))
    core = cores[side % len(cores)]
    os.sched_setaffinity(0, {core})
    zmq.Context.instance().set(zmq.THREAD_AFFINITY_CPU_ADD, core)


def receive(case: Case, count: int, endpoints: Any, results: Any) -> None:
    _pin(case, 1)
    if case.latency:
        hold_cpu_latency(0)
    delays: list[float] = []
    if case.transport == "raw":  # the floor: one blocking read of a Unix socket, no I/O thread
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        path = tempfile.mkdtemp() + "/hop"
        listener.bind(path)
        listener.listen(1)
        endpoints.put(path)
        conn, _ = listener.accept()
        conn.setblocking(not case.spin)
        for _ in range(count):
            frames = _read_frames(conn)  # first: the stamp below must follow the read
            delays.append(time.time() - decode(frames).arrival_s)
        results.put(delays)
        return
    control = Control("receiver", BINDS[case.transport].format(dir=tempfile.mkdtemp()))
    endpoints.put(control.endpoint)
    while len(delays) < count:
        got = control.recv(0.0 if case.spin else 0.002)
        if got is not None:
            delays.append(time.time() - got[1].arrival_s)
    results.put(delays)
    control.close()


def send(case: Case, count: int, spacing_s: float, endpoint: str) -> None:
    """Send `count` Submit messages `spacing_s` apart, each stamped as it leaves."""
    _pin(case, 0)
    tokens = tuple(range(case.prompt))
    if case.transport == "raw":
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        conn.connect(endpoint)
        for i in range(count):
            time.sleep(spacing_s)
            frames = encode(Submit(i, time.time(), tokens, 8))
            sizes = struct.pack(f"I{len(frames)}I", len(frames), *map(len, frames))
            conn.sendall(sizes + b"".join(frames))
        conn.close()
        return
    control = Control("sender")
    control.connect("receiver", endpoint)
    for i in range(count):
        time.sleep(spacing_s)
        control.send("receiver", Submit(i, time.time(), tokens, 8))
    control.close(linger_s=5.0)


def _read_exactly(conn: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        try:
            chunk = conn.recv(n - len(buf))
        except BlockingIOError:  # spinning
            continue
        if not chunk:
            raise ConnectionError("the sender hung up")
        buf += chunk
    return bytes(buf)


def _read_frames(conn: socket.socket) -> list[bytes]:
    (count,) = struct.unpack("I", _read_exactly(conn, 4))
    sizes = struct.unpack(f"{count}I", _read_exactly(conn, 4 * count))
    return [_read_exactly(conn, n) for n in sizes]


def one_case(case: Case, count: int, spacing_s: float) -> list[float]:
    """One-way seconds of `count` messages, both sides in fresh processes."""
    ctx = mp.get_context("spawn")
    endpoints, results = ctx.Queue(), ctx.Queue()
    receiver = ctx.Process(target=receive, args=(case, count + WARM_UP, endpoints, results))
    receiver.start()
    sender = ctx.Process(
        target=send, args=(case, count + WARM_UP, spacing_s, endpoints.get(timeout=60))
    )
    sender.start()
    delays = results.get(timeout=60 + 2 * count * spacing_s)[WARM_UP:]
    for proc in (sender, receiver):
        proc.join(10)
    return delays


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", default="16,2048,32768")
    ap.add_argument("--count", type=int, default=100)
    ap.add_argument("--spacing-s", type=float, default=0.05)
    ap.add_argument("--transports", default="tcp,ipc,raw", help="of tcp, ipc, raw")
    ap.add_argument("--latency", default="off,on", help="cpu latency request: off, on or both")
    ap.add_argument("--pin", default="off", help="pin each side to a core: off, on or both")
    ap.add_argument("--out", type=Path, default=Path("runs/control_hop"))
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    rows = []
    for transport in args.transports.split(","):
        if transport not in (*BINDS, "raw"):
            raise SystemExit(f"unknown transport {transport!r}: want tcp, ipc or raw")
    cases = itertools.product(
        args.transports.split(","),
        [x == "on" for x in args.latency.split(",")],
        [x == "on" for x in args.pin.split(",")],
        (False, True),
        [int(p) for p in args.prompts.split(",")],
    )
    for transport, latency, pin, spin, prompt in cases:
        case = Case(transport, prompt, spin, latency, pin)
        d = 1e3 * pd.Series(one_case(case, args.count, args.spacing_s))
        rows.append(
            {
                "transport": transport,
                "prompt tokens": prompt,
                "receiver": "spins" if spin else "waits",
                "cpu latency held": latency,
                "pinned": pin,
                "median (ms)": statistics.median(d),
                "p90 (ms)": d.quantile(0.9),
            }
        )
        print(rows[-1], flush=True)
    held = hold_cpu_latency(0)  # whether this host allows it (this process: stops at exit)
    table = pd.DataFrame(rows).round(3)
    host = subprocess.run(["uname", "-srm"], capture_output=True, text=True).stdout.strip()
    head = (
        f"control_hop.py, {time.strftime('%Y-%m-%d')}, host {host}, python {sys.version.split()[0]}"
        f", {args.count} messages per case {args.spacing_s * 1e3:g} ms apart; cpu latency "
        f"request: {held}\n\n"
    )
    (args.out / "control_hop.md").write_text(head + table.to_markdown(index=False) + "\n")
    (args.out / "control_hop.json").write_text(json.dumps(rows, indent=2) + "\n")
    print(head + table.to_markdown(index=False))


if __name__ == "__main__":
    main()

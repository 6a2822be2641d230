"""One control-plane hop between two processes: how long a request takes to cross it.

    python benchmarks/control_hop.py --out DIR                  # any machine, no GPU
    python benchmarks/control_hop.py --prompts 16,2048 --count 50 --out DIR

gpu_ttft.py's hops table shows a request taking 0.6-0.8 ms to cross one ZeroMQ hop between
the servers on an H200 host, where encoding and decoding a 2k-token prompt take about 70 us.
This times the hop alone: a sender process sends `Submit` messages (the same encoding as the
servers'), spaced so that the receiver idles between them as a server does between requests;
the receiver stamps each on arrival, after decoding it. Both share the host's clock. For each
prompt length, the receiver waits as an idle server does (in its poll, up to 2 ms at a time)
or spins (`DISAGG_SPIN`), with and without a PM QoS request holding the host's cores out of
deep idle states (`DISAGG_CPU_LATENCY_US=0`, if the host allows it); over ZeroMQ on loopback
TCP (the servers' default), over ZeroMQ on a Unix socket (ipc), and, as the floor, the same
frames over a plain Unix socket read by the receiving thread itself (`raw`: no ZeroMQ I/O
threads to wake). Writes control_hop.md and control_hop.json into --out: the median and 90th
percentile one-way time of each case.
"""

from __future__ import annotations

import argparse
import itertools
import json
import multiprocessing as mp
import socket
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import pandas as pd

from disagg.hw.control import Control, decode, encode
from disagg.hw.knobs import hold_cpu_latency
from disagg.hw.protocol import Submit

BINDS = {"tcp": "tcp://127.0.0.1:*", "ipc": "ipc://{dir}/hop"}


def receive(
    endpoints: Any, results: Any, count: int, spin: bool, latency: bool, transport: str
) -> None:
    if latency:
        hold_cpu_latency(0)
    delays: list[float] = []
    if transport == "raw":  # the floor: one blocking read of a Unix socket, no I/O thread
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        path = tempfile.mkdtemp() + "/hop"
        listener.bind(path)
        listener.listen(1)
        endpoints.put(path)
        conn, _ = listener.accept()
        conn.setblocking(not spin)
        for _ in range(count):
            frames = _read_frames(conn)
            delays.append(time.time() - decode(frames).arrival_s)
        results.put(delays)
        return
    control = Control("receiver", BINDS[transport].format(dir=tempfile.mkdtemp()))
    endpoints.put(control.endpoint)
    while len(delays) < count:
        got = control.recv(0.0 if spin else 0.002)
        if got is not None:
            delays.append(time.time() - got[1].arrival_s)
    results.put(delays)
    control.close()


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


def one_case(
    prompt: int, count: int, spacing_s: float, spin: bool, latency: bool, transport: str
) -> list[float]:
    ctx = mp.get_context("spawn")
    endpoints, results = ctx.Queue(), ctx.Queue()
    args = (endpoints, results, count + 5, spin, latency, transport)
    proc = ctx.Process(target=receive, args=args)
    proc.start()
    tokens = tuple(range(prompt))
    if transport == "raw":
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        conn.connect(endpoints.get(timeout=60))

        def send(msg: Submit) -> None:
            frames = encode(msg)
            sizes = struct.pack(f"I{len(frames)}I", len(frames), *map(len, frames))
            conn.sendall(sizes + b"".join(frames))
    else:
        control = Control("sender")
        control.connect("receiver", endpoints.get(timeout=60))

        def send(msg: Submit) -> None:
            control.send("receiver", msg)

    for i in range(count + 5):  # the first five warm the path up and are left out
        time.sleep(spacing_s)
        send(Submit(i, time.time(), tokens, 8))
    delays = results.get(timeout=60)[5:]
    proc.join(10)
    if transport == "raw":
        conn.close()
    else:
        control.close()
    return delays


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", default="16,2048,32768")
    ap.add_argument("--count", type=int, default=100)
    ap.add_argument("--spacing-s", type=float, default=0.05)
    ap.add_argument("--transports", default="tcp,ipc,raw", help="of tcp, ipc, raw")
    ap.add_argument("--latency", default="off,on", help="cpu latency request: off, on or both")
    ap.add_argument("--out", type=Path, default=Path("runs/control_hop"))
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    rows = []
    cases = itertools.product(
        args.transports.split(","),
        [x == "on" for x in args.latency.split(",")],
        (False, True),
        [int(p) for p in args.prompts.split(",")],
    )
    for transport, latency, spin, prompt in cases:
        if transport not in (*BINDS, "raw"):
            raise SystemExit(f"unknown transport {transport!r}: want tcp, ipc or raw")
        delays = one_case(prompt, args.count, args.spacing_s, spin, latency, transport)
        d = 1e3 * pd.Series(delays)
        rows.append(
            {
                "transport": transport,
                "prompt tokens": prompt,
                "receiver": "spins" if spin else "waits",
                "cpu latency held": latency,
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

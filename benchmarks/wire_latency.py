"""Where the time of one post over a wire goes, from `post()` to its completion.

    python benchmarks/wire_latency.py --wire cuda --src-device 0 --dst-device 0 --out DIR
    python benchmarks/wire_latency.py --wire tcp --out DIR          # any machine

A post completes later than its copies end (gpu_bench's end-to-end column against its copy
time), and that fixed cost is on whole-request TTFT's path ("end to ready"). This times, for
a post of one tiny unit, of one layer of a request (a layer-wise post), and of all its layers
(whole-request), the median of:
- post: the host time inside `wire.post` (validation, planning, launching the copies);
- copied: from the start of `post` until an event recorded after it completes (the main
  thread polls it), i.e. the copies are done on the device;
- completed: until the sender sees the batch complete (the receiver acknowledged every
  immediate): the notification path (worker thread, socket, receiver thread, ack).
Writes wire_latency.json and wire_latency.md into --out.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import io
import json
import pstats
import statistics
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from disagg.hw.device import resolve_device
from disagg.hw.transport import make_transport
from disagg.hw.transport.base import Unit, WriteArray, total_bytes
from disagg.hw.transport.peer import ReceiverProcess, await_completion, buffers
from disagg.models import LLAMA_31_8B

PAGE_TOKENS = 16


def _units(layers: int, page: int, pages: int) -> list[Unit]:
    off = np.arange(pages, dtype=np.int64) * page
    sizes = np.full(pages, page, dtype=np.int64)
    return [Unit(WriteArray(f"s{i}", f"r{i}", off, off, sizes), imm=i) for i in range(layers)]


@contextlib.contextmanager
def _connected(
    wire_name: str, layers: int, tokens: int, src_dev: str, dst_dev: str
) -> Iterator[tuple[Any, ReceiverProcess, list[Unit]]]:
    """A sender wire connected to a receiver process, both holding `layers` regions in one
    allocation (as a KV cache does) big enough for twice a `tokens`-token request of
    Llama-3.1-8B; also that request's units, one per layer."""
    page = PAGE_TOKENS * LLAMA_31_8B.kv_bytes_per_token_per_layer()
    pages = tokens // PAGE_TOKENS
    size = 2 * pages * page
    recv = ReceiverProcess(wire_name, [size] * layers, dst_dev, "decode", stacked=True)
    wire = make_transport(wire_name, endpoint="prefill")
    try:
        for i, b in enumerate(buffers(wire_name, [size] * layers, src_dev, stacked=True)):
            wire.register(f"s{i}", b)
        wire.connect("decode", recv.info, recv.descs)
        yield wire, recv, _units(layers, page, pages)
    finally:
        wire.close()
        recv.close()


def measure(
    wire_name: str, src_dev: str, dst_dev: str, tokens: int, repeats: int
) -> dict[str, Any]:
    layers = LLAMA_31_8B.layers
    with _connected(wire_name, layers, tokens, src_dev, dst_dev) as (wire, recv, whole):
        nbytes = sum(total_bytes(u.writes) for u in whole)
        out: dict[str, Any] = {"wire": wire_name, "tokens": tokens, "bytes": nbytes}
        posts = {"one 64-byte unit": [Unit(WriteArray("s0", "r0", [0], [0], [64]), imm=0)]}
        posts[f"{tokens}-token request, last layer"] = whole[-1:]
        posts[f"{tokens}-token request, {layers} layers"] = whole
        wr = 0
        for name, units in posts.items():
            rows: list[tuple[float, float, float]] = []
            for _ in range(repeats + 2):
                wr += 1
                rows.append(_one(wire, units, wr))
            post, copied, done = (statistics.median(c) * 1e3 for c in zip(*rows[2:], strict=True))
            out[name] = {"post_ms": post, "copied_ms": copied, "completed_ms": done}
        want = (repeats + 2) * sum(len(u) for u in posts.values())
        imms, _ = recv.ask("wait", want, False, 10)
        out["immediates_seen"], out["immediates_posted"] = len(imms), want
    return out


def profile_posts(wire_name: str, src_dev: str, dst_dev: str, tokens: int, n: int) -> str:
    """cProfile of `n` one-layer posts (each awaited), the top functions by own time."""
    with _connected(wire_name, 1, tokens, src_dev, dst_dev) as (wire, _, unit):
        for wr in range(10):
            _one(wire, unit, wr)
        prof = cProfile.Profile()
        for wr in range(10, 10 + n):
            prof.enable()
            wire.post("decode", unit, wr)
            prof.disable()
            await_completion(wire, wr)
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(25)
    return text.getvalue()


def _one(wire: Any, units: list[Unit], wr: int) -> tuple[float, float, float]:
    """(post, copied, completed) seconds of one post, all from the start of `post`."""
    stream = getattr(wire, "stream", None)
    if stream is not None:
        import torch
    t0 = time.perf_counter()
    wire.post("decode", units, wr)
    t_post = time.perf_counter()
    if stream is not None:
        done = torch.cuda.Event()
        done.record(stream)
        done.synchronize()  # releases the GIL to the wire's threads, as a Python spin would not
    t_copied = time.perf_counter()
    await_completion(wire, wr)
    t_done = time.perf_counter()
    return t_post - t0, t_copied - t0, t_done - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--wire", default="cuda", choices=["cuda", "tcp"])
    ap.add_argument("--src-device", default="0")
    ap.add_argument("--dst-device", default="0")
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--profile", action="store_true", help="cProfile one-layer posts instead")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()

    def dev(name: str) -> str:  # the tcp wire's regions are host memory
        return str(resolve_device(name)) if args.wire == "cuda" else "cpu"

    if args.profile:
        text = profile_posts(
            args.wire, dev(args.src_device), dev(args.dst_device), args.tokens, 200
        )
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "wire_profile.txt").write_text(text)
        print(text)
        return
    r = measure(args.wire, dev(args.src_device), dev(args.dst_device), args.tokens, args.repeats)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "wire_latency.json").write_text(json.dumps(r, indent=2))
    lines = [
        f"# wire_latency {time.strftime('%Y-%m-%d %H:%M')}: {r['wire']} wire, "
        f"{args.src_device} -> {args.dst_device}, medians of {args.repeats}",
        "",
        "| post | in post() ms | copies done ms | completed ms |",
        "| --- | --- | --- | --- |",
    ]
    for name, v in r.items():
        if isinstance(v, dict):
            lines.append(
                f"| {name} | {v['post_ms']:.3f} | {v['copied_ms']:.3f} | {v['completed_ms']:.3f} |"
            )
    lines.append(
        f"\nimmediates seen by the receiver: {r['immediates_seen']} of {r['immediates_posted']}"
    )
    (args.out / "wire_latency.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()

"""Where the time of one post over a wire goes, from `post()` to its completion.

    python benchmarks/wire_latency.py --wire cuda --src-device 0 --dst-device 0 --out DIR
    python benchmarks/wire_latency.py --wire tcp --out DIR          # any machine

On one H200 a 4k-token request's pages (32 layers, one allocation on both sides) copy in
0.26 ms, yet the post completes about 1.7 ms after it starts (gpu_bench's end-to-end column):
that fixed cost is most of whole-request TTFT's "end to ready" at 2k tokens. This times, for
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
import cProfile
import io
import json
import pstats
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np

from disagg.hw.transport import make_transport
from disagg.hw.transport.base import Unit, WriteArray
from disagg.hw.transport.peer import ReceiverProcess
from disagg.models import LLAMA_31_8B


def _buffers(wire: str, layers: int, size: int, device: str) -> list[Any]:
    if wire != "cuda":
        return [bytearray(size) for _ in range(layers)]
    import torch

    return list(torch.ones((layers, size), dtype=torch.uint8, device=device))


def _units(layers: int, page: int, pages: int) -> list[Unit]:
    off = np.arange(pages, dtype=np.int64) * page
    sizes = np.full(pages, page, dtype=np.int64)
    return [Unit(WriteArray(f"s{i}", f"r{i}", off, off, sizes), imm=i) for i in range(layers)]


def measure(
    wire_name: str, src_dev: str, dst_dev: str, tokens: int, repeats: int
) -> dict[str, Any]:
    spec = LLAMA_31_8B
    page = 16 * spec.kv_bytes_per_token_per_layer()
    pages, layers = tokens // 16, spec.layers
    size = 2 * pages * page
    recv = ReceiverProcess(wire_name, [size] * layers, dst_dev, "decode", stacked=True)
    wire = make_transport(wire_name, endpoint="prefill")
    out: dict[str, Any] = {"wire": wire_name, "tokens": tokens, "bytes": layers * pages * page}
    try:
        for i, b in enumerate(_buffers(wire_name, layers, size, src_dev)):
            wire.register(f"s{i}", b)
        wire.connect("decode", recv.info, recv.descs)
        posts = {"one 64-byte unit": [Unit(WriteArray("s0", "r0", [0], [0], [64]), imm=0)]}
        whole = _units(layers, page, pages)
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
    finally:
        wire.close()
        recv.close()
    return out


def profile_posts(wire_name: str, src_dev: str, dst_dev: str, tokens: int, n: int) -> str:
    """cProfile of `n` one-layer posts (each awaited), the top functions by own time."""
    spec = LLAMA_31_8B
    page, pages = 16 * spec.kv_bytes_per_token_per_layer(), tokens // 16
    size = 2 * pages * page
    recv = ReceiverProcess(wire_name, [size] * 2, dst_dev, "decode", stacked=True)
    wire = make_transport(wire_name, endpoint="prefill")
    try:
        for i, b in enumerate(_buffers(wire_name, 2, size, src_dev)):
            wire.register(f"s{i}", b)
        wire.connect("decode", recv.info, recv.descs)
        unit = _units(1, page, pages)
        for wr in range(10):
            _one(wire, unit, wr)
        prof = cProfile.Profile()
        for wr in range(10, 10 + n):
            prof.enable()
            wire.post("decode", unit, wr)
            prof.disable()
            while not any(c.wr_id == wr for c in wire.poll().completions):
                time.sleep(1e-5)
    finally:
        wire.close()
        recv.close()
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(25)
    return text.getvalue()


def _one(wire: Any, units: list[Unit], wr: int) -> tuple[float, float, float]:
    """(post, copied, completed) seconds of one post, all from the start of `post`."""
    stream = getattr(wire, "stream", None)
    t0 = time.perf_counter()
    wire.post("decode", units, wr)
    t_post = time.perf_counter()
    if stream is not None:
        import torch

        done = torch.cuda.Event()
        done.record(stream)
        while not done.query():
            pass
    t_copied = time.perf_counter()
    while not any(c.wr_id == wr for c in wire.poll().completions):
        time.sleep(1e-5)
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
    dev = (lambda d: f"cuda:{d}" if d.isdigit() else d) if args.wire == "cuda" else str
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

"""Draw docs/img/trace.png from a trace.json: its tracks as a Perfetto-like timeline.

    python docs/make_trace_figure.py                       # the committed hw run, 0.8-2.0 s
    python docs/make_trace_figure.py TRACE.json OUT.png --from-s 0 --to-s 1 --request-lanes 8

Drawn by our code from the JSON events alone (X slices, M names, s/t/f flows), not a
Perfetto screenshot: this machine has no network for ui.perfetto.dev (docs/trace.md).
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path
from typing import Any

import matplotlib.pyplot as plt
from matplotlib.artist import Artist
from matplotlib.lines import Line2D
from matplotlib.patches import Rectangle

from disagg.trace import write_trace

ROOT = Path(__file__).parent.parent
RUN = ROOT / "tests" / "data" / "hw-runs" / "gpu_tpot_2026-11-29d" / "disagg-6rps"
COLORS = {
    "prefill": "#4C72B0",
    "decode": "#55A868",
    "mixed": "#8172B3",
    "queued": "#CCCCCC",
    "transfer": "#DD8452",
    "to first token": "#E5C494",
}


def color(name: str) -> str:
    if name.startswith("req ") and " to " in name:
        return COLORS["transfer"]
    if name.startswith("req "):
        return "#F2F2F2"
    return COLORS.get(name.split(" x")[0], "#999999")


def rows(trace: dict[str, Any], request_lanes: int) -> list[tuple[int, int, str]]:
    """(pid, tid, label) of each track to draw, in the trace's sort order."""
    procs = {
        e["pid"]: e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "process_name"
    }
    out = []
    for e in trace["traceEvents"]:
        if e["name"] != "thread_name":
            continue
        proc, lane = procs[e["pid"]], e["tid"] % 1000
        if proc == "requests" and lane >= request_lanes:
            continue
        thread = e["args"]["name"]
        out.append((e["pid"], e["tid"], thread if thread.startswith(proc) else f"{proc}: {thread}"))
    return sorted(out)


def draw(trace: dict[str, Any], out: Path, t0_s: float, t1_s: float, request_lanes: int) -> None:
    tracks = rows(trace, request_lanes)
    y = {(pid, tid): i for i, (pid, tid, _) in enumerate(tracks)}
    fig, ax = plt.subplots(figsize=(13, 0.42 * len(tracks) + 1.6))
    t0, t1 = t0_s * 1e6, t1_s * 1e6
    for e in trace["traceEvents"]:
        key = (e.get("pid"), e.get("tid"))
        if e["ph"] != "X" or key not in y or e["ts"] > t1 or e["ts"] + e["dur"] < t0:
            continue
        parent = e["name"].startswith("req ") and " to " not in e["name"]
        ax.barh(
            y[key],
            e["dur"] / 1e3,
            left=(e["ts"] - t0) / 1e3,
            height=0.8 if parent else 0.6,
            color=color(e["name"]),
            edgecolor="#333333" if parent else "white",
            linewidth=0.4,
        )
    flows: dict[int, list[tuple[float, int]]] = {}
    for e in trace["traceEvents"]:
        if e["ph"] in "stf" and (e["pid"], e["tid"]) in y:
            flows.setdefault(e["id"], []).append(((e["ts"] - t0) / 1e3, y[(e["pid"], e["tid"])]))
    for points in flows.values():  # the flows of requests that arrive in the window
        xs, ys = zip(*points, strict=True)
        if 0 <= xs[0] <= (t1 - t0) / 1e3:
            ax.plot(xs, ys, color="#C44E52", linewidth=0.9, marker="o", markersize=2.5)
    ax.set_yticks(range(len(tracks)), [label for _, _, label in tracks])
    ax.invert_yaxis()
    ax.set_xlim(0, (t1 - t0) / 1e3)
    ax.set_xlabel(f"ms after {t0_s:g} s")
    handles: list[Artist] = [Rectangle((0, 0), 1, 1, color=c) for c in COLORS.values()]
    handles.append(Line2D([0], [0], color="#C44E52", marker="."))
    top = 1.0 + 1.2 / (0.42 * len(tracks) + 1.6)
    ax.legend(
        handles,
        [*COLORS, "request flow"],
        loc="upper center",
        ncol=7,
        bbox_to_anchor=(0.5, top),
        frameon=False,
    )
    name = trace["otherData"]["experiment"]
    ax.set_title(f"{name}: drawn from trace.json by docs/make_trace_figure.py", pad=28)
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("trace", nargs="?", type=Path, help="trace.json (default: the hw run's)")
    p.add_argument("out", nargs="?", type=Path, default=ROOT / "docs" / "img" / "trace.png")
    p.add_argument("--from-s", type=float, default=0.8)
    p.add_argument("--to-s", type=float, default=2.0)
    p.add_argument("--request-lanes", type=int, default=10)
    a = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = a.trace or write_trace(RUN, Path(tmp) / "trace.json")
        trace = json.loads(path.read_text())
    a.out.parent.mkdir(parents=True, exist_ok=True)
    draw(trace, a.out, a.from_s, a.to_s, a.request_lanes)
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()

"""A run directory as a Chrome trace-event file (`trace.json`), which Perfetto and
chrome://tracing open; built only from the run's tables, so sim and hw runs draw alike.

Tracks (docs/trace.md shows them):
- one process per node (`prefill0`, `decode1`, `colocated0`): its passes as complete slices
  named by `kind` (a row of `steps` > 1 coalesced decode passes is one slice `decode x N`),
  counts per pass in args;
- one process per prefill node for its transfers, a track per NIC where the experiment fixes
  which NIC a transfer leaves through (see `link_label`), otherwise one track for the node's
  NICs as a group, or per (prefill, decode) link when a hw run moved KV without a NIC;
- a `requests` process: each request one slice from arrival to finish, with its phases nested
  (queued, prefill, transfer, to first token, decode), and a flow from its arrival through the
  prefill pass that started it, its transfer, the passes of its first and last tokens, to its
  finish.

Slices that overlap on one track are spread over lanes (extra threads of the process). Times
are microseconds since the run's start. At most `max_requests` requests are drawn: every k-th
by id, k = ceil(requests / max_requests); passes and transfers are all drawn.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from disagg.core.metrics import read_results
from disagg.errors import ConfigError
from disagg.trace_events import Passes, Slice, Tracks, lanes

TRACE_FILE = "trace.json"
MAX_REQUESTS = 2000
ROLES = ("prefill", "decode", "colocated")
NO_NIC_WIRES = ("cuda", "tcp")  # hw wires that move KV without an RDMA NIC
PHASES = ("queued", "prefill", "transfer", "to first token", "decode")


def _node_key(name: str) -> tuple[int, int, str]:
    role = name.rstrip("0123456789")
    idx = name[len(role) :]
    return (ROLES.index(role) if role in ROLES else len(ROLES), int(idx or 0), name)


def link_label(exp: dict[str, Any], summary: dict[str, Any], decode_node: int) -> str:
    """The track a transfer from a prefill node to `decode_node` goes on: a hw run on a wire
    without a NIC gets its link (`to decode1 (cuda)`); a hw verbs run one NIC per node, the one
    nearest its GPU (`rdma nic`); a simulated run the NICs nearest the prefill pool's GPUs (the
    simulator's `nic_of_gpu` rule): `nic3` when they are one NIC, else the group `nics 0-7`,
    since which of them a transfer used is drawn by the simulator and not in the tables."""
    wire = summary.get("wire")
    if summary.get("backend") == "hw":
        return f"to decode{decode_node} ({wire})" if wire in NO_NIC_WIRES else "rdma nic"
    hardware, pool = exp.get("hardware", {}), exp.get("cluster", {}).get("prefill", {})
    try:
        gpus, nics = int(hardware["gpus_per_node"]), int(hardware["nics_per_node"])
        used = int(pool["tp"]) * int(pool["dp"])
    except (KeyError, TypeError, ValueError):
        return "nics"
    ids = sorted({g * nics // gpus for g in range(min(used, gpus))})
    if len(ids) == 1:
        return f"nic{ids[0]}"
    return f"nics {ids[0]}-{ids[-1]}" if ids == list(range(ids[0], ids[-1] + 1)) else "nics"


def draw_passes(tracks: Tracks, steps: pd.DataFrame) -> dict[str, Passes]:
    """A process per node with its passes; returns each node's passes by name."""
    out: dict[str, Passes] = {}
    for node in sorted(steps.node.unique(), key=_node_key):
        df = steps[steps.node == node].sort_values("start_s", kind="stable")
        pid = tracks.pid(str(node))
        starts, ends = df.start_s.to_numpy(float), (df.start_s + df.duration_s).to_numpy(float)
        tids = [tracks.tid(pid, "passes", lane) for lane in lanes(starts, ends)]
        labels = [k if n == 1 else f"{k} x{n}" for k, n in zip(df.kind, df.steps, strict=True)]
        args = {c: df[c] for c in ("steps", "batch_size", "decode_seqs", "tokens")}
        args["prefill_tokens"] = df.prefill_tokens
        args["pass_ms"] = (df.duration_s / df.steps * 1e3).to_numpy(float)
        device = df.device_s.to_numpy(float) if "device_s" in df else np.full(len(df), math.nan)
        args["device_ms"] = device * 1e3
        for shape in ("prefill_attn_pairs", "decode_context"):  # null in a table before them
            args[shape] = df[shape].to_numpy(float) if shape in df else np.full(len(df), math.nan)
        slices = tracks.slices(pid, tids, labels, starts, ends, args)
        out[str(node)] = Passes(slices, starts, ends)
    return out


def draw_transfers(
    tracks: Tracks, transfers: pd.DataFrame, exp: dict[str, Any], summary: dict[str, Any]
) -> dict[int, Slice]:
    """A process per prefill node with its transfers on the tracks `link_label` names;
    returns each request's transfer slice. A transfer that never landed is drawn at its start,
    with `landed` false."""
    out: dict[int, Slice] = {}
    posted = np.isfinite(transfers.start_s.to_numpy(float))  # a transfer never posted: none
    df = transfers[posted].sort_values("start_s", kind="stable")
    label_of = {int(d): link_label(exp, summary, int(d)) for d in df.decode_node.unique()}
    for p in sorted(df.prefill_node.unique()):
        rows = df[df.prefill_node == p]
        pid = tracks.pid(f"prefill{p} transfers")
        labels = [label_of[int(d)] for d in rows.decode_node]
        starts = rows.start_s.to_numpy(float)
        ends = rows.end_s.to_numpy(float)
        ends = np.where(np.isfinite(ends), ends, starts)
        tids = [0] * len(rows)
        for label in dict.fromkeys(labels):
            idx = [i for i, x in enumerate(labels) if x == label]
            for i, lane in zip(idx, lanes(starts[idx], ends[idx]), strict=True):
                tids[i] = tracks.tid(pid, label, lane)
        dur_s = ends - starts
        with np.errstate(divide="ignore", invalid="ignore"):
            gbps = np.where(dur_s > 0, rows.bytes.to_numpy(float) * 8 / dur_s / 1e9, math.nan)
        names = [
            f"req {r} to decode{d}" for r, d in zip(rows.request_id, rows.decode_node, strict=True)
        ]
        args = {c: rows[c] for c in ("request_id", "decode_node", "bytes", "ops")}
        args |= {"landed": np.isfinite(rows.end_s.to_numpy(float)), "gbps": gbps}
        slices = tracks.slices(pid, tids, names, starts, ends, args)
        out |= dict(zip(rows.request_id.tolist(), slices, strict=True))
    return out


def sample(requests: pd.DataFrame, max_requests: int) -> tuple[pd.DataFrame, int]:
    """Every k-th request by id, k = ceil(len / max_requests) (all when they fit); returns
    (the drawn rows, k)."""
    if max_requests == 0 or requests.empty:
        return requests.iloc[:0], 0
    k = max(1, math.ceil(len(requests) / max_requests))
    return requests.sort_values("request_id", kind="stable").iloc[::k], k


def _phases(r: Any) -> list[tuple[str, float, float]]:
    """A request's phases (name, start_s, end_s) that it reached, each after the one before."""
    to_first = r.ready_s if math.isfinite(r.ready_s) else r.prefill_end_s
    bounds = [
        ("queued", r.arrival_s, r.prefill_start_s),
        ("prefill", r.prefill_start_s, r.prefill_end_s),
        ("transfer", r.prefill_end_s, r.ready_s),
        ("to first token", to_first, r.first_token_s),
        ("decode", r.first_token_s, r.finish_s),
    ]
    out, last = [], r.arrival_s
    for name, a, b in bounds:
        if math.isfinite(a) and math.isfinite(b) and b > max(a, last):
            out.append((name, max(a, last), b))
            last = b
    return out


def _request_args(r: Any) -> dict[str, Any]:
    reason = r.fail_reason if isinstance(r.fail_reason, str) and r.fail_reason else None
    return {
        "request_id": r.request_id,
        "status": r.status,
        "prompt_tokens": r.prompt_tokens,
        "output_tokens": r.output_tokens,
        "prefill_node": r.prefill_node,
        "decode_node": r.decode_node,
        "ttft_ms": r.ttft_s * 1e3,
        "tpot_ms": r.tpot_s * 1e3,
        "attempts": r.attempts,
        "fail_reason": reason,
    }


def _flow(
    req: Slice, r: Any, prefill: Passes | None, decode: Passes | None, xfer: Slice | None
) -> list[tuple[Slice, float]]:
    """The points of a request's flow: its arrival, the pass its prefill started in, its
    transfer, the passes of its first and last tokens, its finish (those found)."""
    hops = [
        prefill.starting(r.prefill_start_s) if prefill else None,
        xfer,
        decode.ending(r.first_token_s) if decode else None,
        decode.ending(r.finish_s) if decode else None,
    ]
    points, at = [(req, req.start_us)], req.start_us
    for s in dict.fromkeys(h for h in hops if h is not None):
        at = s.point(at)
        points.append((s, at))
    return [*points, (req, req.point(math.inf))]


def draw_requests(
    tracks: Tracks,
    requests: pd.DataFrame,
    passes: dict[str, Passes],
    transfers: dict[int, Slice],
    colocated: bool,
) -> None:
    """The `requests` process: a slice per request over its phases, and its flow."""
    pid = tracks.pid("requests")
    rows: list[Any] = list(requests.sort_values("arrival_s", kind="stable").itertuples(index=False))
    phases = [_phases(r) for r in rows]
    ends = [max([r.arrival_s] + [b for _, _, b in ph]) for r, ph in zip(rows, phases, strict=True)]
    pnode, dnode = ("colocated", "colocated") if colocated else ("prefill", "decode")
    spans = zip(rows, phases, ends, lanes([r.arrival_s for r in rows], ends), strict=True)
    for r, ph, end_s, lane in spans:
        tid = tracks.tid(pid, "requests", lane)
        req = tracks.slice(pid, tid, f"req {r.request_id}", r.arrival_s, end_s, **_request_args(r))
        for name, a, b in ph:
            tracks.slice(pid, tid, name, a, b)
        prefill = passes.get(f"{pnode}{r.prefill_node}")
        decode = passes.get(f"{dnode}{r.decode_node}")
        points = _flow(req, r, prefill, decode, transfers.get(int(r.request_id)))
        tracks.flow(int(r.request_id), points)


def build_trace(run_dir: Path, max_requests: int = MAX_REQUESTS) -> dict[str, Any]:
    """The trace of a run directory, as the JSON object to write (see the module docstring)."""
    if max_requests < 0:
        raise ConfigError(f"max_requests {max_requests}: must be 0 or more")
    requests, steps, transfers, summary = read_results(run_dir)
    exp_file = run_dir / "experiment.json"
    exp = json.loads(exp_file.read_text()) if exp_file.exists() else {}
    colocated = exp.get("cluster", {}).get("mode") == "colocated" or any(
        str(n).startswith("colocated") for n in steps.node.unique()
    )
    tracks = Tracks()
    passes = draw_passes(tracks, steps)
    xfers = draw_transfers(tracks, transfers, exp, summary)
    drawn, k = sample(requests, max_requests)
    draw_requests(tracks, drawn, passes, xfers, colocated)
    other = {
        "experiment": summary.get("experiment", run_dir.name),
        "backend": summary.get("backend", "sim"),
        "requests": len(requests),
        "requests_drawn": len(drawn),
        "request_stride": k,
    }
    return {"traceEvents": tracks.events, "displayTimeUnit": "ms", "otherData": other}


def write_trace(run_dir: Path, out: Path | None = None, max_requests: int = MAX_REQUESTS) -> Path:
    """Write the trace of `run_dir` to `out` (default RUN_DIR/trace.json); returns the path."""
    trace = build_trace(run_dir, max_requests)
    path = out or run_dir / TRACE_FILE
    path.write_text(json.dumps(trace, separators=(",", ":"), allow_nan=False))  # C encoder
    return path

"""A hw run's passes against the cost model, for `disagg validate`: the run's passes and its
replay's side by side by size, decode passes beside another node's chunk pass apart
(`pass_table`, `pass_report`, `beside_chunk`), each pass at its own shape by the
profile (`shape_device`), what passes with a prompt chunk take beyond it (`pass_offsets`;
`chunk_offsets` for steps tables from before the shape columns), each pass's loop time
(`loop_s`), and how long a control message takes between passes (`idle_hops`). No torch.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
import pandas as pd

from disagg.config import Experiment
from disagg.share import free_decodes
from disagg.sim.costmodel import (
    CostModel,
    ProfileCost,
    StepShape,
    make_cost_model,
    padded_chunk,
)

SHAPE_COLUMNS = ("prefill_attn_pairs", "decode_context")  # a steps row's pass, as costed
PASS_BINS = 4  # ranges of chunk tokens (and of decode batch) that passes are compared over
BUSY_GAP_S = 2e-3  # a longer gap between two passes of a node is its loop waiting for work
# ranges of the time since a node's last pass with a prompt chunk (s) over which its decode
# passes' device time is compared with the profile's (`after_chunk`); from the last one on,
# a decode pass runs as profiled
AFTER_CHUNK_EDGES_S = (0.0, 0.01, 0.02, 0.03, 0.04, 0.06, 0.08, 0.12, 0.2)
MIN_AFTER_PASSES = 20  # decode passes a range needs, and the passes after the last
PASS_COLUMNS = [
    *("kind", "size", "hw_n", "sim_n"),
    *("hw_device_s", "sim_device_s", "hw_loop_s", "sim_loop_s", "shape_device_s"),
    "hw_before_s",
]
SENDS = ("sent", "handed_off")  # the hops table's events that send a request on


def _ranges(values: pd.Series, bins: int) -> list[tuple[float, float, bool]]:
    """`bins` ranges of `values` between its quantiles, as (low, high, last): a range holds
    its low end, and the last one its high end too (one range if all values are equal)."""
    edges = np.unique(np.quantile(values, np.linspace(0, 1, bins + 1)))
    if len(edges) == 1:
        return [(float(edges[0]), float(edges[0]), True)]
    pairs = list(itertools.pairwise(edges))
    return [(float(lo), float(hi), k == len(pairs) - 1) for k, (lo, hi) in enumerate(pairs)]


def _within(values: pd.Series, lo: float, hi: float, last: bool) -> pd.Series:
    """Which `values` lie in a range of `_ranges`."""
    return (values >= lo) & ((values <= hi) if last else (values < hi))


def pass_gaps(steps: pd.DataFrame) -> pd.Series:
    """Per node, the time from each pass's end to the next pass's start (s), on the index of
    the pass it follows (a node's last pass has none)."""
    gaps = []
    for _, passes in steps.sort_values("start_s").groupby("node", sort=True):
        ends = passes.start_s + passes.duration_s
        gaps.append(passes.start_s.shift(-1) - ends)
    return pd.concat(gaps).dropna() if gaps else pd.Series(dtype=float)


def loop_s(steps: pd.DataFrame, waited: float = 0.0) -> pd.Series:
    """Per row of `steps`, its loop time: wall less device time, plus the gap until its
    node's next pass where that is at most BUSY_GAP_S; `waited` instead where the loop waited
    for work, or the row is its node's last (NaN: no loop time for it)."""
    gaps = pass_gaps(steps).reindex(steps.index)
    busy = gaps.where(gaps <= BUSY_GAP_S, waited).fillna(waited)
    return steps.duration_s - steps.device_s + busy


def idle_hops(hops: pd.DataFrame, steps: pd.DataFrame) -> np.ndarray:
    """A hw run's control-plane hops (s) that met no pass: for each request a server took
    (`hops`' "received"), the time since the message was sent (the driver's "sent", or a
    decoder's "handed_off" to its prefill node), where the server ran no pass meanwhile (one
    that did took it once the pass had ended, as the simulator's servers do too)."""
    hops = hops.sort_values(["request_id", "t_s"], kind="stable")
    sent = hops.t_s.where(hops.event.isin(SENDS)).groupby(hops.request_id).ffill()
    taken = hops[(hops.event == "received") & sent.notna()]
    out = [np.empty(0)]
    for node, rows in taken.groupby("node"):
        mine = steps[steps.node == node]
        a, b = sent[rows.index].to_numpy(), rows.t_s.to_numpy()
        met = _met(mine.start_s.to_numpy(float), mine.duration_s.to_numpy(float), a, b)
        out.append((b - a)[~met])
    return np.concatenate(out)


def _met(starts: np.ndarray, durations: np.ndarray, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Per interval [a, b), whether one node's passes (`starts`, `durations`; they do not
    overlap) ran during it: the last to start before b ends after a."""
    order = np.argsort(starts, kind="stable")
    starts, ends = starts[order], starts[order] + durations[order]
    last = np.searchsorted(starts, b) - 1
    return (last >= 0) & (ends[np.maximum(last, 0)] > a)


def beside_chunk(steps: pd.DataFrame) -> pd.Series:
    """Per row of `steps` (one run's), whether it is a decode-only pass that overlapped a pass
    with a prompt chunk of another node (on one shared GPU, the passes a chunk slows)."""
    out = np.zeros(len(steps), bool)
    start, took = steps.start_s.to_numpy(float), steps.duration_s.to_numpy(float)
    chunk, nodes = steps.prefill_tokens.to_numpy() > 0, steps.node.to_numpy()
    decode = np.flatnonzero(~chunk)
    a, b = start[decode], start[decode] + took[decode]
    for node in np.unique(nodes[chunk]):
        mine = chunk & (nodes == node)
        out[decode[_met(start[mine], took[mine], a, b) & (nodes[decode] != node)]] = True
    return pd.Series(out, index=steps.index)


def pass_table(hw: pd.DataFrame, sim: pd.DataFrame, bins: int = PASS_BINS) -> pd.DataFrame:
    """A run's passes against its replay's, where they have device times: those with a prompt
    chunk (kind "chunk") in `bins` ranges of chunk tokens and the decode-only ones in ranges
    of batch size (the run's quantiles), those beside another node's chunk pass
    (`beside_chunk`: "decode beside chunk") apart from the others ("decode"); per range the
    run's median size, each
    side's passes and their median device and loop seconds per pass (`loop_s`, unless a
    table has that column: one of several runs' passes must, its nodes' clocks not one)
    (a steps row of several passes counts as that many), and the medians of the run's
    `shape_device_s` (`shape_device`) and `host_before_s` (NaN where `hw` has none). Columns
    PASS_COLUMNS; no rows without device times (the CPU)."""
    rows = []
    hw, sim = (t if "loop_s" in t else t.assign(loop_s=loop_s(t)) for t in (hw, sim))
    hw, sim = (t.assign(kind=_pass_kind(t)) for t in (hw, sim))
    for kind in PASS_KINDS:
        size = "prefill_tokens" if kind == "chunk" else "batch_size"
        h, r = (t[(t.kind == kind) & t.device_s.notna()] for t in (hw, sim))
        if h.empty or r.empty:
            continue
        for lo, hi, last in _ranges(h[size], bins):
            a, b = (t[_within(t[size], lo, hi, last)] for t in (h, r))
            if a.empty or b.empty:
                continue
            (ad, al, an), (bd, bl, bn) = _per_pass(a), _per_pass(b)
            shaped = a.shape_device_s.median() if "shape_device_s" in a else math.nan
            before = a.host_before_s.median() if "host_before_s" in a else math.nan
            rows.append(
                (
                    kind,
                    float(np.median(np.repeat(a[size].to_numpy(float), _steps(a)))),
                    an,
                    bn,
                    ad,
                    bd,
                    al,
                    bl,
                    float(shaped),
                    float(before),
                )
            )
    return pd.DataFrame(rows, columns=PASS_COLUMNS)


PASS_KINDS = ("chunk", "decode", "decode beside chunk")


def _pass_kind(steps: pd.DataFrame) -> pd.Series:
    """Per row of `steps`, its kind in `pass_table`."""
    beside = np.where(beside_chunk(steps).to_numpy(), "decode beside chunk", "decode")
    return pd.Series(np.where(steps.prefill_tokens > 0, "chunk", beside), index=steps.index)


def shape_device(steps: pd.DataFrame, exp: Experiment) -> pd.Series:
    """Per row of `steps`, the device time that `exp`'s cost model gives a pass of the row's
    shape on the row's node alone (its group's and role's model: a prefill, decode or
    colocated node): what the run's passes would have taken by the profile, whatever the
    replay's passes were. NaN for a row of several passes or without a shape (a table from
    before the shape columns)."""
    groups = {"colocated": exp.cluster.colocated, "prefill": exp.cluster.prefill}
    groups["decode"] = exp.cluster.decode
    costs: dict[str, CostModel] = {}
    out = np.full(len(steps), math.nan)
    if not all(c in steps for c in SHAPE_COLUMNS):
        return pd.Series(out, index=steps.index)
    rows = zip(
        *(steps[c].to_numpy() for c in ("node", "steps", "prefill_tokens", "decode_seqs")),
        *(steps[c].to_numpy(float) for c in SHAPE_COLUMNS),
        strict=True,
    )
    for i, (node, passes, n, d, pairs, context) in enumerate(rows):
        if passes != 1 or math.isnan(pairs) or math.isnan(context):
            continue
        role = str(node).rstrip("0123456789")
        if role not in costs:
            costs[role] = make_cost_model(exp, groups[role], role)
        cost = costs[role]
        out[i] = cost.step_time(StepShape(int(n), pairs, int(d), context)) - cost.host_s(n > 0, d)
    return pd.Series(out, index=steps.index)


def costed_chunks(steps: pd.DataFrame, exp: Experiment) -> pd.Series:
    """Per row of `steps` (passes with a prompt chunk), the tokens its chunk is costed at
    (`disagg.sim.costmodel.padded_chunk`): with hw.latency.prefill_graphs, what its piece
    holds besides the pass's decodes."""
    qo, pieces = 1 + exp.spec.draft_tokens, exp.hw.latency.prefill_graphs
    padded = [
        padded_chunk(pieces, int(n), int(d) * qo)
        for n, d in zip(steps.prefill_tokens, steps.decode_seqs, strict=True)
    ]
    return pd.Series(padded, index=steps.index, dtype=float)


def _steps(rows: pd.DataFrame) -> np.ndarray:
    """Passes per steps row (a simulated run of identical decode passes is one row)."""
    return rows.steps.to_numpy(int) if "steps" in rows else np.ones(len(rows), int)


def _per_pass(rows: pd.DataFrame) -> tuple[float, float, int]:
    """(median device s, median loop s, passes) over the passes of steps rows (`loop_s`
    in a column of its own)."""
    n = _steps(rows)
    device = rows.device_s.to_numpy(float) / n
    loop = rows.loop_s.to_numpy(float) / n
    return (
        float(np.median(np.repeat(device, n))),
        float(np.median(np.repeat(loop, n))),
        int(n.sum()),
    )


def chunk_offsets(hw: pd.DataFrame, sim: pd.DataFrame) -> list[list[float]]:
    """`[cost] profile_chunk_offsets` from serving runs' steps (`hw`, concatenated) and their
    replays' on the profile (`sim`): per range of chunk tokens of `pass_table`, its median
    tokens and the runs' median device time less the replays'. [] without device times (the
    CPU). For runs whose steps tables predate the passes' shapes (`pass_offsets`)."""
    t = pass_table(hw.assign(loop_s=math.nan), sim.assign(loop_s=math.nan))  # device alone
    t = t[t.kind == "chunk"]
    return [[n, h - r] for n, h, r in zip(t["size"], t.hw_device_s, t.sim_device_s, strict=True)]


def has_shapes(steps: pd.DataFrame) -> bool:
    """Whether every pass of `steps` with a prompt chunk says its shape (tables written before
    the shape columns do not)."""
    if not all(c in steps for c in SHAPE_COLUMNS):
        return False
    chunks = steps[steps.prefill_tokens > 0]
    return bool(chunks[list(SHAPE_COLUMNS)].notna().all(axis=None))


def pass_offsets(steps: pd.DataFrame, exp: Experiment) -> list[list[float]]:
    """`[cost] profile_chunk_offsets` from serving runs' steps (concatenated; `has_shapes`),
    pass by pass: each pass with a prompt chunk and a device time, less what `exp` (its cost
    without chunk offsets) gives a pass of its shape (`shape_device`); per range of chunk
    tokens of `pass_table`, its median tokens and the passes' median difference. [] without
    device times (the CPU)."""
    chunks = steps[(steps.prefill_tokens > 0) & steps.device_s.notna()]
    if chunks.empty:
        return []
    tokens = costed_chunks(chunks, exp)
    beyond = chunks.device_s - shape_device(chunks, exp)
    out = []
    for lo, hi, last in _ranges(tokens, PASS_BINS):
        pick = _within(tokens, lo, hi, last)
        out.append([float(tokens[pick].median()), float(beyond[pick].median())])
    return out


def since_chunk(steps: pd.DataFrame) -> pd.Series:
    """Per row of `steps` (one run's), the time from the end of its node's last earlier pass
    with a prompt chunk to its start (s; inf where the node has run none yet)."""
    out = pd.Series(math.inf, index=steps.index)
    for _, passes in steps.sort_values("start_s").groupby("node", sort=False):
        ends = (passes.start_s + passes.duration_s).where(passes.prefill_tokens > 0)
        last = ends.ffill().shift(1)
        out[passes.index] = (passes.start_s - last).fillna(math.inf)
    return out


def decode_ratios(runs: Sequence[pd.DataFrame], exp: Experiment) -> pd.DataFrame:
    """The decode-only passes of colocated serving runs' steps (each run's own table) with
    device times and shapes: each with `since` (`since_chunk`) and `ratio`, its device time
    over what `exp` gives a pass of its shape (`shape_device`). No rows without device times
    (the CPU)."""
    timed = []
    for steps in runs:
        if "device_s" not in steps or not has_shapes(steps):
            continue
        rows = steps.assign(since=since_chunk(steps))  # from every pass, chunk passes too
        pick = (rows.prefill_tokens == 0) & rows.device_s.notna()
        rows = rows[pick & rows.node.str.startswith("colocated")]
        rows = rows.assign(shaped=shape_device(rows, exp)).dropna(subset=["shaped"])
        timed.append(rows.assign(ratio=rows.device_s / rows.shaped))
    if not timed:
        return pd.DataFrame({"batch_size": [], "since": [], "ratio": []})
    return pd.concat(timed, ignore_index=True)


def graph_ranges(graphs: Sequence[int]) -> list[tuple[int, int]]:
    """The ranges of batch sizes (low, high] that `graph_scales` fits over: each CUDA graph's
    batches above the graph before it, in quarters where they are more than four."""
    out = []
    for low, high in itertools.pairwise([0, *graphs]):
        cuts = [low + (high - low) * k // 4 for k in range(5)] if high - low > 4 else [low, high]
        out += list(itertools.pairwise(cuts))
    return out


def graph_scales(runs: Sequence[pd.DataFrame], exp: Experiment) -> list[list[float]]:
    """`[cost] profile_graph_scales` from colocated serving runs' steps: over the decode-only
    passes that began AFTER_CHUNK_EDGES_S[-1] or more after a chunk pass (`decode_ratios`),
    per range of batch sizes of a CUDA graph (`graph_ranges`), the passes' median batch and
    median `ratio`; a range with fewer than MIN_AFTER_PASSES passes is left out, and []
    without device times (the CPU) or graphs. `exp`: the profile without graph scales."""
    cost = make_cost_model(exp, exp.cluster.colocated, "colocated")
    rows = decode_ratios(runs, exp)
    far = rows[rows.since >= AFTER_CHUNK_EDGES_S[-1]]
    if far.empty or not isinstance(cost, ProfileCost):
        return []
    return by_graph_range(far, "batch_size", cost.graph_batches)


def by_graph_range(rows: pd.DataFrame, batch: str, graphs: Sequence[int]) -> list[list[float]]:
    """Per range of `graph_ranges(graphs)` with MIN_AFTER_PASSES `rows` or more (passes, by
    their column `batch`): their median batch and median `ratio`."""
    out = []
    for low, high in graph_ranges(graphs):
        pick = rows[(rows[batch] > low) & (rows[batch] <= high)]
        if len(pick) >= MIN_AFTER_PASSES:
            out.append([float(pick[batch].median()), float(pick.ratio.median())])
    return out


def decode_graph_scales(runs: Sequence[pd.DataFrame], exp: Experiment) -> list[list[float]]:
    """`[cost] profile_decode_graph_scales` from disaggregated runs' steps whose servers shared
    one GPU: over their decode server's passes that met no prefill pass
    (`disagg.share.free_decodes`), per range of batch sizes of a CUDA graph (`graph_ranges`),
    the passes' median batch and the median of their device time over what `exp` gives a pass
    of their shape (`shape_device`); a range with fewer than MIN_AFTER_PASSES passes is left
    out, and [] without device times (the CPU) or graphs. `exp`: the profile with the decode
    scale, without graph scales."""
    cost = make_cost_model(exp, exp.cluster.decode, "decode")
    if not isinstance(cost, ProfileCost) or not cost.graph_batches:
        return []
    timed = [free_decodes(steps) for steps in runs if "device_s" in steps and has_shapes(steps)]
    if not timed:
        return []
    rows = pd.concat([t.assign(ratio=t.device_s / shape_device(t, exp)) for t in timed])
    return by_graph_range(rows.dropna(subset=["ratio"]), "decode_seqs", cost.graph_batches)


def after_chunk(runs: Sequence[pd.DataFrame], exp: Experiment) -> list[list[float]]:
    """`[cost] profile_after_chunk` from colocated serving runs' steps: the decode-only
    passes' `ratio` (`decode_ratios`) over its median for the passes that began
    AFTER_CHUNK_EDGES_S[-1] or more after their node's last pass with a prompt chunk; per
    range of that time, its median and the ratio's median less 1, and 0 at the last edge.
    [] without device times (the CPU) or with fewer than MIN_AFTER_PASSES passes after the
    last edge; a range with fewer is left out."""
    rows = decode_ratios(runs, exp)
    ratio, since = rows.ratio, rows.since
    fade = AFTER_CHUNK_EDGES_S[-1]
    if (since >= fade).sum() < MIN_AFTER_PASSES:
        return []
    far = float(ratio[since >= fade].median())
    out = []
    for lo, hi in itertools.pairwise(AFTER_CHUNK_EDGES_S):
        pick = (since >= lo) & (since < hi)
        if pick.sum() >= MIN_AFTER_PASSES:
            out.append([float(since[pick].median()), float(ratio[pick].median()) / far - 1])
    return [*out, [fade, 0.0]] if out else []


def pass_report(tables: Mapping[str, pd.DataFrame], out: Path) -> None:
    """out/passes.csv (PASS_COLUMNS with each run's label first) and out/passes.md (device
    time per pass, ms, hw and profile replay, by run and range)."""
    both = [t.assign(run=label) for label, t in tables.items() if not t.empty]
    table = (
        pd.concat(both)[["run", *PASS_COLUMNS]]
        if both
        else pd.DataFrame(columns=["run", *PASS_COLUMNS])
    )
    table.to_csv(out / "passes.csv", index=False)
    lines = [
        "# Passes: device time, hw against the profile replay",
        "",
        "Median device time of the passes in each range (ms); size: median chunk tokens (chunk)",
        "or batch (decode); loop: duration less device, plus the gap to the next pass while busy",
        "(ms). No rows: no device times.",
        "At its shape: the profile's device time for each of the run's passes at its own shape,",
        "alone on its node (the median; beside another node's pass on one GPU a pass takes",
        "longer), so shape/hw is the device model's error on the very passes the run ran;",
        "- for a run whose steps table has no shape columns. Loop hw (before): of it, the median",
        "time before the host began to launch the pass's forward (batch, plan, inputs).",
        "",
        "| run | kind | size | passes hw / sim | device hw | device sim | sim/hw | at its shape "
        "| shape/hw | loop hw (before) | loop sim |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in table.to_dict("records"):
        hw_s, sim_s = float(row["hw_device_s"]), float(row["sim_device_s"])
        shaped = float(row["shape_device_s"])
        at_shape = "- | -" if math.isnan(shaped) else f"{shaped * 1e3:.2f} | {shaped / hw_s:.3f}"
        ahead = float(row["hw_before_s"])
        before = "" if math.isnan(ahead) else f" ({ahead * 1e3:.2f})"
        lines.append(
            f"| {row['run']} | {row['kind']} | {float(row['size']):g} | "
            f"{row['hw_n']} / {row['sim_n']} | {hw_s * 1e3:.2f} | {sim_s * 1e3:.2f} | "
            f"{sim_s / hw_s:.3f} | {at_shape} | {float(row['hw_loop_s']) * 1e3:.2f}{before} | "
            f"{float(row['sim_loop_s']) * 1e3:.2f} |"
        )
    (out / "passes.md").write_text("\n".join(lines) + "\n")

"""How the passes of processes on one GPU share it, measured from a run's steps table: what
the simulator's shared GPU (disagg/sim/gpu.py) needs to give the passes the lengths they had,
under its weights rule: `cluster.decode_share` and `cluster.prefill_share` (the round robin's
`cluster.switch_s` is fitted by replays instead: disagg.validate.fit_switch).

A pass alone takes `alone(size)` seconds: by batch size for a decode pass (`decode_alone`,
each size's median), as a line over chunk tokens for one with a prompt chunk (`chunk_line`),
each from the passes of a run with one process on the GPU. Beside other passes a pass
advances at the simulator's pace: at decode share a and prefill share b, a decode pass's pace
is min(1, (a + b) a / (a * decodes running + b * others running)), itself among the decodes,
and a chunk pass's the same with b above (alone, 1); b = 1 - a conserves the GPU's work. Given
where every pass of the run began and ended, each pass's work at a share is that pace summed
over its time. A share is the one at which the passes of its kind that met a pass of the other
kind (of another node) did as much work as they would alone; that work grows with the share,
so bisection finds it, the other share held. `shares` fits both, in turns. With a chunk extra
(`cluster.chunk_extra_s`: a chunk pass beside decodes has that much more work, whatever its
chunk), the prefill share is 1 and `shares_at_full_pace` gives the decode share and the
extra the passes show (disagg.validate.fit_extra fits the extra by replays); `extra_shape`
gives how the passes' extra follows their time alone (`cluster.chunk_extra_shape`), and
`decode_share_shape` how the decode share follows the time alone of the chunk beside
(`cluster.decode_share_shape`).

The same run also says how fast its decode server runs the passes that met no chunk pass,
against a colocated server's passes alone (`decode_scale`): the simulator's
`cost.profile_decode_scale`."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import numpy as np
import pandas as pd

from disagg.errors import ConfigError
from disagg.settings import pieces_size
from disagg.sim.gpu import EXTRA_YIELD_SEQS

SHARE_BOUNDS = (0.01, 0.99)
MIN_CHUNK_PASSES = 8
PREFILL_BOUNDS = (0.01, 1.0)
Line = Callable[[np.ndarray], np.ndarray]


def fit_line(x: np.ndarray, y: np.ndarray) -> tuple[float, float]:
    """The least-squares line of `y` over `x`, as (at 0, slope); where y does not grow with
    x, its median, flat (its mean where x does not vary)."""
    slope, fixed = np.polyfit(x, y, 1) if np.ptp(x) > 0 else (0.0, y.mean())
    if slope < 0:
        slope, fixed = 0.0, np.median(y)
    return float(fixed), float(slope)


def _line(x: np.ndarray, per_pass: np.ndarray) -> Line:
    """`fit_line` of `per_pass` over `x`, as a function of x."""
    fixed, slope = fit_line(x, per_pass)
    return lambda size: fixed + slope * size


def decode_alone(steps: pd.DataFrame) -> Line:
    """Seconds per decode pass by batch size, from the decode-only passes of `steps`: each
    batch size's median, never less than a smaller batch's, interpolated between them and held
    beyond them. Not a line: a server replays a decode pass in the CUDA graph of the next power
    of two, so its time steps up past each, and an MoE pass's grows with the experts its batch
    picks, fast and then slowly (docs/calibration.md)."""
    decodes = steps[steps.prefill_tokens == 0]
    if len(decodes) < 2:
        raise ConfigError("the run for the decode pass alone has fewer than two decode passes")
    per_pass = pd.Series((decodes.duration_s / decodes.steps).to_numpy(float))
    medians = per_pass.groupby(decodes.decode_seqs.to_numpy(float)).median()
    xs, ys = medians.index.to_numpy(float), np.maximum.accumulate(medians.to_numpy(float))
    return lambda size: np.interp(size, xs, ys)


def chunk_line(steps: pd.DataFrame) -> Line:
    """Seconds per pass with a prompt chunk as a line over its chunk tokens, from those passes
    of `steps` without decodes where it has MIN_CHUNK_PASSES of them, else from all."""
    chunks = steps[steps.prefill_tokens > 0]
    alone = chunks[chunks.decode_seqs == 0]
    chunks = alone if len(alone) >= MIN_CHUNK_PASSES else chunks
    if len(chunks) < 2:
        raise ConfigError("the run for the chunk pass alone has fewer than two chunk passes")
    per_pass = (chunks.duration_s / chunks.steps).to_numpy(float)
    return _line(chunks.prefill_tokens.to_numpy(float), per_pass)


def overlap_segments(
    steps: pd.DataFrame, decode: bool = True, label: np.ndarray | None = None
) -> dict[int, tuple[np.ndarray, ...]]:
    """The passes of `steps` (one pass a row) of one kind, decode-only (`decode`) or with a
    prompt chunk, that overlap a pass of the other kind of another node, by position: each
    one's time cut where passes begin and end, as (seconds, decodes running, others running)
    per piece. With `label` (a number per row), a fourth: per piece, the label of the passes
    of the other kind of other nodes running (the largest; 0 where none runs)."""
    start = steps.start_s.to_numpy(float)
    end = start + steps.duration_s.to_numpy(float)
    is_decode = (steps.prefill_tokens == 0).to_numpy()
    node = steps.node.to_numpy()
    out: dict[int, tuple[np.ndarray, ...]] = {}
    for i in np.flatnonzero(is_decode == decode):
        a, b = start[i], end[i]
        near = (start < b) & (end > a)
        if not (near & (is_decode != decode) & (node != node[i])).any():
            continue
        cuts = np.unique(np.clip(np.concatenate([start[near], end[near], [a, b]]), a, b))
        mid = (cuts[:-1] + cuts[1:]) / 2
        on = (start[near][None, :] <= mid[:, None]) & (end[near][None, :] > mid[:, None])
        dec = is_decode[near]
        pieces: tuple[np.ndarray, ...] = (np.diff(cuts), on[:, dec].sum(1), on[:, ~dec].sum(1))
        if label is not None:
            other = (dec != decode) & (node[near] != node[i])
            marks = np.where(on[:, other], label[near][other][None, :], 0.0)
            pieces += (marks.max(1, initial=0.0),)
        out[int(i)] = pieces
    return out


def _bisect(work: Callable[[float], float], want: float, bounds: tuple[float, float]) -> float:
    """The share within `bounds` at which `work` (growing with it) comes to `want`."""
    lo, hi = bounds
    if work(lo) >= want:
        return lo
    if work(hi) <= want:
        return hi
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if work(mid) < want else (lo, mid)
    return (lo + hi) / 2


def _overlaps(
    steps: pd.DataFrame, alone: Line, decode: bool, wide: bool | None = None
) -> tuple[float, int, Callable[[float, float], float]]:
    """The passes of one kind of `steps`, decode-only (`decode`) or with a chunk, that met a
    pass of the other kind of another node (with `wide`, only the chained decode passes of
    more than EXTRA_YIELD_SEQS sequences, or only the other chained ones): their time alone
    in all, how many they are, and the work they did at decode share a and prefill share b
    (`work(a, b)`)."""
    if (steps.steps > 1).any():
        raise ConfigError("the shared run's steps table must hold one pass a row (a hw run's)")
    segments = overlap_segments(steps, decode)
    if wide is not None:
        chained = steps.chained > 0 if "chained" in steps else pd.Series(False, index=steps.index)
        picked = chained & ((steps.decode_seqs > EXTRA_YIELD_SEQS) == wide)
        segments = {i: s for i, s in segments.items() if picked.iloc[i]}
    if not segments:
        raise ConfigError("no decode pass met a prompt pass of another node: no share to fit")
    size = steps.decode_seqs if decode else steps.prefill_tokens
    want = float(alone(size.to_numpy(float)[list(segments)]).sum())
    pieces = zip(*segments.values(), strict=True)
    seconds, ndec, nother = (np.concatenate(column) for column in pieces)

    def work(a: float, b: float) -> float:
        pace = np.minimum(1.0, (a + b) * (a if decode else b) / (a * ndec + b * nother))
        pace[ndec + nother == 1] = 1.0  # alone: full speed
        return float((seconds * pace).sum())

    return want, len(segments), work


def _fit(
    steps: pd.DataFrame, alone: Line, decode: bool, wide: bool | None = None, least: int = 1
) -> Callable[[float | None], float]:
    """A fit of one kind's share, decode-only (`decode`) or with a chunk: given the other
    kind's share (None: 1 - the decode share), the share at which that kind's overlapping
    passes of `steps` (with `wide`, as `_overlaps` picks them) did their work alone. A
    ConfigError where fewer than `least` passes overlap."""
    want, n, work = _overlaps(steps, alone, decode, wide)
    if n < least:
        raise ConfigError(f"{n} passes met a pass of the other kind: fewer than {least} to fit")

    def at(other: float | None) -> float:
        def done(x: float) -> float:
            held = 1 - x if other is None else other
            return work(x, held) if decode else work(held, x)

        return _bisect(done, want, SHARE_BOUNDS if decode else PREFILL_BOUNDS)

    return at


def decode_share_wide(steps: pd.DataFrame, alone: Line) -> float:
    """The decode share's factor for a wide decode pass (the cluster's decode_share_wide) that
    the chained decode passes of `steps` (hw.latency.chain) show beside chunk passes at full
    pace (prefill share 1): the share of those of more than EXTRA_YIELD_SEQS sequences over
    the share of the others. 1 where either has fewer than MIN_BESIDE_PASSES passes: an
    unchained decode server waits on its host between passes, and its wide passes showed no
    such factor (docs/calibration.md, 2026-12-06i)."""
    try:
        wide, narrow = (
            _fit(steps, alone, True, picked, MIN_BESIDE_PASSES)(1.0) for picked in (True, False)
        )
    except ConfigError:  # too few of them met a chunk pass
        return 1.0
    return wide / narrow


def decode_share(steps: pd.DataFrame, alone: Line, prefill_share: float | None = None) -> float:
    """The decode share (module doc) that the decode passes of `steps`, a run of processes on
    one GPU, show against `alone` seconds per pass by batch size (`decode_alone`), beside chunk
    passes at `prefill_share` (None: 1 - the decode share); within SHARE_BOUNDS."""
    return _fit(steps, alone, decode=True)(prefill_share)


def prefill_share(steps: pd.DataFrame, alone: Line, decode_share: float) -> float:
    """The prefill share that the chunk passes of `steps` show against `alone` seconds per pass
    by chunk tokens (`chunk_line`), beside decode passes at `decode_share`; within
    PREFILL_BOUNDS."""
    return _fit(steps, alone, decode=False)(decode_share)


def shares(
    steps: pd.DataFrame, decode_alone: Line, chunk_alone: Line, turns: int = 20
) -> tuple[float, float]:
    """Both shares of `steps`, fitted in turns (each with the other held) from the conserved
    decode share, until neither moves by 1e-9 or after `turns` turns."""
    decode, prefill = _fit(steps, decode_alone, True), _fit(steps, chunk_alone, False)
    a = decode(None)
    b = 1 - a
    for _ in range(turns):
        b_new = prefill(a)
        a_new = decode(b_new)
        moved = max(abs(a_new - a), abs(b_new - b))
        a, b = a_new, b_new
        if moved < 1e-9:
            break
    return a, b


def shares_at_full_pace(
    steps: pd.DataFrame, decode_alone: Line, chunk_alone: Line
) -> tuple[float, float]:
    """The decode share and the chunk extra (the cluster's chunk_extra_s) of `steps` where a
    chunk pass runs at full pace beside the decodes (prefill share 1): the decode share their
    passes show beside it, and the mean over the chunk passes that met a decode pass of the
    work they did beyond their time alone, at least 0."""
    a = _fit(steps, decode_alone, decode=True)(1.0)
    want, n, work = _overlaps(steps, chunk_alone, decode=False)
    return a, max((work(a, 1.0) - want) / n, 0.0)


MIN_SHAPE_PASSES = 3  # passes with a chunk of one size, for the size to be a point of the shape


def extra_shape(
    runs: Sequence[tuple[pd.DataFrame, pd.Series]], pieces: Sequence[int] = (), host_s: float = 0.0
) -> tuple[tuple[float, float], ...]:
    """The chunk extra's shape (the cluster's chunk_extra_shape) that runs show, each its steps
    and, per row, the profile's device time at its shape (alone on its node): their passes with
    a prompt chunk that met a decode pass of another node, pooled over the runs, by size (the
    piece of `pieces`, hw.latency.prefill_graphs, that replays the chunk; else its tokens
    rounded up to a power of two).
    Each size with MIN_SHAPE_PASSES such passes or more is a point: their median time alone
    plus `host_s` (a pass's host time: the simulator's weights rule reads the shape at a
    pass's whole time alone, host and device), and their median extra (device time less its
    time alone there) over the extra of the size with the most passes, at least 0. () with
    fewer than two sizes, or where that size's extra is not above 0."""
    passes = _met_passes(runs, pieces)
    if passes.empty:
        return ()
    sizes = passes.groupby("size").agg(
        n=("extra", "size"), alone=("alone", "median"), extra=("extra", "median")
    )
    kept = sizes[sizes.n >= MIN_SHAPE_PASSES].sort_values("alone")
    ref = float(sizes.extra.to_numpy()[sizes.n.to_numpy().argmax()])
    if len(kept) < 2 or not ref > 0:
        return ()
    factors = np.maximum(kept.extra.to_numpy(float) / ref, 0.0)
    seconds = kept.alone.to_numpy(float) + host_s
    return tuple(zip(seconds.tolist(), factors.tolist(), strict=True))


def extra_wide(
    runs: Sequence[tuple[pd.DataFrame, pd.Series]],
    shape: Sequence[tuple[float, float]] = (),
    host_s: float = 0.0,
) -> float:
    """The chunk extra's factor beside a wide decode pass (the cluster's chunk_extra_wide) that
    runs show, as `extra_shape` takes them: over their passes with a prompt chunk that met a
    decode pass of another node, each one's extra over the `shape`'s factor at its time alone
    (plus `host_s`, as the shape reads it), the median of those whose first decode pass met
    had more than EXTRA_YIELD_SEQS sequences over the median of the others. 1 with fewer than
    MIN_SHAPE_PASSES of either, or where the others' is not above 0."""
    passes = _met_passes(runs)
    if passes.empty:
        return 1.0
    at = np.array([s for s, _ in shape], float)
    factor = np.interp(passes.alone + host_s, at, [f for _, f in shape]) if len(at) else 1.0
    extra = passes.extra / factor
    wide = passes.first_seqs > EXTRA_YIELD_SEQS
    narrow = float(extra[~wide].median())
    if min(wide.sum(), (~wide).sum()) < MIN_SHAPE_PASSES or not narrow > 0:
        return 1.0
    return max(float(extra[wide].median()) / narrow, 0.0)


def _met_passes(
    runs: Sequence[tuple[pd.DataFrame, pd.Series]], pieces: Sequence[int] = ()
) -> pd.DataFrame:
    """`_met_chunks` of every run, pooled (the passes with every column known)."""
    met = [_met_chunks(steps, shaped, pieces) for steps, shaped in runs]
    return pd.concat(met, ignore_index=True).dropna() if met else pd.DataFrame()


def _met_chunks(steps: pd.DataFrame, shaped: pd.Series, pieces: Sequence[int] = ()) -> pd.DataFrame:
    """`extra_shape`'s passes of one run: position, size, time alone and extra of each chunk
    pass that met a decode pass of another node, and the sequences of the first decode pass
    it met (the widest running then)."""
    segments = overlap_segments(steps, False, steps.decode_seqs.to_numpy(float))
    met = list(segments)
    rows = steps.iloc[met]
    alone = shaped.to_numpy(float)[met]
    tokens = rows.prefill_tokens.to_numpy(int) + rows.decode_seqs.to_numpy(int)
    return pd.DataFrame(
        {
            "row": met,
            "size": [pieces_size(pieces, n) or 2 ** math.ceil(math.log2(n)) for n in tokens],
            "alone": alone,
            "extra": rows.device_s.to_numpy(float) - alone,
            "first_seqs": [_first(segments[i][3]) for i in met],
        }
    )


def _first(marks: np.ndarray) -> float:
    """The first mark above 0 of a pass's pieces (0 where none is)."""
    on = marks[marks > 0]
    return float(on[0]) if len(on) else 0.0


MIN_BESIDE_PASSES = 20  # decode passes beside chunk passes of one size, for a point of the shape


def decode_share_shape(
    runs: Sequence[tuple[pd.DataFrame, pd.Series]],
    alone: Line,
    decode_share: float,
    pieces: Sequence[int] = (),
    host_s: float = 0.0,
    turns: int = 20,
) -> tuple[tuple[float, float], ...]:
    """The decode share's shape (the cluster's decode_share_shape) that runs show, each its
    steps and, per row, the profile's device time at its shape: their decode passes that met a
    pass with a prompt chunk of another node, by the size of the chunk pass beside them for
    longest (as `extra_shape` sizes them), pooled over the runs. Each size with
    MIN_BESIDE_PASSES such passes or more is a point: the median time alone of its chunk
    passes, plus `host_s` (the weights rule reads the shape at a pass's whole time alone), and
    its share over `decode_share`. The shares are the ones at which each size's decode passes
    did their work alone (`alone`: seconds per pass by batch size) beside chunks at full pace
    (prefill share 1), each piece of a pass at the share of the chunk beside it then: a size
    without a point at the shape's share there, a piece beside no chunk at `decode_share`.
    Fitted in turns, each size's with the others held, until none moves by 1e-9 or after
    `turns` turns. () with fewer than two points."""
    beside: dict[float, list[tuple[np.ndarray, ...]]] = {}  # size -> its passes' pieces
    want: dict[float, float] = {}
    times: dict[float, list[float]] = {}
    for steps, shaped in runs:
        chunks = _met_chunks(steps, shaped, pieces)
        label = np.zeros(len(steps))
        label[chunks.row.to_numpy(int)] = chunks["size"].to_numpy(float)
        own = alone(steps.decode_seqs.to_numpy(float))
        for i, cut in overlap_segments(steps, True, label).items():
            held = pd.Series(cut[0]).groupby(cut[3]).sum().drop(0.0, errors="ignore")
            size = float(held.index.to_numpy(float)[held.to_numpy().argmax()])
            beside.setdefault(size, []).append(cut)
            want[size] = want.get(size, 0.0) + float(own[i])
        for of in chunks["size"].unique():
            times.setdefault(float(of), []).extend(chunks.alone[chunks["size"] == of].dropna())
    at = {size: float(np.median(times[size])) for size in times}
    kept = sorted((s for s in beside if len(beside[s]) >= MIN_BESIDE_PASSES), key=at.__getitem__)
    if len(kept) < 2:
        return ()
    sizes = np.array([0.0, *sorted(at)])  # 0: beside no chunk
    share = np.full(len(sizes), decode_share)  # each size's, by its place in `sizes`
    place = {size: int(np.searchsorted(sizes, size)) for size in kept}

    def work(size: float) -> Callable[[float], float]:
        seconds, ndec, nother, marks = (np.concatenate(c) for c in zip(*beside[size], strict=True))
        of = np.searchsorted(sizes, marks)  # each piece's chunk's place

        def at_share(a: float) -> float:
            shares = np.where(of == place[size], a, share[of])
            pace = np.minimum(1.0, (shares + 1) * shares / (shares * ndec + nother))
            pace[ndec + nother == 1] = 1.0
            return float((seconds * pace).sum())

        return at_share

    works = {size: work(size) for size in kept}
    rest = [i for i, size in enumerate(sizes) if i and size not in place]
    for _ in range(turns):
        before = share.copy()
        for size in kept:
            share[place[size]] = _bisect(works[size], want[size], SHARE_BOUNDS)
        xs, ys = [at[s] for s in kept], [share[place[s]] for s in kept]
        share[rest] = np.interp([at[sizes[i]] for i in rest], xs, ys)
        if np.abs(share - before).max() < 1e-9:
            break
    return tuple((at[s] + host_s, float(share[place[s]]) / decode_share) for s in kept)


MIN_ALONE_PASSES = 20  # decode passes that met no chunk pass, for `decode_scale` to speak


def free_decodes(steps: pd.DataFrame) -> pd.DataFrame:
    """The decode-only passes of `steps` (one pass a row) that met no pass with a prompt chunk
    (of another node), where they have device times."""
    free = (steps.prefill_tokens == 0).to_numpy(copy=True)
    free[list(overlap_segments(steps))] = False
    return steps[free].dropna(subset=["device_s"])


def decode_scale(steps: pd.DataFrame, alone: pd.DataFrame) -> float | None:
    """How fast a disaggregated run's decode server runs its passes: the median, over its
    `free_decodes`, of their device time over what the decode-only passes of `alone` (a run
    of one colocated server, as the profile is measured) took on the device at their batch
    size (a line). None where the runs record no device time, or with fewer than
    MIN_ALONE_PASSES such passes. For steps tables without the passes' shapes
    (`decode_scale_at_shape` otherwise)."""
    own = free_decodes(steps)
    ref = alone[alone.prefill_tokens == 0].dropna(subset=["device_s"])
    if len(own) < MIN_ALONE_PASSES or len(ref) < 2:
        return None
    line = _line(ref.decode_seqs.to_numpy(float), (ref.device_s / ref.steps).to_numpy(float))
    device = (own.device_s / own.steps).to_numpy(float)
    return float(np.median(device / line(own.decode_seqs.to_numpy(float))))


def decode_scale_at_shape(steps: pd.DataFrame, shaped: pd.Series) -> float | None:
    """How fast a disaggregated run's decode server runs its passes: the median, over its
    `free_decodes`, of their device time over `shaped` (per row of `steps`: the cost model's
    device time at the pass's shape, `disagg.validate_passes.shape_device`). None with fewer
    than MIN_ALONE_PASSES such passes."""
    own = free_decodes(steps)
    ratio = (own.device_s / shaped[own.index]).dropna()
    return float(ratio.median()) if len(ratio) >= MIN_ALONE_PASSES else None

"""How the passes of processes on one GPU share it, measured from a run's steps table: the
`cluster.decode_share` that the simulator's shared GPU (disagg/sim/gpu.py) needs to give the
decode passes the lengths they had.

A decode pass alone takes `alone(batch)` seconds (a line over batch size, fitted to the decode
passes of a run with one process on the GPU). Beside other passes it advances at its weight
over theirs: at share s, s / (s * decodes running + (1 - s) * others running), itself among
the decodes. Given where every pass of the run began and ended, each decode pass's work at s
is that rate summed over its time. The share is the s at which the decode passes that met a
pass with a prompt chunk did as much work as they would alone; that work grows with s, so
bisection finds it."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pandas as pd

from disagg.errors import ConfigError

SHARE_BOUNDS = (0.01, 0.99)


def decode_line(steps: pd.DataFrame) -> Callable[[np.ndarray], np.ndarray]:
    """Seconds per decode pass as a line over batch size (least squares; a constant where
    passes do not lengthen with the batch), from the decode-only passes of `steps`."""
    decodes = steps[steps.prefill_tokens == 0]
    if len(decodes) < 2:
        raise ConfigError("the run for the decode pass alone has fewer than two decode passes")
    seqs = decodes.decode_seqs.to_numpy(float)
    per_pass = (decodes.duration_s / decodes.steps).to_numpy(float)
    slope, fixed = np.polyfit(seqs, per_pass, 1) if np.ptp(seqs) > 0 else (0.0, per_pass.mean())
    if slope < 0:
        slope, fixed = 0.0, float(np.median(per_pass))
    return lambda batch: fixed + slope * batch


def overlap_segments(steps: pd.DataFrame) -> dict[int, tuple[np.ndarray, ...]]:
    """The decode-only passes of `steps` (one pass a row) that overlap a pass with a prompt
    chunk of another node, by position: each one's time cut where passes begin and end, as
    (seconds, decodes running, others running) per piece."""
    start = steps.start_s.to_numpy(float)
    end = start + steps.duration_s.to_numpy(float)
    decode = (steps.prefill_tokens == 0).to_numpy()
    node = steps.node.to_numpy()
    out: dict[int, tuple[np.ndarray, ...]] = {}
    for i in np.flatnonzero(decode):
        a, b = start[i], end[i]
        near = (start < b) & (end > a)
        if not (near & ~decode & (node != node[i])).any():
            continue
        cuts = np.unique(np.clip(np.concatenate([start[near], end[near], [a, b]]), a, b))
        mid = (cuts[:-1] + cuts[1:]) / 2
        on = (start[near][None, :] <= mid[:, None]) & (end[near][None, :] > mid[:, None])
        out[int(i)] = (np.diff(cuts), on[:, decode[near]].sum(1), on[:, ~decode[near]].sum(1))
    return out


def decode_share(steps: pd.DataFrame, alone: Callable[[np.ndarray], np.ndarray]) -> float:
    """The share (module doc) that the decode passes of `steps`, a run of processes on one GPU,
    show against `alone` seconds per pass by batch size (`decode_line`); within SHARE_BOUNDS."""
    if (steps.steps > 1).any():
        raise ConfigError("the shared run's steps table must hold one pass a row (a hw run's)")
    segments = overlap_segments(steps)
    if not segments:
        raise ConfigError("no decode pass met a prompt pass of another node: no share to fit")
    batch = steps.decode_seqs.to_numpy(float)[list(segments)]
    want = float(alone(batch).sum())
    pieces = zip(*segments.values(), strict=True)
    seconds, ndec, nother = (np.concatenate(column) for column in pieces)

    def work(s: float) -> float:
        return float((seconds * s / (s * ndec + (1 - s) * nother)).sum())

    lo, hi = SHARE_BOUNDS
    if work(lo) >= want:
        return lo
    if work(hi) <= want:
        return hi
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if work(mid) < want else (lo, mid)
    return (lo + hi) / 2

"""The field-standard figures of a run, named as vLLM's `benchmark_serving` names them.

    describe_ms(ttft_s, "ttft")          # mean_ttft_ms, median_ttft_ms, std_ttft_ms, p90..p999
    describe_ms(itl_s, "itl", weights)   # the same over a list given as (value, count) runs

Inputs are in seconds, outputs in milliseconds. NaNs are left out. The mean, median and
standard deviation (population: ddof 0, as numpy's default) and the percentiles are those of
the list with each value repeated `weights` times; percentiles interpolate linearly between
neighbouring ranks (numpy's default method), so `describe_ms(v, n, w)` equals
`describe_ms(np.repeat(v, w), n)` without building the long list. An empty list gives NaN.
`standard_metrics` computes them all from a requests table and the steps' decode waits.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import numpy.typing as npt
import pandas as pd

from disagg.core.request import Status
from disagg.core.slo import Slo, goodput_per_s

PERCENTILES = {"p90": 90.0, "p95": 95.0, "p99": 99.0, "p999": 99.9}
STATS = ("mean", "median", "std", *PERCENTILES)

Floats = npt.NDArray[np.float64]


def stat_key(stat: str, name: str, unit: str = "ms") -> str:
    """`mean_ttft_ms`, `p999_itl_ms`; `unit` "" for unitless figures (`p10_tps_per_user`)."""
    return f"{stat}_{name}_{unit}" if unit else f"{stat}_{name}"


def weighted_percentile(sorted_v: Floats, counts: Floats, q: float) -> float:
    """The q-th percentile (0..100) of `sorted_v` (ascending) with value i repeated `counts[i]`
    times (whole numbers), by linear interpolation between the two ranks around
    (n - 1) * q / 100."""
    ends = np.cumsum(counts)  # the rank after each run's last
    rank = (ends[-1] - 1) * q / 100.0
    lo = math.floor(rank)
    below = sorted_v[int(np.searchsorted(ends, lo, side="right"))]
    above = sorted_v[int(np.searchsorted(ends, min(lo + 1, ends[-1] - 1), side="right"))]
    return float(below + (above - below) * (rank - lo))


def describe_ms(
    values_s: npt.ArrayLike, name: str, weights: npt.ArrayLike | None = None
) -> dict[str, float]:
    """Mean, median, std, p90/p95/p99/p99.9 of `values_s` in ms, keyed `{stat}_{name}_ms`;
    `weights`: whole-number repeat counts, one per value (default 1 each)."""
    v = np.asarray(values_s, dtype=float)
    w = np.ones_like(v) if weights is None else np.asarray(weights, dtype=float)
    keep = ~np.isnan(v) & (w > 0)
    v, w = v[keep] * 1e3, w[keep]
    if len(v) == 0:
        return {stat_key(s, name): math.nan for s in STATS}
    order = np.argsort(v, kind="stable")
    v, w = v[order], w[order]
    mean = float(np.average(v, weights=w))
    out = {
        stat_key("mean", name): mean,
        stat_key("median", name): weighted_percentile(v, w, 50.0),
        stat_key("std", name): float(np.sqrt(np.average((v - mean) ** 2, weights=w))),
    }
    for key, q in PERCENTILES.items():
        out[stat_key(key, name)] = weighted_percentile(v, w, q)
    return out


def per_user_tps(tpot_s: npt.ArrayLike) -> dict[str, float]:
    """Each request's decode speed, 1 / TPOT in tokens per second: mean, p10, median, p90
    (`p10_tps_per_user`: nine in ten users decode at least this fast). NaN when none."""
    t = np.asarray(tpot_s, dtype=float)
    tps = 1.0 / t[~np.isnan(t) & (t > 0)]
    names = {"mean": None, "p10": 10.0, "median": 50.0, "p90": 90.0}
    if len(tps) == 0:
        return {stat_key(s, "tps_per_user", ""): math.nan for s in names}
    return {
        stat_key(s, "tps_per_user", ""): float(np.mean(tps) if q is None else np.percentile(tps, q))
        for s, q in names.items()
    }


def run_span_s(requests: pd.DataFrame) -> float:
    """The run's span: first arrival to the last finished request's finish (0 if none)."""
    done = requests[requests.status == str(Status.FINISHED)]
    if done.empty:
        return 0.0
    return float(done.finish_s.max() - requests.arrival_s.min())


def standard_metrics(
    requests: pd.DataFrame, wait_s: pd.Series, weight: pd.Series, slo: Slo | None = None
) -> dict[str, Any]:
    """The field-standard figures of a requests table (vLLM's names, ms): TTFT, TPOT, E2E and
    queue delay distributions over the finished requests, ITL over the decode waits
    (`wait_s` each `weight` times: metrics.decode_waits), per-user TPS, throughput over
    `run_span_s`, goodput under `slo`."""
    done = requests[requests.status == str(Status.FINISHED)]
    span_s = run_span_s(requests)
    out: dict[str, Any] = {}
    out |= describe_ms(done.ttft_s, "ttft")
    out |= describe_ms(done.tpot_s, "tpot")
    out |= describe_ms(wait_s, "itl", weight)
    out |= describe_ms(done.finish_s - done.arrival_s, "e2e")
    out |= describe_ms(done.prefill_start_s - done.arrival_s, "queue")
    out |= per_user_tps(done.tpot_s)
    inputs, outputs = int(done.prompt_tokens.sum()), int(done.output_tokens.sum())
    out |= {"duration_s": span_s, "total_input_tokens": inputs, "total_output_tokens": outputs}
    for key, count in (
        ("request_throughput", len(done)),
        ("input_throughput", inputs),
        ("output_throughput", outputs),
        ("total_token_throughput", inputs + outputs),
    ):
        out[key] = count / span_s if span_s > 0 else 0.0
    return out | (goodput(requests, slo) if slo is not None else {})


def goodput(requests: pd.DataFrame, slo: Slo) -> dict[str, Any]:
    """`slo` (its text), `goodput_per_s` (requests meeting it per second of `run_span_s`) and
    `slo_met_fraction` (of all the requests in the table)."""
    met = slo.met(requests)
    return {
        "slo": str(slo),
        "goodput_per_s": goodput_per_s(requests, slo, run_span_s(requests)),
        "slo_met_fraction": float(met.mean()) if len(requests) else 0.0,
    }

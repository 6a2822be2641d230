"""Each configuration's maximum goodput, by bisection on the arrival rate, in parallel.

A probe simulates a configuration at one offered rate for a bounded workload: the requests
that arrive in `probe_s` simulated seconds (by default the base workload's own length; a trace
is replayed faster or slower with `workload.time_scale`), run until the last finishes. Its
goodput is the requests per second that met the SLOs over the offered window (requests / rate);
the configuration keeps up when that is at least `fraction` of the rate, that is when at least
`fraction` of the requests met the SLOs. A configuration past its capacity queues, more the
longer the window: a short `probe_s` overrates configurations near their capacity.

Configurations run in tiers of equal GPU count, the cheapest first, each tier in parallel; the
tiers before set the rate a configuration must reach to matter (`prune`), and a first probe
there that fails settles it in one simulation.
"""

from __future__ import annotations

import math
import multiprocessing
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from itertools import groupby
from pathlib import Path
from typing import Literal, cast

import pandas as pd

from disagg.config import Experiment
from disagg.core.metrics import requests_table
from disagg.core.slo import Slo, goodput_per_s
from disagg.core.workload import generate
from disagg.errors import ConfigError, DisaggError
from disagg.plan.bisect import bisect_rate
from disagg.plan.space import Candidate
from disagg.sim.cluster import Sim

Prune = Literal["front", "cost", "none"]
MIN_REQUESTS = 10  # a probe's window offers at least this many requests on average


@dataclass(frozen=True)
class Options:
    """How the planner decides. `prune`: "front" skips a configuration once it cannot beat the
    goodput of one with fewer GPUs (it is dominated), "cost" once it cannot beat the best GPUs
    per goodput found (faster, keeps only the cheapest), "none" bisects every one."""

    slo: Slo
    fraction: float = 0.9
    probe_s: float | None = None  # None: the base workload's length (`base_window_s`)
    rel_tol: float = 0.05
    max_probes: int = 12
    prune: Prune = "front"
    jobs: int = 1

    def __post_init__(self) -> None:
        if self.slo.ttft_ms is None and self.slo.e2e_ms is None:
            raise ConfigError(
                f"--slo {self.slo}: bound ttft_ms or e2e_ms too; without one a configuration "
                "that cannot keep up (its queue growing without end) would still meet the SLO"
            )
        checks = {
            "--fraction": (self.fraction, 0 < self.fraction <= 1),
            "--probe-s": (self.probe_s, self.probe_s is None or 0 < self.probe_s < math.inf),
            "--rel-tol": (self.rel_tol, 0 < self.rel_tol < 1),
            "--max-probes": (self.max_probes, self.max_probes >= 2),
            "--jobs": (self.jobs, self.jobs >= 1),
            "--prune": (self.prune, self.prune in ("front", "cost", "none")),
        }
        for option, (value, ok) in checks.items():
            if not ok:
                raise ConfigError(f"{option} {value}: out of range (see disagg plan --help)")


@dataclass(frozen=True)
class Probe:
    """One simulation at `rate_per_s`: goodput, the share of requests within the SLOs, and the
    latency percentiles of the finished requests (ms)."""

    rate_per_s: float
    goodput_per_s: float
    attainment: float
    ttft_ms_p50: float
    ttft_ms_p90: float
    tpot_ms_p50: float
    tpot_ms_p90: float


@dataclass
class Outcome:
    """A configuration's result. status: "ok" (`best` is the probe at its maximum goodput
    rate), "none" (it kept up at no rate probed; `best` is its best attempt), "pruned" (it
    cannot beat `bound_per_s`), "failed" (a simulation raised; `reason`)."""

    candidate: Candidate
    status: str
    best: Probe | None = None
    bound_per_s: float = 0.0
    probes: int = 0
    reason: str = ""
    tried: list[Probe] = field(default_factory=list)

    @property
    def goodput_per_s(self) -> float:
        return self.best.goodput_per_s if self.best and self.status == "ok" else 0.0


def parse_prune(text: str) -> Prune:
    """`--prune` as given, or ConfigError naming the choices."""
    if text not in ("front", "cost", "none"):
        raise ConfigError(f"--prune {text!r}: use front, cost or none")
    return cast(Prune, text)


def native_rate_per_s(base: Experiment) -> float:
    """The rate of `base`'s workload as given (a trace: its own, at time_scale 1)."""
    w = base.workload
    if w.trace is None:
        return w.rate_per_s
    native = base.updated("workload.time_scale=1")
    arrivals = generate(native.workload, base.seed, base_dir=Path(base.base_dir))
    span_s = arrivals[-1].arrival_s - arrivals[0].arrival_s if len(arrivals) > 1 else 0.0
    if span_s <= 0:
        raise ConfigError(f"workload.trace={w.trace!r}: needs two arrivals at distinct times")
    return (len(arrivals) - 1) / span_s


def base_window_s(base: Experiment) -> float:
    """How long `base`'s workload offers requests: its `duration_s`, or (a count or a whole
    trace) its requests over its rate."""
    w = base.workload
    if w.duration_s is not None:
        return w.duration_s
    return len(generate(w, base.seed, base_dir=Path(base.base_dir))) / native_rate_per_s(base)


def offered(base: Experiment, rate_per_s: float, window_s: float | None) -> Experiment:
    """`base` with its workload at `rate_per_s` (a trace: replayed at that rate, by
    `workload.time_scale`), cut to the arrivals of `window_s` seconds (None: as `base`'s)."""
    w = base.workload
    cut = [f"workload.duration_s={window_s!r}", "workload.num_requests=null"] if window_s else []
    if w.trace is None:
        return base.updated(f"workload.rate_per_s={rate_per_s!r}", *cut)
    scale = native_rate_per_s(base) / rate_per_s
    return base.updated(f"workload.time_scale={scale!r}", *cut)


def probe(exp: Experiment, slo: Slo, rate_per_s: float, window_s: float) -> Probe:
    """Simulate `exp` at `rate_per_s` for the arrivals of `window_s` seconds."""
    sim = Sim(offered(exp, rate_per_s, window_s))
    sim.run()
    req = requests_table(sim.requests.values())
    done = req[req.status == "finished"]
    offered_s = len(req) / rate_per_s  # the offered window: as many requests at this rate

    def pct(s: pd.Series, q: float) -> float:
        return float(s.quantile(q) * 1e3) if s.notna().any() else math.nan

    return Probe(
        rate_per_s,
        goodput_per_s(req, slo, offered_s),
        float(slo.met(req).mean()),
        pct(done.ttft_s, 0.5),
        pct(done.ttft_s, 0.9),
        pct(done.tpot_s, 0.5),
        pct(done.tpot_s, 0.9),
    )


def evaluate(cand: Candidate, opts: Options, start_per_s: float, bound_per_s: float) -> Outcome:
    """Bisect `cand`'s maximum goodput rate; with `bound_per_s` > 0 it must beat that first."""
    tried: list[Probe] = []
    window_s = opts.probe_s
    if window_s is None:
        raise ValueError("evaluate: opts.probe_s unresolved (plan() sets it)")

    def keeps_up(rate: float) -> bool:
        tried.append(probe(cand.exp, opts.slo, rate, window_s))
        return tried[-1].goodput_per_s >= opts.fraction * rate

    must = bound_per_s * (1 + opts.rel_tol) if bound_per_s > 0 else None
    try:
        found = bisect_rate(
            keeps_up,
            start_per_s,
            rel_tol=opts.rel_tol,
            max_probes=opts.max_probes,
            min_per_s=MIN_REQUESTS / window_s,
            must_reach_per_s=must,
        )
    except DisaggError as e:
        return Outcome(cand, "failed", probes=len(tried), reason=str(e).replace("\n", ";"))
    out = Outcome(cand, "ok", bound_per_s=bound_per_s, probes=len(tried), tried=tried)
    if found.pruned:
        out.status, out.best = "pruned", tried[0]
    elif found.rate_per_s == 0:
        out.status, out.best = "none", max(tried, key=lambda p: (p.attainment, -p.rate_per_s))
    else:
        out.best = next(p for p in tried if p.rate_per_s == found.rate_per_s)
    return out


def _bound(done: list[Outcome], gpus: int, prune: Prune) -> float:
    """The goodput a configuration of `gpus` GPUs must beat to matter, from cheaper ones."""
    ok = [o for o in done if o.status == "ok"]
    if prune == "none" or not ok:
        return 0.0
    if prune == "front":
        return max(o.goodput_per_s for o in ok)
    return max(gpus * o.goodput_per_s / o.candidate.gpus for o in ok)


def search(
    candidates: list[Candidate],
    opts: Options,
    start_per_s: Callable[[Candidate], float],
    progress: Callable[[int, int], None] | None = None,
) -> list[Outcome]:
    """Every candidate's outcome, in the order given; the same for any `opts.jobs`."""
    order = sorted(range(len(candidates)), key=lambda i: candidates[i].gpus)
    results: dict[int, Outcome] = {}
    pool = _pool(opts.jobs)
    try:
        for gpus, tier in groupby(order, key=lambda i: candidates[i].gpus):
            ids = list(tier)
            bound = _bound(list(results.values()), gpus, opts.prune)
            args = [(candidates[i], opts, start_per_s(candidates[i]), bound) for i in ids]
            outs = (
                pool.map(evaluate, *zip(*args, strict=True))
                if pool
                else [evaluate(*a) for a in args]
            )
            for i, out in zip(ids, outs, strict=True):
                results[i] = out
                if progress:
                    progress(len(results), len(candidates))
    finally:
        if pool:
            pool.shutdown()
    return [results[i] for i in range(len(candidates))]


def _pool(jobs: int) -> ProcessPoolExecutor | None:
    if jobs == 1:
        return None
    return ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn"))

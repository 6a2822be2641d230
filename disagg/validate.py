"""`disagg validate`: measure how far the simulator is from the real backend.

Stages, each announced through `say`:
1. profile the device for the experiments' model (`disagg.hw.profile.profile`) over the grid
   their workloads reach: prefill chunks x cached context, decode batch x context, mixed
   passes, each with its host time; then measure what the serving loop adds to every pass
   (`measure_loop`, on runs of their own seeds at the lowest and the highest load), which the
   profile replays add, with the chunk offsets that every replay fits on those runs'
   replays (`fit_chunk_offsets`), and how long their decode passes ran in each CUDA graph
   and just after a pass with a prompt chunk (`fit_decode_passes`); where the disaggregated
   servers share one GPU, runs of their own at the lowest and the highest load that show
   how they share it (`measure_share`): every replay fits the rules of the simulator's
   shared GPU on them (the decode and prefill shares; those with a chunk extra, shaped by
   the passes' time alone, and the decode share by the chunk beside; the round robin's
   switch cost; the turns' switch) and gets the
   one whose replays of those runs come closest to them (`calibration_shares`), and the
   speed of the decode server's passes that met no prefill pass
   (`calibration_decode_scale`); and every replay takes the control plane's hop measured on
   the calibration runs (`control_hop`);
2. run the hw backend (`run_hw`) on every experiment at every load (fixed seeds): given one
   experiment, it and its other mode (colocated <-> disaggregated), else the ones given; then
   the colocated one under each of `schedulers` (`with_schedulers`); each run `hw_runs` times
   on its workload, judged on the median (`hw_dirs`). The calibration's repeats and the
   cells' runs take turns: the calibration's first repeat, every cell's first run, the
   second repeat and the shared GPU's runs, every cell's second run, and so on. A drift in
   the host's speed over the validate then reaches the calibration and the cells alike (on
   one H100 the calibration's runs, all first, ran the loop of a mixed pass 1.5 times as
   slowly as the cells' runs after them, 2026-12-07l);
3. replay each run as it ran (`Sim(load_experiment(run_dir))`), once with the profile
   (`cost.source=profile:FILE`) and once with the roofline; and, on the profile, each
   calibration run at a validation run's kind and load (`calibration_twins`), for how far a
   cell moves on another workload; and, on a GPU, each run again with the host time per pass
   fitted on itself (`own_host`), for how much of a cell's error is the host time's;
4. write fidelity.csv / fidelity.md / repeat.csv / hw_spread.csv (cells run more than once) /
   own_host.csv and the plots (disagg.fidelity), and passes.csv / passes.md (each run's passes
   against its replay's and the profile's, disagg.validate_passes) under `out`.

On the CPU the hw runs record the CPU as their hardware (a custom GPU of the matmul rate and
copy bandwidth measured here) and the tcp wire as a nominal loopback NIC, so the roofline
replay has a device to model; accuracy there is not the point, the arithmetic is.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import statistics
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from disagg.config import Experiment, load_experiment
from disagg.errors import ConfigError
from disagg.fidelity import (
    METRICS,
    Verdict,
    fidelity_table,
    median_summary,
    own_host_table,
    past_saturation,
    plot_cdfs,
    plot_passes,
    plot_ratios,
    ratio,
    repeat_table,
    spread_table,
    widest_gaps,
    widest_spreads,
    write_report,
)
from disagg.share import (
    chunk_line,
    decode_alone,
    decode_scale,
    decode_scale_at_shape,
    decode_share_shape,
    decode_share_wide,
    extra_shape,
    extra_wide,
    fit_line,
    overlap_segments,
    shares,
    shares_at_full_pace,
)
from disagg.sim.costmodel import make_cost_model
from disagg.sim.gpu import EXTRA_YIELD_SEQS
from disagg.validate_passes import (
    after_chunk,
    chunk_offsets,
    decode_graph_scales,
    graph_scales,
    has_shapes,
    idle_hops,
    loop_s,
    pass_gaps,
    pass_offsets,
    pass_report,
    pass_table,
    shape_device,
)
from disagg.validate_plan import (
    DEFAULT_LOADS,
    Run,
    capacity_per_s,
    other_mode,
    plan_runs,
    profile_grid,
    run_kind,
    with_schedulers,
)

# the tcp wire between two processes of one host, as the simulator's NIC (nominal figures)
TCP_LOOPBACK = {
    "name": "tcp-loopback",
    "bandwidth_gbps": 10.0,
    "latency_s": 50e-6,
    "op_cost_s": 1e-6,
}


@dataclass(frozen=True)
class Options:
    """How `validate` runs. `rates`: requests/s of each load (None: DEFAULT_LOADS of the
    capacity the profile implies); `requests`: workload.num_requests of every run (None: the
    experiment's); `overrides` apply to every experiment (hw runs and so their replays),
    `sim_overrides` to the replays only; `grid_points`: values per profiled axis; `resume`:
    keep what an earlier run in the same directory finished (`validate`); `hw_runs`: times
    each hw run is run (the same seed, fresh servers), judged on their median (`hw_dirs`);
    `calibration_runs`: times each loop calibration run is run, the loop's costs the median
    of the repeats' fits (`fit_loop`); `schedulers`: colocated scheduler policies each
    run as well (`with_schedulers`)."""

    device: str = "cpu"
    wire: str | None = None  # None: tcp on the CPU, cuda on a GPU
    rates: tuple[float, ...] | None = None
    requests: int | None = None
    grid_points: int = 3
    hw_runs: int = 1
    calibration_runs: int = 1
    schedulers: tuple[str, ...] = ()
    warmup: int = 1
    repeats: int = 5
    overrides: tuple[str, ...] = ()
    sim_overrides: tuple[str, ...] = ()
    resume: bool = False

    def __post_init__(self) -> None:
        rates = self.rates
        if rates is not None and (not rates or any(not 0 < r < math.inf for r in rates)):
            given = ",".join(f"{r:g}" for r in rates)
            raise ConfigError(f"--rates {given!r}: give request rates > 0")
        if self.hw_runs < 1:
            raise ConfigError(f"--hw-runs {self.hw_runs}: run each cell at least once")
        if self.calibration_runs < 1:
            raise ConfigError(
                f"--calibration-runs {self.calibration_runs}: run each calibration at least once"
            )
        if self.grid_points < 1 or self.repeats < 1 or self.warmup < 0:
            raise ConfigError(
                f"grid_points={self.grid_points}, repeats={self.repeats}, warmup={self.warmup}: "
                "need at least one point and one repeat"
            )


@dataclass
class Report:
    table: pd.DataFrame  # disagg.fidelity.COLUMNS
    verdicts: list[Verdict]
    files: list[Path] = field(default_factory=list)

    @property
    def missed(self) -> list[Verdict]:
        return [v for v in self.verdicts if not v.met]


@contextlib.contextmanager
def server_threads(device: str) -> Iterator[None]:
    """On the CPU, torch's threads as a CPU server of the hw backend sets them (half the cores:
    it shares them with its peer), restored after; nothing on a GPU."""
    import torch

    threads = torch.get_num_threads()
    if device == "cpu":
        torch.set_num_threads(max(1, (os.cpu_count() or 2) // 2))
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def cpu_hardware(weight_dtype: str) -> dict[str, Any]:
    """This CPU as the simulator's GPU, as a server's threads see it: the float32 matmul rate,
    and the copy bandwidth scaled to the bytes the roofline counts (it charges `weight_dtype`
    bytes; the CPU runs float32)."""
    import torch

    from disagg.hw.device import time_it
    from disagg.models import dtype_bytes

    cpu = torch.device("cpu")
    a = torch.randn(1024, 1024)
    src = torch.ones(16 << 20)  # 64 MiB of float32
    dst = torch.empty_like(src)
    with server_threads("cpu"):
        matmul_s = min(time_it(partial(torch.mm, a, a), cpu, warmup=2, repeats=5))
        copy_s = min(time_it(partial(dst.copy_, src), cpu, warmup=1, repeats=5))
    bandwidth = 2 * src.numel() * 4 / copy_s * dtype_bytes(weight_dtype) / 4  # read + write
    memory = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return {
        "name": "cpu-measured",
        "bf16_flops": 2 * 1024**3 / matmul_s,
        "hbm_bandwidth_bps": bandwidth,
        "hbm_bytes": int(memory),
        "nvlink_bandwidth_bps": bandwidth,
    }


def prepare(paths: Sequence[Path], opts: Options) -> list[Experiment]:
    """The experiments to run, each as the hw backend runs it on `opts.device`: one path gives
    it and its other mode. ConfigError naming the experiment that cannot run there."""
    from disagg.hw.driver import check_hw_experiment, hw_experiment

    if not paths:
        raise ConfigError("validate needs an experiment (e.g. experiments/tiny-disagg.toml)")
    cpu = opts.device == "cpu"
    wire = opts.wire or ("tcp" if cpu else "cuda")
    dev = [f"hw.prefill_device={opts.device}", f"hw.decode_device={opts.device}"]
    flags = [*opts.overrides, *dev, f"hw.wire={wire}"]
    if opts.requests is not None:
        flags.append(f"workload.num_requests={opts.requests}")
    exps = [load_experiment(p, flags) for p in paths]
    wheres = list(map(str, paths))
    if len(exps) == 1:
        exps.append(other_mode(exps[0]))
        wheres.append(f"{paths[0]} (other mode)")
    exps = with_schedulers(exps, opts.schedulers)
    wheres += [f"--schedulers {name}" for name in opts.schedulers]
    for exp, where in zip(exps, wheres, strict=True):
        if exp.workload.trace is not None:
            raise ConfigError(f"{where}: workload.trace is set; validate sets loads by rate")
        if exp.model != exps[0].model:
            raise ConfigError(f"{where}: model differs from {paths[0]}'s (one profile for all)")
        try:
            check_hw_experiment(hw_experiment(exp))
        except ConfigError as e:
            raise ConfigError(f"{where}: not runnable on the hw backend: {e}") from None
    if cpu:  # recorded in each run's experiment.json: the device its replays model
        gpu = json.dumps(cpu_hardware(exps[0].model.weight_dtype))
        hardware = [f"hardware.gpu={gpu}", f"hardware.nic={json.dumps(TCP_LOOPBACK)}"]
        exps = [e.updated(*hardware) for e in exps]
    return [hw_experiment(e) for e in exps]


def replay(run_dir: Path, overrides: list[str], out: Path) -> tuple[dict[str, Any], pd.DataFrame]:
    """Simulate the run of `run_dir` as it ran (with `overrides`); write its results to `out`;
    return (summary, requests table)."""
    from disagg.core.metrics import (
        requests_table,
        steps_table,
        summarize,
        transfers_table,
        write_results,
    )
    from disagg.sim.cluster import Sim

    exp = load_experiment(run_dir, overrides)
    start = time.perf_counter()
    sim = Sim(exp)
    sim.run()
    req, steps = requests_table(sim.requests.values()), steps_table(sim.rec)
    xfers = transfers_table(sim.rec)
    wall = time.perf_counter() - start
    summary = summarize(req, steps, xfers, exp.cluster.total_gpus, wall)
    summary |= sim.cost_summary(steps)  # with the profile: passes beyond its grid, host share
    summary |= sim.network_summary()
    summary["experiment"] = exp.name
    write_results(out, req, steps, xfers, summary)
    (out / "experiment.json").write_text(exp.model_dump_json(indent=2) + "\n")
    return summary, req


def _rates(
    exps: Sequence[Experiment], csv: Path, opts: Options, say: Callable[[str], None]
) -> tuple[float, ...]:
    if opts.rates is not None:
        return opts.rates
    coloc = next((e for e in exps if e.cluster.mode == "colocated"), exps[0])
    cap = capacity_per_s(coloc, csv)
    rates = tuple(float(f"{cap * f:.3g}") for f in DEFAULT_LOADS)
    loads = ", ".join(f"{r:g}" for r in rates)
    say(f"capacity by the profile: {cap:.3g} req/s colocated; loads {loads} req/s")
    return rates


def measure_profile(exps: Sequence[Experiment], opts: Options, csv: Path) -> pd.DataFrame:
    """Profile the experiments' model on `opts.device` over their grid; write it to `csv`. On
    the CPU with the threads a CPU server gets (half the cores) and the fastest of the repeats
    (a shared CPU stalls some)."""
    from disagg.hw.profile import profile, write_csv

    spec, cpu = exps[0].model.spec, opts.device == "cpu"
    with server_threads(opts.device):
        df = profile(
            spec,
            spec.layers,
            opts.device,
            warmup=opts.warmup,
            repeats=opts.repeats,
            page_size=exps[0].kv.page_size,
            attention=exps[0].hw.attention,
            reduce=min if cpu else statistics.median,
            fused_ops=exps[0].hw.latency.fused_ops,
            weight_cache=exps[0].hw.weight_cache,
            prefill_graphs=exps[0].hw.latency.prefill_graphs,
            **asdict(profile_grid(exps, opts.grid_points)),
        )
    write_csv(df, csv)
    return df


CALIBRATION_SEED = 1  # added to the experiment's seed: the loop calibration's own workloads
MIN_HOPS = 5  # control-plane hops between passes that the calibration runs need to measure it


def calibration_run(exp: Experiment, seed: int, rate: float) -> Experiment:
    """`exp` on a workload of `seed` at `rate` requests/s, its model's weights still those of
    the runs it calibrates (so that hw.weight_cache keeps one copy of them)."""
    return exp.updated(
        f"seed={seed}", f"model.weight_seed={exp.weight_seed}", f"workload.rate_per_s={rate}"
    )


def busy_passes(steps: pd.DataFrame, alone: bool = False, chained: bool = False) -> pd.DataFrame:
    """`steps`' passes with device times that their node's loop followed at once, each with
    its loop time (`loop_s`): those launched after the pass before was read, or with
    `chained` those launched behind it (hw.latency.chain), whose host time ran during it and
    whose loop time is what the GPU and the host do between two chained passes. With `alone`,
    only those that met no pass of the other kind on another node: on a GPU that nodes share,
    a pass beside another's waits for the GPU outside its device events, which its loop time
    would count as the host's."""
    if "device_s" not in steps:
        return steps.iloc[:0].assign(loop_s=0.0)
    busy = steps.assign(loop_s=loop_s(steps, waited=math.nan))
    launched = steps.chained > 0 if "chained" in steps else pd.Series(False, index=steps.index)
    busy = busy[launched == chained]
    if alone:
        beside = [*overlap_segments(steps, decode=True), *overlap_segments(steps, decode=False)]
        busy = busy.drop(index=busy.index.intersection(steps.index[beside]))
    return busy.dropna(subset=["loop_s"])


def loop_costs(runs: Sequence[pd.DataFrame], alone: bool = False, least: int = 2) -> dict[str, Any]:
    """What serving runs' passes cost beyond the device, as `[cost]` fields, over the passes
    of all `runs` (their steps tables). Where passes have device times (a GPU), a pass's loop
    time is its wall time less its device time, plus the gap until its node's next pass while
    the loop had work (`loop_s`; a pass after which it waited is left out): the loop's work
    between passes (arrivals, tokens out) grows with the batch and the load, as its host time
    does. A least-squares line of it over the decode passes' batch sizes gives the fixed part
    of a decode pass and the part per sequence (`profile_host_s`, `profile_host_per_seq_s`);
    a pass with a prompt chunk has its own fixed part, the median of its loop time less the
    per-sequence part (`profile_host_chunk_s`). With `least` mixed passes (a chunk beside
    decodes) or more, a mixed pass has a line of its own over its decodes, fitted over every
    pass with a chunk (one alone at 0 decodes): the least-squares slope, and the median of
    their loop time less the slope's part (`profile_host_mixed_s`,
    `profile_host_mixed_per_seq_s`). Its bookkeeping grows faster with the decodes than a
    decode pass's (on one H100, 20-29 us a decode against 0-17, 2026-12-07). Where the runs
    say when each forward was launched, the median part of a pass's loop time before it
    (`host_before_s`: `profile_host_before`). Without device times (the CPU), the median gap
    between passes (`profile_pass_overhead_s`). The chained decode passes (hw.latency.chain)
    are fitted apart, their loop time a line over their batch (`profile_chain_s`,
    `profile_chain_per_seq_s`): what the GPU and the host do between two chained passes,
    outside the passes' device events. With `alone`, over the passes that met no other node's
    (`busy_passes`), and without a chunk pass among them, no `profile_host_chunk_s`. With
    fewer than `least` decode passes fitted, the median gap alone, as without device times."""
    gaps = pd.concat([pass_gaps(steps) for steps in runs])
    if len(gaps) == 0:
        raise ConfigError("the loop calibration runs ran fewer than two passes")
    timed = pd.concat([busy_passes(steps, alone) for steps in runs], ignore_index=True)
    decode = timed.prefill_tokens == 0
    if decode.sum() < least:  # no device times (the CPU), or too few passes to fit
        return {"profile_pass_overhead_s": max(0.0, float(gaps.median()))}
    loop = timed.loop_s
    seqs = timed.batch_size.to_numpy(float)
    fixed, per_seq = fit_line(seqs[decode.to_numpy()], loop[decode].to_numpy(float))
    chunk = loop[~decode] - per_seq * timed.batch_size[~decode]
    costs: dict[str, Any] = {
        "profile_pass_overhead_s": 0.0,  # in the loop time
        "profile_host_s": max(0.0, fixed),
        "profile_host_chunk_s": max(0.0, float(chunk.median())) if len(chunk) else max(0.0, fixed),
        "profile_host_per_seq_s": per_seq,
    }
    if alone and not len(chunk):
        del costs["profile_host_chunk_s"]
    decodes = timed.decode_seqs[~decode].to_numpy(float)  # beside each chunk
    if (decodes > 0).sum() >= least:  # a mixed pass's own line over its decodes
        slope = fit_line(decodes, loop[~decode].to_numpy(float))[1]
        costs["profile_host_mixed_s"] = max(0.0, float((loop[~decode] - slope * decodes).median()))
        costs["profile_host_mixed_per_seq_s"] = slope
    if "host_before_s" in timed:  # runs that say when each forward was launched
        split = (timed.host_before_s / loop)[timed.host_before_s.notna() & (loop > 0)]
        if len(split):
            costs["profile_host_before"] = float(split.clip(0.0, 1.0).median())
    chained = pd.concat([busy_passes(steps, alone, chained=True) for steps in runs])
    chained = chained[chained.prefill_tokens == 0]
    if len(chained) >= 2:  # the GPU's and the host's work between two chained passes
        at, slope = fit_line(chained.batch_size.to_numpy(float), chained.loop_s.to_numpy(float))
        costs["profile_chain_s"], costs["profile_chain_per_seq_s"] = max(0.0, at), slope
    return costs


HOST_KEYS = (
    "profile_pass_overhead_s",
    "profile_host_s",
    "profile_host_chunk_s",
    "profile_host_per_seq_s",
    "profile_host_mixed_s",
    "profile_host_mixed_per_seq_s",
    "profile_host_before",
    "profile_chain_s",
    "profile_chain_per_seq_s",
)


MIN_OWN_PASSES = 10  # decode passes that a cell's runs need for a host fit of their own


def own_host(runs: Sequence[Path]) -> dict[str, Any]:
    """The host time per pass fitted on hw `runs` of one cell themselves (`loop_costs`' host
    fields), for a replay that tells the host time's part of a cell's error from the rest;
    empty where the passes have no device times (the CPU), or where fewer than MIN_OWN_PASSES
    decode passes are fitted (a chained disaggregated run's decode passes are mostly chained
    or beside a chunk: on one H100, Llama's top load left two a run, one of them its first,
    and their fit said 21.9 ms). Runs whose nodes shared one GPU are fitted on the passes
    that met no other node's (`busy_passes`)."""
    shared = any(shares_gpu(run) for run in runs)
    steps = [pd.read_parquet(run / "steps.parquet") for run in runs]
    costs = loop_costs(steps, alone=shared, least=MIN_OWN_PASSES)
    if "profile_host_s" not in costs:  # no device times, or too few passes: no host time
        return {}
    return {k: v for k, v in costs.items() if k in HOST_KEYS}


def control_hop(runs: Sequence[Path]) -> tuple[float, int] | None:
    """The control plane's hop on this host, from hw `runs` (directories): the median of
    their hops that met no pass (`idle_hops`), and how many; None with fewer than MIN_HOPS.
    On one H100 a request's message took 0.65-0.8 ms where the simulator's default is 0.1 ms,
    twice on the way to a disaggregated prefill (2026-12-05k)."""
    tables = [(r / "hops.parquet", r / "steps.parquet") for r in runs]
    hops = [idle_hops(pd.read_parquet(h), pd.read_parquet(s)) for h, s in tables if h.exists()]
    pooled = np.concatenate([np.empty(0), *hops])
    return (float(np.median(pooled)), len(pooled)) if len(pooled) >= MIN_HOPS else None


def shares_gpu(run: Path) -> bool:
    """Whether the nodes of the hw run `run` shared one GPU (its experiment.json's
    cluster.shared_gpu; False without one)."""
    where = run / "experiment.json"
    return where.exists() and bool(json.loads(where.read_text())["cluster"].get("shared_gpu"))


def profiled(csv: Path, costs: dict[str, Any]) -> list[str]:
    """The overrides of a replay on the profile `csv` with the loop calibration's `costs`."""
    return [f"cost.source=profile:{csv}", *(f"cost.{k}={v!r}" for k, v in costs.items())]


def described(costs: dict[str, Any]) -> str:
    """The loop calibration's `costs` in words, for the progress line."""
    parts = []
    for key, value in costs.items():
        name = key.removeprefix("profile_")
        if key == "profile_host_before":  # a share of the host time
            parts.append(f"{value:.0%} of the host time before the device")
        elif isinstance(value, float):
            parts.append(f"{name} {value * 1e3:.3g} ms")
        else:  # the chunk offsets: (tokens, s) points
            points = ", ".join(f"{o * 1e3:+.3g} ms at {n:g} tokens" for n, o in value)
            parts.append(f"{name} {points}")
    return ", ".join(parts)


def measure_loop(
    exps: Sequence[Experiment],
    out: Path,
    rates: Sequence[float],
    repeat: int = 1,
    resume: bool = False,
) -> None:
    """Repeat `repeat` (1 up) of the runs that measure the serving loop's costs on this device
    that a profile of passes leaves out (`fit_loop` fits them): a colocated server (the
    experiments' colocated one, else the first in that mode) serving each of `rates`
    requests/s, each a workload of its own (the experiment's seed + CALIBRATION_SEED + its
    index), so none of the validation runs calibrates itself. A server's host time per pass
    follows the load it serves (its scheduler's queues, the messages of arrivals and tokens),
    which a burst of requests at once does not show, and it varies from run to run by as much
    as a tenth (on one H200, 0.58-0.92 ms per decode pass at batch 1), so each load is run more
    than once (fresh servers; `loop_runs`). With `resume`, a run with a summary is kept."""
    from disagg.hw.driver import run_hw

    coloc = next((e for e in exps if e.cluster.mode == "colocated"), None)
    coloc = coloc or other_mode(exps[0])
    dirs = loop_runs(out, rates, repeat)[repeat - 1]
    for i, (rate, where) in enumerate(zip(rates, dirs, strict=True)):
        if not (resume and (where / "summary.json").exists()):
            run_hw(calibration_run(coloc, coloc.seed + CALIBRATION_SEED + i, rate), where)


def fit_loop(out: Path, rates: Sequence[float], runs: int = 1) -> dict[str, Any]:
    """The serving loop's costs from `runs` repeats of `measure_loop`'s runs under `out`: the
    median of each repeat's fit (`repeat_loop_costs`), for one server process in three has run
    its host work twice as slowly as the others on the same workload (one H100, 2026-12-05j).
    Written to `out/calibration.json`; the chunk offsets, which are the simulator's to fit,
    come from their replays in `replay_all` (`fit_chunk_offsets`)."""
    costs = repeat_loop_costs(loop_runs(out, rates, runs))
    (out / "calibration.json").write_text(json.dumps(costs, indent=2) + "\n")
    return costs


def repeat_loop_costs(repeats: Sequence[Sequence[Path]]) -> dict[str, Any]:
    """`loop_costs` of each repeat's runs (directories), and per cost the median over the
    repeats: a repeat whose server processes ran slow moves none of them."""
    fits = [loop_costs([pd.read_parquet(d / "steps.parquet") for d in dirs]) for dirs in repeats]
    keys = [k for k in fits[0] if all(k in fit for fit in fits)]
    return {k: float(np.median([fit[k] for fit in fits])) for k in keys}


def fit_chunk_offsets(
    dirs: Sequence[Path],
    profile_csv: Path,
    costs: dict[str, Any],
    sim_overrides: Sequence[str] = (),
) -> dict[str, Any]:
    """`costs` with `profile_chunk_offsets` fitted on the serving runs in `dirs`: pass by
    pass against the profile with the rest of `costs` (`pass_offsets`), or, for runs whose
    steps tables predate the passes' shapes, against their replays on it (`DIR/replay`,
    `chunk_offsets`); as given, less any offsets, where the runs have no device times (the
    CPU) or too few chunk passes. The offsets are what the simulator leaves out of a chunk
    pass, so every replay fits them anew (`replay_all`)."""
    costs = {k: v for k, v in costs.items() if k != "profile_chunk_offsets"}
    runs = [pd.read_parquet(where / "steps.parquet") for where in dirs]
    if not any("device_s" in steps and steps.device_s.notna().any() for steps in runs):
        return costs
    if all(map(has_shapes, runs)):
        exp = load_experiment(dirs[0], [*sim_overrides, *profiled(profile_csv, costs)])
        offsets = pass_offsets(pd.concat(runs, ignore_index=True), exp)
        return costs | ({"profile_chunk_offsets": offsets} if offsets else {})
    for where in dirs:
        replay(where, [*sim_overrides, *profiled(profile_csv, costs)], where / "replay")
    replayed = [pd.read_parquet(where / "replay" / "steps.parquet") for where in dirs]
    offsets = chunk_offsets(pd.concat(runs), pd.concat(replayed))
    return costs | ({"profile_chunk_offsets": offsets} if offsets else {})


DECODE_FITS = (("profile_graph_scales", graph_scales), ("profile_after_chunk", after_chunk))


def fit_decode_passes(
    dirs: Sequence[Path],
    profile_csv: Path,
    costs: dict[str, Any],
    sim_overrides: Sequence[str] = (),
) -> dict[str, Any]:
    """`costs` with `profile_graph_scales` and then, on top of them, `profile_after_chunk`
    fitted on the colocated serving runs in `dirs` (`disagg.validate_passes.graph_scales`,
    `after_chunk`); as given, less either, where their steps tables have no device times or
    shapes, or too few decode passes."""
    costs = {k: v for k, v in costs.items() if k not in dict(DECODE_FITS)}
    runs = [pd.read_parquet(where / "steps.parquet") for where in dirs]
    for key, fit in DECODE_FITS:
        points = fit(
            runs, load_experiment(dirs[0], [*sim_overrides, *profiled(profile_csv, costs)])
        )
        costs |= {key: points} if points else {}
    return costs


def said_after(points: Sequence[Sequence[float]]) -> str:
    """`profile_after_chunk`'s points in words, for the progress line."""
    return ", ".join(f"{f:+.1%} at {t * 1e3:.3g} ms" for t, f in points)


def loop_runs(out: Path, rates: Sequence[float], runs: int = 1) -> list[list[Path]]:
    """Where `measure_loop` under `out` puts its colocated run at each of `rates`, each of
    `runs` times: per repeat k, `RATErps` (k = 1) or `RATErps-k`, one for each rate."""
    return [
        [out / f"{rate:g}rps{f'-{k}' if k > 1 else ''}" for rate in rates]
        for k in range(1, runs + 1)
    ]


def loop_repeat(name: str) -> int | None:
    """The repeat of a calibration's colocated run from its directory's name (`loop_runs`):
    1 for `RATErps`, k for `RATErps-k`; None for any other."""
    rate, sep, k = name.partition("rps")
    try:
        float(rate)
    except ValueError:
        return None
    if not sep or not (k == "" or (k[:1] == "-" and k[1:].isdigit())):
        return None
    return int(k[1:]) if k else 1


WEIGHTS = ("decode_share", "prefill_share")  # the weights rule's fields of the cluster
# share.json's keys: the weights, with a chunk extra (and the factors beside wide decode
# passes) or not, the round robin's switch_s, or the turns rule's slice with it
SHARES = (
    *WEIGHTS,
    "chunk_extra_s",
    "chunk_extra_wide",
    "decode_share_wide",
    "switch_s",
    "turn_slice_s",
)
SHAPE = "chunk_extra_shape"  # and the chunk extra's shape, (seconds, factor) points
SHARE_SHAPE = "decode_share_shape"  # and the decode share's
# the turns rule's slice as kernel timelines of both servers on one H200 and one H100 showed
# it: from one prefill turn to the next that preempts the decoder, 2.416 ms, two switches of
# 0.13 ms and 2.15 of the decoder's device time (benchmarks/results/2026-12-06-gpu); its
# switch is fitted by replays (`fit_turns`)
TURN_SLICE_S = 2.15e-3


def share_runs(out: Path, rates: Sequence[float]) -> list[tuple[float, Path]]:
    """Where `measure_share` under `out` puts its disaggregated runs, and their loads: at the
    highest of `rates`, then at the lowest."""
    ends = sorted({min(rates), max(rates)}, reverse=True)
    return [(rate, out / f"disagg-{rate:g}rps") for rate in ends]


def measure_share(
    exps: Sequence[Experiment], out: Path, rates: Sequence[float], resume: bool = False
) -> list[Path]:
    """The runs that say how this host's GPU is shared, where the experiments' disaggregated
    servers all run on one GPU (`cluster.shared_gpu` in their runs): a disaggregated run of its
    own seed at the highest of `rates` and one at the lowest (`share_runs`), whose shares the
    replays fit (`calibration_shares`). At the highest load most prompt chunks fill the token
    budget; the lowest runs the smaller ones, which the chunk extra's shape needs
    (`disagg.share.extra_shape`). Their directories (with `resume`, a run with a summary is
    kept); none where the servers have GPUs of their own, or no GPU."""
    import torch

    from disagg.hw.driver import hw_experiment, run_hw

    disagg = next((e for e in exps if e.cluster.mode == "disagg"), None)
    disagg = disagg or other_mode(exps[0])
    if not hw_experiment(disagg, torch.cuda.device_count()).cluster.shared_gpu:
        return []
    runs = share_runs(out, rates)
    for i, (rate, where) in enumerate(runs):
        if resume and (where / "summary.json").exists():
            continue
        shutil.rmtree(where, ignore_errors=True)  # what a run cut short left
        seed = disagg.seed + CALIBRATION_SEED + len(rates) + i
        run_hw(calibration_run(disagg, seed, rate), where)
    return [where for _, where in runs]


def fit_shares(shared: Path, alone: Sequence[Path]) -> dict[str, float]:
    """The decode and prefill shares (`WEIGHTS`) of the run in `shared`, its servers on one GPU,
    against the passes of the runs in `alone`, one process on the GPU (`measure_loop`'s
    colocated runs): their decode passes by batch size, their chunk passes by chunk tokens
    (those without decodes where there are enough: `chunk_line`)."""
    steps = pd.concat(pd.read_parquet(d / "steps.parquet") for d in alone)
    fitted = shares(
        pd.read_parquet(shared / "steps.parquet"), decode_alone(steps), chunk_line(steps)
    )
    return dict(zip(WEIGHTS, fitted, strict=True))


def share_overrides(fitted: Mapping[str, Any]) -> list[str]:
    """The replays' overrides of `fitted` shares: with a switch cost, the round robin; else
    the weights (no chunk extra, or none of a shape, unless fitted), whatever the run had."""
    if "switch_s" in fitted:
        rule = {"turn_slice_s": None} | dict(fitted)
    else:
        rule = {"chunk_extra_s": 0.0, "chunk_extra_wide": 1.0, "decode_share_wide": 1.0}
        rule |= {SHAPE: (), SHARE_SHAPE: ()}
        rule |= dict(fitted)
        rule |= {"switch_s": None, "turn_slice_s": None}
    return [f"cluster.{k}={json.dumps(v)}" for k, v in rule.items()]


def replay_error(runs: Sequence[Path], overrides: Sequence[str], out: Path) -> float:
    """How far the replays of `runs` with `overrides` (each written to `out/RUN`) are from
    them: the mean over the runs and METRICS of |log sim/hw| (a metric a short run lacks
    left out)."""
    logs = []
    for run in runs:
        hw = json.loads((run / "summary.json").read_text())
        sim, _ = replay(run, list(overrides), out / run.name)
        got = (ratio(sim.get(k, math.nan), hw.get(k, math.nan)) for k in METRICS.values())
        logs += [abs(math.log(r)) for r in got if r > 0]  # NaN fails r > 0
    return sum(logs) / len(logs) if logs else math.inf


SWITCH_RANGE_S = (0.0, 0.02)  # where the round robin's switch cost is searched
EXTRA_RANGE_S = (0.0, 0.1)  # and the weights' chunk extra
GRID_STEPS = 20  # a search's steps over its range (`least_smoothed`)


def least_smoothed(
    error: Callable[[float], float], bounds: tuple[float, float], steps: int = GRID_STEPS
) -> tuple[float, float]:
    """The x within `bounds` where `error` is least once smoothed, and the error there: `error`
    at `steps` + 1 points evenly over `bounds`, then the least of the parabola fitted (least
    squares) to the five around the grid's least (fewer at the ends), held between that
    least's neighbours (the grid's least itself where an error there is not finite). A
    replay's error is ragged near its least (docs/calibration.md, 2026-12-06i): a search
    that follows it lands in one of its dips, and which one moves with any change; the
    parabola reads the trough they are in. The last x tried is that x (a replay it leaves is
    that x's)."""
    xs = np.linspace(*bounds, steps + 1)
    ys = np.array([error(float(x)) for x in xs])
    i = int(np.argmin(ys))
    near = slice(max(0, i - 2), i + 3)
    x = float(xs[i])
    if np.isfinite(ys[near]).all():
        curve, slope, _ = np.polyfit(xs[near], ys[near], 2)
        if curve > 0:
            x = float(np.clip(-slope / (2 * curve), xs[max(0, i - 1)], xs[min(steps, i + 1)]))
    return x, error(x)


def fit_switch(shared: Sequence[Path], on_profile: Sequence[str], out: Path) -> tuple[float, float]:
    """The round robin's switch cost whose replays of `shared` (the calibration's runs on one
    GPU) on the profile (`on_profile`) are closest to them (`replay_error`), searched over
    SWITCH_RANGE_S (`least_smoothed`), and that error; their replays are left in `out`."""

    def error(switch_s: float) -> float:
        return replay_error(shared, [f"cluster.switch_s={switch_s!r}", *on_profile], out)

    return least_smoothed(error, SWITCH_RANGE_S)


TURN_SWITCH_RANGE_S = (0.0, 4e-4)  # where the turns rule's switch is searched


def fit_turns(
    shared: Sequence[Path], on_profile: Sequence[str], out: Path
) -> tuple[dict[str, float], float]:
    """The turns rule at its measured slice (`TURN_SLICE_S`) with the switch between turns whose
    replays of `shared` on the profile are closest to them, searched over TURN_SWITCH_RANGE_S,
    and that error; their replays are left in `out`."""

    def rule(switch_s: float) -> dict[str, float]:
        return {"turn_slice_s": TURN_SLICE_S, "switch_s": switch_s}

    def error(switch_s: float) -> float:
        return replay_error(shared, [*share_overrides(rule(switch_s)), *on_profile], out)

    switch_s, least = least_smoothed(error, TURN_SWITCH_RANGE_S)
    return rule(switch_s), least


def fit_extra(
    shared: Sequence[Path], alone: Sequence[Path], on_profile: Sequence[str], out: Path
) -> tuple[dict[str, float], float, float]:
    """The weights with a chunk extra (cluster.chunk_extra_s) of the runs `shared` (the
    highest load first), their chunk passes at full pace beside the decodes (prefill share 1):
    the decode share the first run's passes show (`shares_at_full_pace`, against the passes of
    `alone` as in `fit_shares`), the extra's shape and the decode share's that all their
    passes show (`extra_shape`, `decode_share_shape`: against the profile at their shape, by
    the prefill piece that replays them, at their time alone with the prefill server's host
    time per pass, as the replay reads it), and the
    chunk extra whose replays of them on the profile (`on_profile`) are closest to them,
    searched over EXTRA_RANGE_S (`least_smoothed`); that error; and the extra the first run's passes
    themselves show. Their replays are left in `out`."""
    steps = pd.concat(pd.read_parquet(d / "steps.parquet") for d in alone)
    runs = [(d, pd.read_parquet(d / "steps.parquet")) for d in shared]
    alone_s = decode_alone(steps)
    a, passes_s = shares_at_full_pace(runs[0][1], alone_s, chunk_line(steps))
    weights: dict[str, Any] = {"decode_share": a, "prefill_share": 1.0}
    weights["decode_share_wide"] = decode_share_wide(runs[0][1], alone_s)
    timed = [
        (load_experiment(d, [*on_profile]), run)
        for d, run in runs
        if has_shapes(run) and "device_s" in run
    ]
    if timed:
        exp = timed[0][0]
        host_s = make_cost_model(exp, exp.cluster.prefill, "prefill").host_s(True, 0)
        at_shape = [(run, shape_device(run, e)) for e, run in timed]
        pieces = exp.hw.latency.prefill_graphs
        weights[SHAPE] = extra_shape(at_shape, pieces, host_s)
        weights["chunk_extra_wide"] = extra_wide(at_shape, weights[SHAPE], host_s)
        weights[SHARE_SHAPE] = decode_share_shape(at_shape, alone_s, a, pieces, host_s)

    def error(extra_s: float) -> float:
        rule = share_overrides(weights | {"chunk_extra_s": extra_s})
        return replay_error(shared, [*rule, *on_profile], out)

    extra_s, least = least_smoothed(error, EXTRA_RANGE_S)
    return weights | {"chunk_extra_s": extra_s}, least, passes_s


def calibration_shares(
    cal: Path, on_profile: Sequence[str] | None = None, say: Callable[[str], None] = print
) -> dict[str, Any]:
    """The shares of a validate directory's calibration `cal`: fitted anew on its
    disaggregated runs where it has them, so that a replay after a change to the fit gets the
    change, and written to its share.json; else what share.json holds, if there is one. The
    weights' shares come from the passes of the run at the highest load (`fit_shares`).
    Given the replays' profile overrides (`on_profile`), more rules are fitted with replays of
    all the runs: the weights with a chunk extra (`fit_extra`), the round robin
    (`fit_switch`) and the turns rule's switch at its measured slice (`fit_turns`); the rule
    whose replays come closest to them (`replay_error`) is the one kept. Without, the
    weights."""
    runs, alone = calibration_runs(cal)
    if runs and alone:
        fitted = fit_shares(runs[0], alone)
        if on_profile is not None:
            weights = replay_error(runs, [*share_overrides(fitted), *on_profile], cal / "weights")
            extra, beside, passes_s = fit_extra(runs, alone, on_profile, cal / "chunk-extra")
            switch_s, rr = fit_switch(runs, on_profile, cal / "round-robin")
            turns_fit, turns = fit_turns(runs, on_profile, cal / "turns")
            at_ms = f"at {extra['chunk_extra_s'] * 1e3:.3g} ms; the passes: {passes_s * 1e3:.3g}"
            said = (
                f"weights {weights:.3f}, chunk extra {beside:.3f} ({at_ms}), "
                f"round robin {rr:.3f} (at {switch_s * 1e3:.3g} ms), "
                f"turns {turns:.3f} (at {turns_fit['switch_s'] * 1e3:.3g} ms)"
            )
            names = " and ".join(run.name for run in runs)
            say(f"shared GPU: mean |log sim/hw| on {names}: {said}")
            rules = [(weights, fitted), (beside, extra), (rr, {"switch_s": switch_s})]
            rules.append((turns, turns_fit))
            fitted = min(rules, key=lambda rule: rule[0])[1]
        (cal / "share.json").write_text(json.dumps(fitted, indent=2) + "\n")
        return fitted
    return read_shares(cal / "share.json") if (cal / "share.json").exists() else {}


def calibration_runs(cal: Path) -> tuple[list[Path], list[Path]]:
    """A calibration directory's runs that finished (a summary written): its disaggregated
    runs on one GPU (`measure_share`'s, the highest load first) and its colocated runs
    (`measure_loop`'s, every repeat)."""
    done = [d for d in sorted(cal.glob("*rps*")) if (d / "summary.json").exists()]
    shared = [d for d in done if d.name.startswith("disagg-")]
    shared.sort(key=lambda d: -float(d.name.removeprefix("disagg-").removesuffix("rps")))
    alone = [d for d in done if loop_repeat(d.name) is not None]
    return shared, alone


def by_repeat(alone: Sequence[Path]) -> list[list[Path]]:
    """A calibration's colocated runs (`calibration_runs`) grouped by repeat, in order; a
    repeat cut short (fewer runs than the others) left out, for its fit would stand on some
    of the loads only."""
    repeats: dict[int, list[Path]] = {}
    for d in alone:
        repeats.setdefault(loop_repeat(d.name) or 1, []).append(d)
    most = max(map(len, repeats.values()), default=0)
    return [repeats[k] for k in sorted(repeats) if len(repeats[k]) == most]


def calibration_decode_scale(
    cal: Path, on_profile: Sequence[str], say: Callable[[str], None] = print
) -> dict[str, Any]:
    """The calibration `cal`'s `cost.profile_decode_scale`, as a loop cost: its disaggregated
    run's (at the highest load) decode passes that met no prefill pass against the profile at
    their shape (`on_profile`: the overrides of the replays' profile and loop costs, the graph
    scales among them; `disagg.share.decode_scale_at_shape`), or, where its steps table
    predates the shapes, against its colocated runs' passes (`disagg.share.decode_scale`);
    then, on top of that scale, the decode server's own graph scales over the passes of all
    its disaggregated runs (`cost.profile_decode_graph_scales`,
    `disagg.validate_passes.decode_graph_scales`), where they have enough. {} without those
    runs or their device times."""
    shared, alone = calibration_runs(cal)
    if not shared or not alone:
        return {}
    runs = [pd.read_parquet(d / "steps.parquet") for d in shared]
    run, steps = shared[0], runs[0]
    if "device_s" in steps and has_shapes(steps):
        unscaled = load_experiment(run, [*on_profile, "cost.profile_decode_scale=1.0"])
        shaped = shape_device(steps, unscaled)
        scale, of = decode_scale_at_shape(steps, shaped), "the profile's at their shape"
    else:
        colocated = pd.concat(pd.read_parquet(d / "steps.parquet") for d in alone)
        scale, of = decode_scale(steps, colocated), "a colocated one's"
    if scale is None:
        return {}
    say(f"decode server: its passes beside no prefill took {scale:.3f} of {of}")
    fitted: dict[str, Any] = {"profile_decode_scale": scale}
    scaled = [f"cost.profile_decode_scale={scale!r}", "cost.profile_graph_scales=[]"]
    scaled.append("cost.profile_decode_graph_scales=[]")
    points = decode_graph_scales(runs, load_experiment(run, [*on_profile, *scaled]))
    if points:
        said = ", ".join(f"{f:.3f} at {b:g}" for b, f in points)
        say(f"decode server: its passes beside no prefill, over that, by their batch: {said}")
        fitted["profile_decode_graph_scales"] = points
    return fitted


def read_shares(path: Path) -> dict[str, Any]:
    """share.json's shares (`SHARES`, and the shapes `SHAPE` and `SHARE_SHAPE`; a file of an
    earlier validate may hold only the first)."""
    fitted = json.loads(path.read_text())
    out: dict[str, Any] = {k: float(fitted[k]) for k in SHARES if k in fitted}
    for shape in (SHAPE, SHARE_SHAPE):
        if shape in fitted:
            out[shape] = tuple((float(x), float(y)) for x, y in fitted[shape])
    return out


def said_shares(fitted: Mapping[str, Any]) -> str:
    """`fitted` shares in words, for the progress line (no prefill share: 1 - the decode's)."""
    if "turn_slice_s" in fitted:
        slice_ms, switch_ms = fitted["turn_slice_s"] * 1e3, fitted["switch_s"] * 1e3
        return f"turns of {slice_ms:.3g} ms a decode pass, {switch_ms:.3g} ms between"
    if "switch_s" in fitted:
        return f"round robin, switch cost {fitted['switch_s'] * 1e3:.3g} ms"
    a = fitted["decode_share"]
    b = fitted.get("prefill_share", 1 - a)
    extra = fitted.get("chunk_extra_s", 0.0)
    beside = f", chunk extra {extra * 1e3:.3g} ms" if extra else ""
    if extra and fitted.get(SHAPE):
        points = ", ".join(f"{f:.2f} at {s * 1e3:.3g} ms" for s, f in fitted[SHAPE])
        beside += f" times by its time alone {points}"
    if extra and fitted.get("chunk_extra_wide", 1.0) != 1.0:
        wide = fitted["chunk_extra_wide"]
        beside += f", and {wide:.2f} beside more than {EXTRA_YIELD_SEQS} decode sequences"
    if fitted.get(SHARE_SHAPE):
        points = ", ".join(f"{f:.2f} at {s * 1e3:.3g} ms" for s, f in fitted[SHARE_SHAPE])
        beside += f"; the decode share times by the chunk's time alone {points}"
    if fitted.get("decode_share_wide", 1.0) != 1.0:
        wide = fitted["decode_share_wide"]
        beside += f", and {wide:.2f} for a chained pass of more than {EXTRA_YIELD_SEQS} sequences"
    return f"decode share {a:.3f}, prefill share {b:.3f} (capacity {a + b:.3f}){beside}"


def validate(
    paths: Sequence[Path],
    out: Path,
    tolerances: dict[str, float],
    opts: Options = Options(),
    say: Callable[[str], None] = print,
) -> Report:
    """Run the stages of the module doc; write the report under `out`; return it. With
    `opts.resume`, `out` holds a validate run of the same options cut short (a device's time
    limit, say): what it finished is kept (the profile, the loop calibration, the shared-GPU
    run, each hw run whose summary was written) and the rest is done."""
    exps = prepare(paths, opts)
    spec, csv = exps[0].model.spec, (out / "profile.csv").resolve()
    record_options(out, paths, opts)
    grid = profile_grid(exps, opts.grid_points)
    if opts.resume and csv.exists():
        say(f"profile: kept {csv}")
    else:
        say(f"profile: {spec.name} ({spec.layers} layers) on {opts.device}, grid {grid}")
        start = time.perf_counter()
        df = measure_profile(exps, opts, csv)
        say(f"profile: {len(df)} shapes in {time.perf_counter() - start:.1f} s -> {csv}")
    rates = _rates(exps, csv, opts, say)
    ends = sorted({min(rates), max(rates)})
    cal, loads = out / "calibration", said_rates(ends)
    runs = plan_runs(exps, rates)
    costs_kept = opts.resume and (cal / "calibration.json").exists()
    rounds = max(opts.calibration_runs, opts.hw_runs)
    for k in range(1, rounds + 1):  # the calibration's repeats and the cells' runs take turns
        if k <= opts.calibration_runs and not costs_kept:
            loop_turn(exps, cal, ends, k, opts, say)
        if k == min(2, rounds):  # the shared GPU's runs in the middle of the turns
            measure_shared(exps, cal, ends, opts.resume, say)
        if k <= opts.hw_runs:
            for i, run in enumerate(runs, 1):
                hw_run(run, f"hw run {i}/{len(runs)}: {run.label}", out, k, opts, say)
    if costs_kept:
        costs, kept = json.loads((cal / "calibration.json").read_text()), ", kept"
    else:
        costs, kept = fit_loop(cal, ends, opts.calibration_runs), ""
    times = f", {opts.calibration_runs} times each" if opts.calibration_runs > 1 else ""
    say(f"serving loop (runs of their own at {loads} req/s{times}): {described(costs)}{kept}")
    (out / "runs.json").write_text(json.dumps([run.label for run in runs]) + "\n")
    return replay_all(out, tolerances, opts.sim_overrides, say)


def said_rates(rates: Sequence[float]) -> str:
    """Loads in words, for the progress lines: "2.77 and 9.42"."""
    return " and ".join(f"{rate:g}" for rate in rates)


def loop_turn(
    exps: Sequence[Experiment],
    cal: Path,
    ends: Sequence[float],
    k: int,
    opts: Options,
    say: Callable[[str], None],
) -> None:
    """`measure_loop`'s `k`-th repeat under `cal` at the loads `ends`, told through `say`; with
    `opts.resume`, kept where every run of it has a summary."""
    said = f"serving loop: runs of their own at {said_rates(ends)} req/s"
    said += f" ({k} of {opts.calibration_runs})"
    if opts.resume and all((d / "summary.json").exists() for d in loop_runs(cal, ends, k)[k - 1]):
        say(f"{said}, kept")
        return
    say(said)
    measure_loop(exps, cal, ends, k, opts.resume)


def measure_shared(
    exps: Sequence[Experiment],
    cal: Path,
    ends: Sequence[float],
    resume: bool,
    say: Callable[[str], None],
) -> None:
    """`measure_share`'s runs under `cal` at the loads `ends`, told through `say`."""
    said = f"shared GPU: disaggregated runs of their own at {said_rates(ends)} req/s"
    if resume and all((d / "summary.json").exists() for _, d in share_runs(cal, ends)):
        say(f"{said}, kept")
    elif measure_share(exps, cal, ends, resume):
        say(f"{said}, for the replays to fit the shares on")


def hw_run(
    run: Run, name: str, out: Path, k: int, opts: Options, say: Callable[[str], None]
) -> None:
    """The `k`-th run (1 up) of the cell `run` (`plan_runs`) on its workload, into its
    `hw_dirs` place, told through `say` as `name`; with `opts.resume`, kept where it has a
    summary."""
    from disagg.hw.driver import run_hw

    where = hw_dirs(out, run.label, opts.hw_runs)[k - 1]
    again = f", again ({k} of {opts.hw_runs})" if k > 1 else ""
    what = f"{name} ({run.exp.cluster.mode}, {run.exp.workload.rate_per_s:g} req/s){again}"
    if opts.resume and (where / "summary.json").exists():
        say(f"{what}, kept")
        return
    say(what)
    shutil.rmtree(where, ignore_errors=True)  # what a run cut short left
    ran, _ = run_hw(run.exp, where)
    took = f"{ran['wall_s']:.1f} s, {ran['startup_s']:.1f} s of it to start the servers"
    say(f"{name}{again} took {took}{start_parts(ran)}")


def hw_dirs(out: Path, label: str, runs: int | None = None) -> list[Path]:
    """Where a validate directory `out` holds the hw runs of cell `label`: `out/hw/LABEL`, then
    `out/hw-K/LABEL` for its K-th run on the same workload (`Options.hw_runs`). With `runs`,
    the first `runs` of them; without, those that finished (have a summary)."""
    if runs is not None:
        return [out / ("hw" if k == 1 else f"hw-{k}") / label for k in range(1, runs + 1)]
    again = sorted(
        (int(d.name[3:]), d / label)
        for d in out.glob("hw-*")
        if d.name[3:].isdigit() and (d / label / "summary.json").exists()
    )
    return [out / "hw" / label, *(where for _, where in again)]


def start_parts(summary: dict[str, Any]) -> str:
    """What a hw run's servers spent starting, the slowest server's each, and the weights the
    server that read fewest read from hw.weight_cache: " (build 9.1 s, graphs 1.2 s, warm-up
    0.3 s, weights read 0 of 291)"; "" for a summary without the parts."""
    nodes = summary.get("node_settings", {}).values()
    parts = [
        f"{what} {max(n.get(key) or 0.0 for n in nodes):.1f} s"
        for what, key in (("build", "build_s"), ("graphs", "capture_s"), ("warm-up", "warm_up_s"))
        if any(key in n for n in nodes)
    ]
    read = [n["weights_read"] for n in nodes if "weights_read" in n]
    if read:
        parts.append(f"weights read {min(r for r, _ in read)} of {max(t for _, t in read)}")
    return f" ({', '.join(parts)})" if parts else ""


# what an experiment may change between a validate and its --resume: where it was loaded from,
# and where its servers keep their weights (the same weights either way)
STAGE_FREE: dict[str, Any] = {"base_dir": True, "hw": {"weight_cache"}}


def record_options(out: Path, paths: Sequence[Path], opts: Options) -> None:
    """Write what decides a validate run's stages to `out/validate.json`: the experiments as
    given (before `prepare`, whose CPU device is measured anew each time) and the options;
    with `opts.resume`, first check that the run in `out` had the same, else ConfigError
    naming what differs."""
    stages = asdict(opts) | {"resume": None, "sim_overrides": None}  # neither changes a stage
    stages["experiments"] = [
        load_experiment(path).model_dump(mode="json", exclude=STAGE_FREE) for path in paths
    ]
    record = json.loads(json.dumps(stages))  # as validate.json holds it: lists, not tuples
    path = out / "validate.json"
    if opts.resume:
        if not path.exists():
            raise ConfigError(f"--resume: {out} holds no validate run to resume (no {path.name})")
        before = json.loads(path.read_text())
        for key, value in record.items():
            if before.get(key) != value:
                was = "other experiments" if key == "experiments" else repr(before.get(key))
                now = "these" if key == "experiments" else repr(value)
                raise ConfigError(f"--resume: {out} was validated with {key} {was}, not {now}")
    out.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=2) + "\n")


def calibration_twins(out: Path, labels: Sequence[str]) -> list[tuple[str, Path]]:
    """The calibration runs under `out/calibration` of a validation run's kind (`run_kind`)
    and load, on seeds of their own, with that run's label: `measure_loop`'s colocated runs
    (`RATErps`) and `measure_share`'s disaggregated one (`disagg-RATErps`)."""
    twins = []
    for label in labels:
        kind, _, load = label.rpartition("-")
        for where in (out / "calibration" / load, out / "calibration" / label):
            if (where / "summary.json").exists() and run_kind(load_experiment(where)) == kind:
                twins.append((label, where))
    return twins


def replay_all(
    out: Path,
    tolerances: dict[str, float],
    sim_overrides: Sequence[str] = (),
    say: Callable[[str], None] = print,
) -> Report:
    """Stages 3 and 4 over a validate directory's hw runs (`out/hw`, in `runs.json`'s order),
    its profile and its loop calibration, with the loop's costs (`loop_costs`) and the chunk
    offsets (what the simulator leaves out of a chunk pass) fitted anew on the calibration's
    colocated runs, and the control plane's hop on all its runs (`control_hop`): `disagg
    validate --replay` redoes them after a change to the simulator or the fits, without the
    device."""
    hw = out / "hw"
    order = out / "runs.json"
    labels = (
        json.loads(order.read_text()) if order.exists() else sorted(p.name for p in hw.glob("*"))
    )
    csv = (out / "profile.csv").resolve()
    if not labels or not csv.exists():
        raise ConfigError(f"{out}: not a validate directory (needs hw/ runs and profile.csv)")
    calibration = out / "calibration" / "calibration.json"
    costs = json.loads(calibration.read_text()) if calibration.exists() else {}
    shared, alone = calibration_runs(out / "calibration")
    hop = control_hop([*alone, *shared])
    if hop is not None:  # the host's, not the cost model's: every replay takes it
        said = f"{hop[0] * 1e3:.3g} ms (the median of {hop[1]} that met no pass)"
        say(f"control plane, on its runs: a request's message takes {said}")
        sim_overrides = [f"transfer.control_latency_s={hop[0]!r}", *sim_overrides]
    if alone:  # the loop's costs and chunk offsets are the simulator's to fit, anew (a
        # validate cut short before its fit has its runs, not its calibration.json)
        costs = repeat_loop_costs(by_repeat(alone))
        say(f"serving loop, on its runs: {described(costs)}")
        costs = fit_chunk_offsets(alone, csv, costs, sim_overrides)
        if "profile_chunk_offsets" in costs:
            offsets = {"profile_chunk_offsets": costs["profile_chunk_offsets"]}
            say(f"serving loop, on its runs' replays: {described(offsets)}")
        costs = fit_decode_passes(alone, csv, costs, sim_overrides)
        if "profile_graph_scales" in costs:
            scales = ", ".join(f"{f:.3f} at {b:g}" for b, f in costs["profile_graph_scales"])
            say(f"decode passes long after a chunk pass, by their batch: {scales}")
        if "profile_after_chunk" in costs:
            say(f"decode passes after a chunk pass: {said_after(costs['profile_after_chunk'])}")
    on_profile = [*sim_overrides, *profiled(csv, costs)]
    costs |= calibration_decode_scale(out / "calibration", on_profile, say)
    on_profile = profiled(csv, costs)
    fitted = calibration_shares(out / "calibration", on_profile, say)
    if fitted:  # where the servers shared one GPU; the caller's overrides come after
        say(f"shared GPU: {said_shares(fitted)}")
        sim_overrides = [*share_overrides(fitted), *sim_overrides]
    sources = (("sim_profile", on_profile), ("sim_roofline", ["cost.source=roofline"]))
    summaries: dict[str, dict[str, dict[str, Any]]] = {}
    requests: dict[str, dict[str, pd.DataFrame]] = {}
    ran: dict[str, list[dict[str, Any]]] = {}  # each cell's hw runs, all on its workload
    beyond: dict[str, tuple[int, int]] = {}  # the profile replay's passes beyond the grid
    for i, label in enumerate(labels, 1):
        ran[label] = [json.loads((d / "summary.json").read_text()) for d in hw_dirs(out, label)]
        summaries[label] = {"hw": median_summary(ran[label])}
        requests[label] = {"hw": pd.read_parquet(hw / label / "requests.parquet")}
        for source, cost in sources:
            say(f"replay {i}/{len(labels)}: {label} ({source.removeprefix('sim_')})")
            where = out / source.replace("_", "-") / label
            summary, req = replay(hw / label, [*sim_overrides, *cost], where)
            summaries[label][source], requests[label][source] = summary, req
            if summary.get("profile_passes_extrapolated"):
                beyond[label] = summary["profile_passes_extrapolated"], summary["profile_passes"]
                passes = f"{beyond[label][0]} of {beyond[label][1]}"
                say(f"replay {i}/{len(labels)}: {passes} passes beyond the profiled grid")
    table = fidelity_table(summaries)
    for line in past_saturation(requests):
        say(line)
    again: dict[str, dict[str, dict[str, Any]]] = {}
    for label, where in calibration_twins(out, labels):
        say(f"replay: {where.name}, the calibration run at {label}'s mode and load (profile)")
        summary, _ = replay(where, [*sim_overrides, *on_profile], out / "sim-repeat" / label)
        again[label] = {"hw": json.loads((where / "summary.json").read_text())}
        again[label]["sim_profile"] = summary
    repeats = repeat_table(table, fidelity_table(again)) if again else None
    if repeats is not None:
        say(f"same mode and load, another seed: sim/hw moves by up to {widest_gaps(repeats)}")
    spread = spread_table({label: runs for label, runs in ran.items() if len(runs) > 1})
    if len(spread):
        say(f"the same run again: hw moves by up to {widest_spreads(spread)}")
    own: dict[str, dict[str, dict[str, Any]]] = {}
    fits = {"calibration": {k: costs[k] for k in HOST_KEYS if k in costs}}
    for label in labels:
        host = own_host(hw_dirs(out, label))
        if host:
            fits[label] = host
            say(f"replay: {label} with its own host time (profile)")
            on_own = [*sim_overrides, *profiled(csv, costs | host)]
            summary, _ = replay(hw / label, on_own, out / "sim-own-host" / label)
            own[label] = {"hw": summaries[label]["hw"], "sim_profile": summary}
    own_table = own_host_table(table, fidelity_table(own)) if own else None
    verdicts = write_report(
        table, tolerances, out, repeats, spread, own_table, fits, beyond, requests
    )
    report = Report(table, verdicts)
    tables, shaped = {}, {}
    for label in labels:
        steps = pd.read_parquet(hw / label / "steps.parquet")
        replayed = out / "sim-profile" / label
        steps["shape_device_s"] = shape_device(steps, load_experiment(replayed))
        tables[label] = pass_table(steps, pd.read_parquet(replayed / "steps.parquet"))
        shaped[label] = steps
    pass_report(tables, out)
    report.files = [
        out / "fidelity.csv",
        out / "fidelity.md",
        out / "passes.csv",
        out / "passes.md",
        *([out / "hw_spread.csv"] if len(spread) else []),
        *([out / "own_host.csv"] if own else []),
    ]
    report.files.append(plot_ratios(table, out / "fidelity_ratios.png"))
    report.files.append(plot_cdfs(requests, out / "fidelity_cdfs.png"))
    scatter = plot_passes(shaped, out / "fidelity_passes.png")
    report.files += [scatter] if scatter else []
    return report

"""The `disagg` command line: simulate, compare, plot (and run on hardware: `disagg hw`)."""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table
from rich.text import Text

from disagg.errors import ConfigError, DisaggError

app = typer.Typer(
    no_args_is_help=True,
    add_completion=False,
    # a command's summary, hard-wrapped in its docstring, rewraps to the terminal in the list
    # of commands (the rich mode keeps every line break there)
    rich_markup_mode="markdown",
    help="Disaggregated prefill/decode LLM serving: simulate it, run it, plot it.",
)
sim_app = typer.Typer(no_args_is_help=True, help="Discrete-event simulation of a cluster.")
app.add_typer(sim_app, name="sim")
hw_app = typer.Typer(no_args_is_help=True, help="Real runs: torch/FlashInfer, tcp/cuda/verbs.")
app.add_typer(hw_app, name="hw")
console = Console()

SUMMARY_ROWS = [  # the main figures (docs/metrics.md); `sim compare --all` shows every one
    ("completed", "completed", 1),
    ("failed", "failed", 1),
    ("request_throughput", "requests/s", 1),
    ("slo", "SLO", 1),
    ("goodput_per_s", "goodput (requests/s)", 1),
    ("slo_met_fraction", "share within SLO", 1),
    ("output_throughput", "output tokens/s", 1),
    ("output_tps_per_gpu", "output tokens/s/GPU", 1),
    ("mean_ttft_ms", "TTFT mean (ms)", 1),
    ("median_ttft_ms", "TTFT p50 (ms)", 1),
    ("p99_ttft_ms", "TTFT p99 (ms)", 1),
    ("mean_tpot_ms", "TPOT mean (ms)", 1),
    ("median_tpot_ms", "TPOT p50 (ms)", 1),
    ("p99_tpot_ms", "TPOT p99 (ms)", 1),
    ("median_itl_ms", "ITL p50 (ms)", 1),
    ("p99_itl_ms", "ITL p99 (ms)", 1),
    ("p999_itl_ms", "ITL p99.9 (ms)", 1),
    ("median_e2e_ms", "E2E p50 (ms)", 1),
    ("p99_e2e_ms", "E2E p99 (ms)", 1),
    ("median_queue_ms", "queue p50 (ms)", 1),
    ("p99_queue_ms", "queue p99 (ms)", 1),
    ("p10_tps_per_user", "tokens/s/user p10", 1),
    ("median_tps_per_user", "tokens/s/user p50", 1),
    ("transfer_bytes_per_request", "transfer MB/request", 1e-6),
    ("transfer_ops_per_request", "transfer writes/request", 1),
    ("transfer_s_p50", "transfer time p50 (ms)", 1e3),
    ("nic_bytes_max", "busiest NIC: GB sent", 1e-9),
    ("nic_busy_max", "busiest NIC: busy", 1),
    ("host_share_of_pass_time", "host share of pass time", 1),
    ("gpus", "GPUs", 1),
    ("duration_s", "span s (arrival-finish)", 1),
    ("wall_s", "wall s", 1),
]


def say(text: str) -> None:
    """Print `text` as it is, unwrapped: paths, names and error messages may hold [brackets],
    which rich would read as markup."""
    console.print(text, markup=False, highlight=False, soft_wrap=True)


def fail(err: Exception) -> None:
    console.print(Text.assemble(("error:", "bold red"), f" {err}"), soft_wrap=True)
    raise typer.Exit(2)


def guarded(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Turn user errors into a message and exit code 2, without a traceback."""
    import functools

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except DisaggError as e:
            fail(e)

    return wrapper


def _fmt(value: Any, scale: float) -> str:
    if (isinstance(value, int | float) and scale != 1) or isinstance(value, float):
        v = float(value) * scale
        return "-" if v != v else f"{v:,.1f}" if abs(v) >= 10 else f"{v:.3g}"
    return str(value)


def summary_table(
    summaries: dict[str, dict[str, Any]], rows: list[tuple[str, str, float]] = SUMMARY_ROWS
) -> Table:
    table = Table(show_header=True, header_style="bold")
    table.add_column("metric", no_wrap=True)
    for name in summaries:
        table.add_column(Text(name), justify="right")
    for key, label, scale in rows:
        if any(key in s for s in summaries.values()):
            table.add_row(
                label, *(_fmt(s.get(key, float("nan")), scale) for s in summaries.values())
            )
    return table


Overrides = Annotated[
    list[str] | None,
    typer.Option(
        "--set", help="Override a setting: key.path=value (repeatable), e.g. workload.rate_per_s=4"
    ),
]
SloText = Annotated[
    str | None,
    typer.Option(
        "--slo",
        help="Objectives for goodput, e.g. ttft_ms=500,tpot_ms=50 (any of ttft_ms, tpot_ms, "
        "e2e_ms): the summary adds the requests/s that met them all",
    ),
]


def _progress(counts: str, quiet: bool = False) -> Progress:
    """A transient progress bar: the task's name, a bar, `counts` (a format of the task's
    fields) and the time elapsed."""
    return Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        TextColumn(counts),
        TimeElapsedColumn(),
        console=console,
        transient=True,
        disable=quiet,
    )


def check_out_dir(directory: Path, option: str = "--out") -> None:
    """Raise ConfigError naming `option` and `directory` unless that is a writable directory or
    can be made in one: checked before a run, not found after it."""
    existing = directory
    while not existing.exists():
        existing = existing.parent
    if existing == directory and not directory.is_dir():
        raise ConfigError(f"{option} {directory}: a file, not a directory")
    if not existing.is_dir():
        raise ConfigError(f"{option} {directory}: cannot be made, {existing} is a file")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ConfigError(f"{option} {directory}: cannot be written ({existing} is read-only)")


def run_simulation(
    experiment: Path | None,
    overrides: list[str] | None,
    out: Path | None,
    quiet: bool = False,
    slo: str | None = None,
) -> tuple[Path, dict[str, Any]]:
    """Simulate one experiment, write its tables, return (directory, summary); `slo`: the
    `--slo` text, for goodput (checked before the run)."""
    from disagg.config import check_context, load_experiment
    from disagg.core.metrics import (
        requests_table,
        steps_table,
        summarize,
        transfers_table,
        write_results,
    )
    from disagg.core.slo import Slo
    from disagg.sim.cluster import Sim
    from disagg.trace import write_trace

    objective = Slo.parse(slo) if slo is not None else None
    exp = load_experiment(experiment, overrides)
    out = out or Path("runs") / exp.name
    check_out_dir(out)
    start = time.perf_counter()
    sim = Sim(exp)
    check_context(exp, sim.arrivals)
    with _progress(
        "{task.completed}/{task.total} requests, {task.fields[t]:.0f} s simulated", quiet
    ) as bar:
        task = bar.add_task(escape(exp.name), total=len(sim.arrivals), t=0.0, visible=False)

        def progress(done: int, total: int, now_s: float) -> None:
            visible = time.perf_counter() - start > 2.0  # only runs longer than a moment
            bar.update(task, completed=done, t=now_s, visible=visible)

        sim.run(progress)
    wall = time.perf_counter() - start
    req, steps, xfers = (
        requests_table(sim.requests.values()),
        steps_table(sim.rec),
        transfers_table(sim.rec),
    )
    summary = summarize(req, steps, xfers, exp.cluster.total_gpus, wall, objective)
    summary |= sim.network_summary() | sim.fault_summary() | sim.cost_summary(steps)
    summary["experiment"] = exp.name
    write_results(out, req, steps, xfers, summary)
    (out / "experiment.json").write_text(exp.model_dump_json(indent=2) + "\n")
    write_trace(out)
    return out, summary


@sim_app.command("run")
@guarded
def sim_run(
    experiment: Annotated[
        Path | None,
        typer.Argument(
            help="Experiment TOML file, or a run directory to rerun its experiment (default: "
            "the built-in R1 1P:3D experiment)"
        ),
    ] = None,
    out: Annotated[Path | None, typer.Option(help="Result directory (default runs/NAME)")] = None,
    set_: Overrides = None,
    quiet: Annotated[bool, typer.Option(help="No progress bar or table")] = False,
    slo: SloText = None,
) -> None:
    """Simulate an experiment; print its summary and write requests/steps/transfers tables.
    Exits with 1 if any request failed (the tables are written first)."""
    out_dir, summary = run_simulation(experiment, set_, out, quiet, slo)
    if not quiet:
        console.print(summary_table({summary["experiment"]: summary}))
    failed = report_failures(out_dir)
    say(f"results in {out_dir}/ (requests, steps, transfers .parquet; summary.json)")
    if failed:
        raise typer.Exit(1)


def report_failures(run_dir: Path) -> int:
    """Say how many requests failed and why (the most common reasons), if any did; return how
    many failed."""
    import pandas as pd

    req = pd.read_parquet(run_dir / "requests.parquet", columns=["status", "fail_reason"])
    failed = req[req.status == "failed"]
    if failed.empty:
        return 0
    console.print(f"[bold yellow]{len(failed)} of {len(req)} requests failed[/]; reasons:")
    for reason, n in failed.fail_reason.value_counts().head(3).items():
        say(f"  {n} x {reason}")
    return len(failed)


@sim_app.command("compare")
@guarded
def sim_compare(
    runs: Annotated[list[Path], typer.Argument(help="Result directories")],
    slo: SloText = None,
    all_: Annotated[
        bool, typer.Option("--all", help="Every figure of the summaries, not the main ones")
    ] = False,
) -> None:
    """Print the summaries of several runs side by side; an older summary gets the newer
    figures from its run's tables, and --slo computes goodput again from them."""
    from disagg.core.metrics import read_summary
    from disagg.core.slo import Slo
    from disagg.core.summary import FIGURES

    objective = Slo.parse(slo) if slo is not None else None
    unique = len({d.name for d in runs}) == len(runs)  # short column names where they suffice
    summaries = {d.name if unique else str(d): read_summary(d, objective).fields() for d in runs}
    main = {key for key, _, _ in SUMMARY_ROWS}
    rows = SUMMARY_ROWS + [(k, k, 1.0) for k in FIGURES if k not in main] if all_ else SUMMARY_ROWS
    if objective is not None:  # one SLO for all: said once, not in every column
        say(f"goodput under the SLO {objective}")
        rows = [row for row in rows if row[0] != "slo"]
    console.print(summary_table(summaries, rows))


@sim_app.command("sweep")
@guarded
def sim_sweep(
    experiments: Annotated[
        list[Path], typer.Argument(help="Experiment TOML files or run directories")
    ],
    grid: Annotated[
        list[str] | None,
        typer.Option(
            help="A setting and its values, KEY=V1,V2,... (repeatable: every combination)"
        ),
    ] = None,
    param: Annotated[
        str | None, typer.Option(help="One setting to vary (default workload.rate_per_s)")
    ] = None,
    values: Annotated[
        str | None, typer.Option(help="Its comma-separated values (default 3,6,9,12)")
    ] = None,
    out: Annotated[Path, typer.Option(help="Directory for the runs and sweep.csv/png")] = Path(
        "runs/sweep"
    ),
    set_: Overrides = None,
    jobs: Annotated[
        int | None,
        typer.Option(min=1, help="Local processes, or --ray local's CPUs (default: one per core)"),
    ] = None,
    ray: Annotated[
        str | None,
        typer.Option(
            help="Run on a Ray cluster: auto, local (start one), ray://HOST:PORT, HOST:PORT"
        ),
    ] = None,
) -> None:
    """Run experiments over a grid of settings (load, by default): one table, one plot.
    Every point is validated before the first runs; points already in --out are kept."""
    from disagg import sweep
    from disagg.plots import plot_sweep

    axes = sweep.parse_grid(grid or [], param, values)
    points = sweep.plan(experiments, axes, set_ or [], out)
    check_out_dir(out)
    jobs = jobs or os.cpu_count() or 1
    if ray:
        from disagg.sweep_ray import ray_cluster

        executor = ray_cluster(ray, jobs)
    else:
        executor = sweep.local_processes(jobs)
    ran: list[bool] = []

    def report(
        point: sweep.Point, summary: dict[str, Any], n: int, total: int, before: bool
    ) -> None:
        ran.append(not before)
        note = " (done before)" if before else ""
        say(f"[{n}/{total}] {point.describe()}: {sweep.headline(summary)}{note}")

    df = sweep.run_sweep(points, executor, report)
    where = f"on Ray ({ray})" if ray else "here" if jobs == 1 else f"in up to {jobs} processes"
    say(f"ran {sum(ran)} of {len(points)} points {where}, {len(ran) - sum(ran)} done before")
    df.to_csv(out / "sweep.csv", index=False)
    figure = plot_sweep(df, [a.param for a in axes], out / "sweep.png")
    say(f"wrote {out / 'sweep.csv'} and {figure}")


def _hw_missing() -> None:
    try:
        import torch  # noqa: F401
        import zmq  # noqa: F401
    except ImportError as e:
        raise ConfigError(
            f"the hw backend needs torch and pyzmq: pip install -e '.[hw]' ({e})"
        ) from None


Wire = Annotated[
    str | None, typer.Option(help="KV wire (hw.wire): tcp, cuda (GPUs of one host) or verbs")
]
Attention = Annotated[
    str | None,
    typer.Option(
        help="hw.attention: auto (FlashInfer on CUDA, torch on CPU), torch, flashinfer, or "
        "flashinfer:KERNEL with KERNEL the GQA decode kernel: fa2 (default), cuda-cores, fa3"
    ),
]


def _flag_overrides(**flags: Any) -> list[str]:
    """`--set` overrides for the flags given (None: not given), each named by its field's path
    with `__` for `.` (hw__wire -> hw.wire=...)."""
    return [f"{k.replace('__', '.')}={v}" for k, v in flags.items() if v is not None]


Device = Annotated[str | None, typer.Option(help="cpu, cuda or cuda:N")]
Pages = Annotated[
    int | None, typer.Option(help="KV pages per server (kv.pages; default 512 on hw)")
]


@hw_app.command("run")
@guarded
def hw_run(
    experiment: Annotated[
        Path | None, typer.Argument(help="Experiment TOML file or run directory")
    ] = None,
    out: Annotated[Path | None, typer.Option(help="Result directory")] = None,
    set_: Overrides = None,
    wire: Wire = None,
    prefill_device: Device = None,
    decode_device: Device = None,
    pages: Pages = None,
    external: Annotated[
        list[str] | None,
        typer.Option(
            help="A server started elsewhere with `disagg hw serve` (e.g. decode0): not spawned"
        ),
    ] = None,
    bind: Annotated[str | None, typer.Option(help="Driver control socket (hw.bind)")] = None,
    attention: Attention = None,
    silent_after_s: Annotated[
        float | None,
        typer.Option(
            help="A server not heard from this long is stuck: an error (hw.silent_after_s)"
        ),
    ] = None,
    slo: SloText = None,
) -> None:
    """Run an experiment for real: a prefill and a decode process (or one colocated process)
    on local devices, the workload replayed in real time; writes the same tables as sim run.
    Every flag sets a field of the experiment's hw (or kv) table, recorded in the run's
    experiment.json."""
    _hw_missing()
    from disagg.config import check_context, load_experiment
    from disagg.core.slo import Slo
    from disagg.core.workload import generate
    from disagg.hw.driver import run_hw

    objective = Slo.parse(slo) if slo is not None else None
    flags = _flag_overrides(
        hw__wire=wire,
        hw__prefill_device=prefill_device,
        hw__decode_device=decode_device,
        kv__pages=pages,
        hw__bind=bind,
        hw__attention=attention,
        hw__silent_after_s=silent_after_s,
    )
    exp = load_experiment(experiment, [*(set_ or []), *flags])
    out = out or Path("runs") / f"hw-{exp.name}"
    check_out_dir(out)
    check_context(exp, generate(exp.workload, exp.seed, Path(exp.base_dir)))
    with _progress("{task.completed}/{task.total} requests") as bar:
        task = bar.add_task(escape(f"{exp.name} (hw, {exp.hw.wire})"), total=None)
        if external:
            say(
                f"waiting for {', '.join(external)}: start them with disagg hw serve "
                "--driver <this driver's endpoint> (printed below)"
            )

        def progress(done: int, total: int) -> None:
            bar.update(task, completed=done, total=total)

        try:
            summary, _ = run_hw(exp, out, progress, external=tuple(external or ()), slo=objective)
        except KeyboardInterrupt:
            console.print("interrupted: servers stopped")
            raise typer.Exit(130) from None
    console.print(summary_table({f"{exp.name} (hw)": summary}))
    failed = report_failures(out)
    say(f"results in {out}/")
    if failed:
        raise typer.Exit(1)


@hw_app.command("serve")
@guarded
def hw_serve(
    role: Annotated[str, typer.Option(help="prefill, decode or colocated")],
    driver: Annotated[str, typer.Option(help="The driver's control endpoint, tcp://HOST:PORT")],
    experiment: Annotated[
        Path | None, typer.Argument(help="Experiment TOML file or run directory")
    ] = None,
    set_: Overrides = None,
    index: Annotated[int, typer.Option(help="Node index within its role")] = 0,
    wire: Wire = None,
    device: Device = None,
    pages: Pages = None,
    bind: Annotated[str, typer.Option(help="Control socket to bind")] = "tcp://127.0.0.1:*",
    attention: Attention = None,
) -> None:
    """Start one node for a multi-host run (see docs/hardware.md), with all its ranks (tp x dp
    processes) on this host; it runs until the driver says stop. Give it the driver's
    experiment and settings."""
    _hw_missing()
    from disagg.config import load_experiment
    from disagg.hw.attention import parse_attention
    from disagg.hw.driver import check_hw_experiment, hw_experiment
    from disagg.hw.protocol import NodeConfig
    from disagg.hw.serve import serve_node

    if role not in ("prefill", "decode", "colocated"):
        raise ConfigError(f"--role {role!r}: use prefill, decode or colocated")
    side = "prefill" if role == "prefill" else "decode"
    flags = _flag_overrides(
        hw__wire=wire, kv__pages=pages, hw__attention=attention, **{f"hw__{side}_device": device}
    )
    exp = hw_experiment(load_experiment(experiment, [*(set_ or []), *flags]))
    parse_attention(exp.hw.attention)
    check_hw_experiment(exp)  # a node of several ranks: what `disagg hw run` checks
    serve_node(NodeConfig(role, index, exp.model_dump(mode="json"), driver, bind))


@hw_app.command("profile")
@guarded
def hw_profile(
    model: Annotated[str, typer.Option(help="Catalogue model name")] = "llama-3.1-8b",
    layers: Annotated[int | None, typer.Option(help="Cut the model to N layers")] = None,
    device: Annotated[str, typer.Option(help="cpu, cuda or cuda:N")] = "cuda",
    out: Annotated[Path, typer.Option(help="CSV to write")] = Path("runs/profile.csv"),
    attention: Attention = None,
) -> None:
    """Measure prefill and decode step times on the local device: a table the simulator's cost
    model loads with cost.source = "profile:FILE"."""
    _hw_missing()
    from disagg.hw.attention import parse_attention
    from disagg.hw.profile import profile
    from disagg.models import get_model

    attention = attention or "auto"
    parse_attention(attention)
    spec = get_model(model)
    if out.is_dir():
        raise ConfigError(f"--out {out} is a directory: give the CSV file to write")
    check_out_dir(out.parent)
    df = profile(spec, layers or spec.layers, device=device, attention=attention)
    out.parent.mkdir(parents=True, exist_ok=True)
    df.to_csv(out, index=False)
    say(f"wrote {len(df)} rows to {out}")


@app.command("plot")
@guarded
def plot(
    runs: Annotated[list[Path], typer.Argument(help="Result directories")],
    out: Annotated[
        Path,
        typer.Option(help="Figure to write (.png, .pdf, .svg, ...), or a directory: DIR/plot.png"),
    ] = Path("runs/plot.png"),
) -> None:
    """TTFT and TPOT CDFs of the runs, and per-node forward-pass timelines."""
    from disagg.plots import figure_path, plot_runs

    try:
        path = figure_path(out)
    except ConfigError as e:
        raise ConfigError(f"--out: {e}") from None
    check_out_dir(path.parent)
    say(f"wrote {plot_runs(runs, path)}")


@app.command("trace")
@guarded
def trace(
    run_dir: Annotated[Path, typer.Argument(help="Result directory of a sim or hw run")],
    out: Annotated[
        Path | None, typer.Option(help="File to write (default RUN_DIR/trace.json)")
    ] = None,
    max_requests: Annotated[
        int, typer.Option(help="Draw at most N requests: every k-th by id (0: none)")
    ] = 2000,
) -> None:
    """Write a run's Chrome/Perfetto trace: passes per node, transfers per NIC, a flow per
    request. Open it at https://ui.perfetto.dev (docs/trace.md)."""
    from disagg.trace import write_trace

    if max_requests < 0:
        raise ConfigError(f"--max-requests {max_requests}: must be 0 or more")
    if out is not None:
        if out.is_dir():
            raise ConfigError(f"--out {out} is a directory: give the JSON file to write")
        check_out_dir(out.parent)
    say(f"wrote {write_trace(run_dir, out, max_requests)}")


@app.command("catalogue")
@guarded
def catalogue_cmd(
    config: Annotated[
        list[Path] | None,
        typer.Option(help="Also list the model of this Hugging Face config.json (repeatable)"),
    ] = None,
    json_out: Annotated[
        bool, typer.Option("--json", help="Print JSON (base units) instead of tables")
    ] = False,
) -> None:
    """List the models, GPUs and NICs an experiment can name, with their derived figures."""
    import json

    from disagg.catalogue import catalogue, tables
    from disagg.hf_config import read_hf_config

    extra = [read_hf_config(p) for p in config or []]
    if json_out:
        say(json.dumps(catalogue(extra), indent=2))
        return
    for table in tables(extra):
        console.print(table)


@app.command("plan")
@guarded
def plan_cmd(
    experiment: Annotated[
        Path | None, typer.Argument(help="Base experiment TOML file or run directory")
    ] = None,
    slo: Annotated[
        str, typer.Option(help="Objectives, e.g. ttft_ms=2000,tpot_ms=50 (ttft_ms or e2e_ms)")
    ] = "ttft_ms=2000,tpot_ms=50",
    max_gpus: Annotated[
        int | None, typer.Option(help="GPU budget (default: the base experiment's GPUs)")
    ] = None,
    modes: Annotated[str, typer.Option(help="Cluster modes to try")] = "colocated,disagg",
    nodes: Annotated[str | None, typer.Option(help="Colocated node counts, e.g. 1,2,4")] = None,
    prefill_nodes: Annotated[str | None, typer.Option(help="Prefill node counts")] = None,
    decode_nodes: Annotated[str | None, typer.Option(help="Decode node counts")] = None,
    max_nodes: Annotated[int, typer.Option(help="Most nodes per pool by default")] = 8,
    vary: Annotated[
        list[str] | None,
        typer.Option(help="Also try KEY=V1,V2 (repeatable), e.g. transfer.policy=layerwise,whole"),
    ] = None,
    fraction: Annotated[
        float, typer.Option(help="Keeps up: goodput >= this share of the offered rate")
    ] = 0.9,
    probe_s: Annotated[
        float | None,
        typer.Option(help="Simulated seconds of arrivals per probe (default: the workload's)"),
    ] = None,
    rel_tol: Annotated[float, typer.Option(help="Bisection stops within this of the rate")] = 0.05,
    prune: Annotated[
        str, typer.Option(help="front: skip dominated; cost: skip all but the cheapest; none")
    ] = "front",
    jobs: Annotated[int, typer.Option(help="Parallel simulations")] = os.cpu_count() or 1,
    out: Annotated[Path, typer.Option(help="Directory for plan.csv/png and winner.json")] = Path(
        "runs/plan"
    ),
    set_: Overrides = None,
    quiet: Annotated[bool, typer.Option(help="No progress bar")] = False,
) -> None:
    """Find the configuration with the fewest GPUs per req/s of goodput under SLOs: bisect each
    configuration's highest rate that keeps up, print the Pareto front of GPUs against goodput
    and write plan.csv, plan.png and winner.json (an experiment `disagg sim run` takes)."""
    from disagg.config import load_experiment
    from disagg.core.slo import Slo
    from disagg.plan import Options, Space, parse_counts, parse_prune, parse_vary, plan

    base = load_experiment(experiment, set_)
    space = Space(
        max_gpus=max_gpus or base.cluster.total_gpus,
        modes=tuple(m.strip() for m in modes.split(",") if m.strip()),
        colocated_nodes=parse_counts("--nodes", nodes),
        prefill_nodes=parse_counts("--prefill-nodes", prefill_nodes),
        decode_nodes=parse_counts("--decode-nodes", decode_nodes),
        vary=tuple(parse_vary(v) for v in vary or []),
        max_nodes=max_nodes,
    )
    opts = Options(Slo.parse(slo), fraction, probe_s, rel_tol, prune=parse_prune(prune), jobs=jobs)
    check_out_dir(out)
    with _progress("{task.completed}/{task.total} configurations", quiet) as bar:
        task = bar.add_task(escape(f"plan {base.name}"), total=None)

        def on_space(n: int, skipped: int) -> None:
            say(f"{n} configurations to search" + (f", {skipped} skipped" if skipped else ""))
            bar.update(task, total=n)

        result = plan(base, space, opts, out, lambda d, n: bar.update(task, completed=d), on_space)
    columns = ("configuration", "GPUs", "goodput req/s", "GPUs/(req/s)", "TTFT p90", "TPOT p90")
    table = Table(*columns, title="Pareto front: GPUs against goodput (latency in ms)")
    for o in result.front:
        b = o.best
        assert b is not None  # the front kept up
        mark = " *" if o is result.winner else ""
        gpus = o.candidate.gpus
        cells = (f"{b.goodput_per_s:.3g}", f"{gpus / b.goodput_per_s:.3g}", f"{b.ttft_ms_p90:.0f}")
        table.add_row(Text(o.candidate.label + mark), str(gpus), *cells, f"{b.tpot_ms_p90:.1f}")
    console.print(table)
    for label, why in result.skipped[:3]:
        say(f"skipped {label}: {why}")
    if len(result.skipped) > 3:
        say(f"... {len(result.skipped)} configurations skipped in all (plan.csv says why)")
    w = result.winner
    good = f"{w.goodput_per_s:.3g} req/s under {opts.slo}"
    say(f"* fewest GPUs per goodput: {w.candidate.label} ({w.candidate.gpus} GPUs, {good})")
    say(f"wrote {', '.join(str(f) for f in result.files)}")


@app.command("validate")
@guarded
def validate_cmd(
    experiments: Annotated[
        list[Path] | None,
        typer.Argument(help="Experiment TOML files; one: it and its other mode (colocated/disagg)"),
    ] = None,
    device: Annotated[str, typer.Option(help="cpu or cuda:N: profiled; runs every server")] = "cpu",
    out: Annotated[Path, typer.Option(help="Directory for the runs and the report")] = Path(
        "runs/validate"
    ),
    tolerance: Annotated[
        str | None,
        typer.Option(
            help="Percent by metric, judged on the profile replay, e.g. ttft_p50=5,tpot_p50=3 "
            "(ttft_p50, ttft_p90, tpot_p50, tpot_p90, itl_p99, output_throughput): exit 1 "
            "when a cell misses"
        ),
    ] = None,
    rates: Annotated[
        str | None,
        typer.Option(help="Loads in requests/s, e.g. 2,4,6 (default: 25/50/85% of capacity)"),
    ] = None,
    requests: Annotated[
        int | None, typer.Option(min=1, help="Requests per run (workload.num_requests)")
    ] = None,
    wire: Wire = None,
    grid_points: Annotated[int, typer.Option(min=1, help="Profiled values per axis")] = 3,
    hw_runs: Annotated[
        int,
        typer.Option(
            min=1,
            help="Times each hw run is run on its workload (same seed, fresh servers): "
            "judged on their median, their spread reported",
        ),
    ] = 1,
    calibration_runs: Annotated[
        int,
        typer.Option(
            min=1,
            help="Times each loop calibration run is run (same seed, fresh servers): the "
            "serving loop's costs are the median of the repeats' fits",
        ),
    ] = 1,
    schedulers: Annotated[
        str | None,
        typer.Option(
            help="Colocated scheduler policies to run as well, at every load, each with its "
            "settings as :KEY=VALUE, e.g. prefill_first,decode_priority:chunk_with_decodes=512 "
            "(the colocated experiment under each)"
        ),
    ] = None,
    set_: Overrides = None,
    sim_set: Annotated[
        list[str] | None,
        typer.Option(help="Override a setting of the replays only (repeatable), e.g. hardware.nic"),
    ] = None,
    replay: Annotated[
        bool,
        typer.Option(
            help="--out holds an earlier validate run: replay its hw runs and rewrite the "
            "report (after a change to the simulator; no device, no experiments)"
        ),
    ] = False,
    resume: Annotated[
        bool,
        typer.Option(
            help="--out holds a validate run of the same options cut short (a device's time "
            "limit): keep what it finished (profile, calibration, each hw run with a summary) "
            "and do the rest"
        ),
    ] = False,
) -> None:
    """Say how far the simulator is from the real backend: profile the device, run the hw
    backend colocated and disaggregated at several loads, replay each run with the profile and
    with the roofline, write fidelity.csv, fidelity.md and plots."""
    from disagg.fidelity import parse_tolerances

    tolerances = parse_tolerances(tolerance)
    try:
        loads = tuple(float(r) for r in rates.split(",")) if rates is not None else None
    except ValueError:
        raise ConfigError(f"--rates {rates!r}: give comma-separated requests/s") from None
    if replay and resume:
        raise ConfigError("--replay and --resume: give one (--replay redoes only the replays)")
    if replay:
        from disagg.validate import replay_all

        if experiments or schedulers:
            raise ConfigError("--replay replays the runs in --out: give no experiments or policies")
        finish_report(replay_all(out, tolerances, sim_set or [], say))
        return
    check_out_dir(out)
    _hw_missing()
    from disagg.validate import Options, validate

    opts = Options(
        device=device,
        wire=wire,
        rates=loads,
        requests=requests,
        grid_points=grid_points,
        hw_runs=hw_runs,
        calibration_runs=calibration_runs,
        schedulers=tuple(filter(None, (schedulers or "").split(","))),
        overrides=tuple(set_ or []),
        sim_overrides=tuple(sim_set or []),
        resume=resume,
    )
    finish_report(validate(experiments or [], out, tolerances, opts, say))


def finish_report(report: Any) -> None:
    """Say what validate wrote and which cells missed; exit 1 if any did."""
    say(f"wrote {', '.join(str(f) for f in report.files)}")
    for miss in report.missed:
        say(f"missed: {miss}")
    if report.verdicts:
        say(f"{len(report.verdicts) - len(report.missed)} of {len(report.verdicts)} cells met")
    if report.missed:
        raise typer.Exit(1)


def main() -> None:  # pragma: no cover - console script entry
    app()


if __name__ == "__main__":  # pragma: no cover
    sys.exit(app())

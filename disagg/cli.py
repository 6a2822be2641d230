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
    help="Disaggregated prefill/decode LLM serving: simulate it, run it, plot it.",
)
sim_app = typer.Typer(no_args_is_help=True, help="Discrete-event simulation of a cluster.")
app.add_typer(sim_app, name="sim")
hw_app = typer.Typer(no_args_is_help=True, help="Real runs: torch/FlashInfer, tcp/cuda/verbs.")
app.add_typer(hw_app, name="hw")
console = Console()

SUMMARY_ROWS = [
    ("ttft_s_p50", "TTFT p50 (ms)", 1e3),
    ("ttft_s_p90", "TTFT p90 (ms)", 1e3),
    ("ttft_s_p99", "TTFT p99 (ms)", 1e3),
    ("tpot_s_p50", "TPOT p50 (ms)", 1e3),
    ("tpot_s_p90", "TPOT p90 (ms)", 1e3),
    ("tpot_s_p99", "TPOT p99 (ms)", 1e3),
    ("itl_s_p50", "inter-token p50 (ms)", 1e3),
    ("itl_s_p99", "inter-token p99 (ms)", 1e3),
    ("itl_s_p999", "inter-token p99.9 (ms)", 1e3),
    ("tps_per_user_p50", "tokens/s per user p50", 1),
    ("output_tps_per_gpu", "output tokens/s per GPU", 1),
    ("transfer_bytes_per_request", "transfer MB per request", 1e-6),
    ("transfer_ops_per_request", "transfer writes per request", 1),
    ("transfer_s_p50", "transfer time p50 (ms)", 1e3),
    ("nic_bytes_max", "busiest NIC: GB sent", 1e-9),
    ("nic_busy_max", "busiest NIC: busy", 1),
    ("host_share_of_pass_time", "passes: host share of wall time", 1),
    ("completed", "completed", 1),
    ("failed", "failed", 1),
    ("gpus", "GPUs", 1),
    ("simulated_s", "simulated s", 1),
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


def summary_table(summaries: dict[str, dict[str, Any]]) -> Table:
    table = Table(show_header=True, header_style="bold")
    table.add_column("metric")
    for name in summaries:
        table.add_column(Text(name), justify="right")
    for key, label, scale in SUMMARY_ROWS:
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
    experiment: Path | None, overrides: list[str] | None, out: Path | None, quiet: bool = False
) -> tuple[Path, dict[str, Any]]:
    """Simulate one experiment, write its tables, return (directory, summary)."""
    from disagg.config import check_context, load_experiment
    from disagg.core.metrics import (
        requests_table,
        steps_table,
        summarize,
        transfers_table,
        write_results,
    )
    from disagg.sim.cluster import Sim

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
    summary = summarize(req, steps, xfers, exp.cluster.total_gpus, wall)
    summary |= sim.network_summary() | sim.fault_summary()
    summary["experiment"] = exp.name
    write_results(out, req, steps, xfers, summary)
    (out / "experiment.json").write_text(exp.model_dump_json(indent=2) + "\n")
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
) -> None:
    """Simulate an experiment; print its summary and write requests/steps/transfers tables.
    Exits with 1 if any request failed (the tables are written first)."""
    out_dir, summary = run_simulation(experiment, set_, out, quiet)
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
def sim_compare(runs: Annotated[list[Path], typer.Argument(help="Result directories")]) -> None:
    """Print the summaries of several runs side by side."""
    from disagg.core.metrics import read_results

    console.print(summary_table({str(d): read_results(d)[3] for d in runs}))


@sim_app.command("sweep")
@guarded
def sim_sweep(
    experiments: Annotated[
        list[Path], typer.Argument(help="Experiment TOML files or run directories")
    ],
    param: Annotated[str, typer.Option(help="Setting to vary")] = "workload.rate_per_s",
    values: Annotated[str, typer.Option(help="Comma-separated values")] = "3,6,9,12",
    out: Annotated[Path, typer.Option(help="Directory for the runs and sweep.csv/png")] = Path(
        "runs/sweep"
    ),
    set_: Overrides = None,
) -> None:
    """Run experiments over a range of one setting (load, by default): one table, one plot.
    Every point is validated before the first runs."""
    import pandas as pd

    from disagg.plots import plot_sweep

    points = _sweep_points(experiments, param, values, set_ or [])
    check_out_dir(out)
    rows = []
    for exp_path in experiments:
        for v in points:
            run_dir = out / f"{exp_path.stem}-{param.rsplit('.', 1)[-1]}-{v}"
            _, summary = run_simulation(
                exp_path, [*(set_ or []), f"{param}={v}"], run_dir, quiet=True
            )
            rows.append({"experiment": exp_path.stem, param: _number_or_text(v), **summary})
            say(
                f"{exp_path.stem} {param}={v}: TTFT p50 "
                f"{summary['ttft_s_p50'] * 1e3:.0f} ms, TPOT p50 "
                f"{summary['tpot_s_p50'] * 1e3:.1f} ms"
            )
    df = pd.DataFrame(rows)
    df.to_csv(out / "sweep.csv", index=False)
    say(f"wrote {out / 'sweep.csv'} and {plot_sweep(df, param, out / 'sweep.png')}")


def _sweep_points(experiments: list[Path], param: str, values: str, sets: list[str]) -> list[str]:
    """The values of `--values`, each checked against every experiment (the experiment with
    `param=value` must validate): a bad value is an error before any point runs."""
    from disagg.config import load_experiment

    points = [v.strip() for v in values.split(",") if v.strip()]
    if not points:
        raise ConfigError(f"--values {values!r}: no values to sweep {param} over (e.g. 3,6,9)")
    for exp_path in experiments:
        for v in points:
            try:
                load_experiment(exp_path, [*sets, f"{param}={v}"])
            except ConfigError as e:
                raise ConfigError(f"--values: {v!r} is not a valid {param}: {e}") from None
    return points


def _number_or_text(value: str) -> float | str:
    """A swept value as the table keeps it: a number (plotted on a numeric axis) or the text
    of a choice (`--param transfer.handoff --values decode-first,parallel`)."""
    try:
        return float(value)
    except ValueError:
        return value


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
) -> None:
    """Run an experiment for real: a prefill and a decode process (or one colocated process)
    on local devices, the workload replayed in real time; writes the same tables as sim run.
    Every flag sets a field of the experiment's [hw] (or [kv]) table, recorded in the run's
    experiment.json."""
    _hw_missing()
    from disagg.config import check_context, load_experiment
    from disagg.core.workload import generate
    from disagg.hw.driver import run_hw

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
            summary, _ = run_hw(exp, out, progress, external=tuple(external or ()))
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
    """Start one server for a multi-host run (see docs/hardware.md); it runs until the driver
    says stop. Give it the driver's experiment and settings."""
    _hw_missing()
    from disagg.config import load_experiment
    from disagg.hw.attention import parse_attention
    from disagg.hw.driver import hw_experiment
    from disagg.hw.protocol import NodeConfig
    from disagg.hw.serve import serve

    if role not in ("prefill", "decode", "colocated"):
        raise ConfigError(f"--role {role!r}: use prefill, decode or colocated")
    side = "prefill" if role == "prefill" else "decode"
    flags = _flag_overrides(
        hw__wire=wire, kv__pages=pages, hw__attention=attention, **{f"hw__{side}_device": device}
    )
    exp = hw_experiment(load_experiment(experiment, [*(set_ or []), *flags]))
    parse_attention(exp.hw.attention)
    serve(NodeConfig(role, index, exp.model_dump(mode="json"), driver, bind))


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


def main() -> None:  # pragma: no cover - console script entry
    app()


if __name__ == "__main__":  # pragma: no cover
    sys.exit(app())

"""Sweeps: a grid of settings run over experiments, one table for all points.

A sweep is planned (every point expanded and validated before any runs), then run by an
executor: in this process, in local processes (`jobs`), or on a Ray cluster
(disagg.sweep_ray). Each point writes
its run directory and, last, a `point.json` naming its experiment and overrides; a point whose
directory already holds a complete result of the same experiment and overrides is not run
again, so an interrupted sweep resumes where it stopped. The table is built from the points'
`summary.json` files in the grid's order, so it does not depend on the executor.
"""

from __future__ import annotations

import itertools
import json
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd

from disagg.errors import ConfigError

DEFAULT_PARAM = "workload.rate_per_s"
DEFAULT_VALUES = "3,6,9,12"
POINT_FILE = "point.json"


@dataclass(frozen=True)
class Axis:
    """One swept setting: a dotted key and its values (as text, in the order given); `option`
    names the command-line option it came from, for error messages."""

    param: str
    values: tuple[str, ...]
    option: str = "--grid"


@dataclass(frozen=True)
class Point:
    """One run of a sweep: an experiment with the sweep's `--set` overrides and one value per
    axis. `experiment_json` is the validated experiment as its run writes it (for resume)."""

    experiment: Path
    label: str
    settings: tuple[tuple[str, str], ...]
    base_overrides: tuple[str, ...]
    run_dir: Path
    experiment_json: str

    @property
    def overrides(self) -> list[str]:
        return [*self.base_overrides, *(f"{p}={v}" for p, v in self.settings)]

    @property
    def record(self) -> dict[str, Any]:
        """What `point.json` holds: the experiment and overrides this result is of."""
        return {"experiment": str(self.experiment), "overrides": self.overrides}

    def describe(self) -> str:
        return f"{self.label} " + " ".join(f"{p}={v}" for p, v in self.settings)


def parse_axis(param: str, values: str, option: str = "--values", given: str = "") -> Axis:
    """An axis from a key and comma-separated values; ConfigError naming `option` and what was
    `given` to it (default: `values`) if there are none."""
    points = tuple(v.strip() for v in values.split(",") if v.strip())
    if not points:
        shown = given or values
        raise ConfigError(f"{option} {shown!r}: no values to sweep {param} over (e.g. 3,6,9)")
    return Axis(param.strip(), points, option)


def parse_grid(specs: list[str], param: str | None = None, values: str | None = None) -> list[Axis]:
    """The axes of a sweep: `--param/--values` (if either is given) first, then each `--grid
    KEY=V1,V2,...` in order; the default (`workload.rate_per_s` over 3,6,9,12) when none is."""
    axes = []
    if param is not None or values is not None or not specs:
        axes.append(
            parse_axis(param or DEFAULT_PARAM, DEFAULT_VALUES if values is None else values)
        )
    for spec in specs:
        key, sep, vals = spec.partition("=")
        if not sep or not key.strip():
            raise ConfigError(
                f"--grid {spec!r}: expected KEY=V1,V2,... (e.g. workload.rate_per_s=2,4)"
            )
        axes.append(parse_axis(key, vals, "--grid", spec))
    swept = [a.param for a in axes]
    for p in swept:
        if swept.count(p) > 1:
            raise ConfigError(f"--grid: {p} is swept twice; give each setting once")
    return axes


def short_names(params: list[str]) -> list[str]:
    """The shortest dotted suffix of each key that no other key ends with (`rate_per_s`, and
    `prefill.nodes`/`decode.nodes` for two `nodes`): how run directories are named."""
    parts = [p.split(".") for p in params]
    names = []
    for mine in parts:
        n = 1
        while n < len(mine) and any(o != mine and o[-n:] == mine[-n:] for o in parts):
            n += 1
        names.append(".".join(mine[-n:]))
    return names


def _safe(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._=-]", "_", text)


def plan(experiments: list[Path], axes: list[Axis], sets: list[str], out: Path) -> list[Point]:
    """Every point of the sweep, experiment by experiment, then in the grid's order (the last
    axis varies fastest), each validated: a bad value is a ConfigError before any point runs."""
    from disagg.config import load_experiment

    names = short_names([a.param for a in axes])
    points = []
    for exp_path in experiments:
        for combo in itertools.product(*(a.values for a in axes)):
            settings = tuple(zip((a.param for a in axes), combo, strict=True))
            tail = "-".join(f"{n}-{v}" for n, v in zip(names, combo, strict=True))
            overrides = [*sets, *(f"{p}={v}" for p, v in settings)]
            try:
                exp = load_experiment(exp_path, overrides)
            except ConfigError as e:
                raise _point_error(axes, settings, exp_path, e) from None
            points.append(
                Point(
                    exp_path.resolve(),
                    exp_path.stem,
                    settings,
                    tuple(sets),
                    (out / _safe(f"{exp_path.stem}-{tail}")).resolve(),
                    exp.model_dump_json(indent=2) + "\n",
                )
            )
    dirs = [p.run_dir for p in points]
    for d in dirs:
        if dirs.count(d) > 1:
            raise ConfigError(f"--out: two points of the sweep would both write {d}")
    return points


def _point_error(
    axes: list[Axis], settings: tuple[tuple[str, str], ...], exp_path: Path, e: ConfigError
) -> ConfigError:
    if len(axes) == 1:
        param, value = settings[0]
        return ConfigError(f"{axes[0].option}: {value!r} is not a valid {param}: {e}")
    where = ", ".join(f"{p}={v}" for p, v in settings)
    return ConfigError(f"--grid: the point {where} of {exp_path} is not valid: {e}")


def is_done(point: Point) -> bool:
    """Whether `point.run_dir` holds a complete result of this very point: its `point.json`
    (written last) records the same experiment and overrides, its experiment.json is the same
    experiment, and its summary.json is there."""
    d = point.run_dir
    try:
        same = json.loads((d / POINT_FILE).read_text()) == point.record
        return (
            same
            and (d / "experiment.json").read_text() == point.experiment_json
            and (isinstance(json.loads((d / "summary.json").read_text()), dict))
        )
    except (OSError, ValueError):
        return False


def read_summary(point: Point) -> dict[str, Any]:
    summary: dict[str, Any] = json.loads((point.run_dir / "summary.json").read_text())
    return summary


def run_point(point: Point) -> dict[str, Any]:
    """Simulate one point into its run directory, record it, and return its summary as
    summary.json holds it (the same whether the point ran now or before)."""
    from disagg.cli import run_simulation

    (point.run_dir / POINT_FILE).unlink(missing_ok=True)
    run_simulation(point.experiment, point.overrides, point.run_dir, quiet=True)
    (point.run_dir / POINT_FILE).write_text(json.dumps(point.record, indent=2) + "\n")
    return read_summary(point)


Executor = Callable[[list[Point]], Iterator[tuple[Point, dict[str, Any]]]]
OnPoint = Callable[[Point, dict[str, Any], int, int, bool], None]


def in_process(points: list[Point]) -> Iterator[tuple[Point, dict[str, Any]]]:
    """Run the points one after another in this process."""
    for p in points:
        yield p, run_point(p)


def local_processes(jobs: int) -> Executor:
    """An executor over `jobs` fresh local processes (spawned, so no state is inherited);
    points are yielded as they finish. The first failure stops the sweep."""

    def run(points: list[Point]) -> Iterator[tuple[Point, dict[str, Any]]]:
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor, as_completed

        if jobs == 1 or len(points) <= 1:
            yield from in_process(points)
            return
        ctx = multiprocessing.get_context("spawn")
        with ProcessPoolExecutor(min(jobs, len(points)), mp_context=ctx) as pool:
            futures = {pool.submit(run_point, p): p for p in points}
            try:
                for f in as_completed(futures):
                    yield futures[f], f.result()
            finally:
                pool.shutdown(cancel_futures=True)

    return run


def run_sweep(points: list[Point], executor: Executor, on_point: OnPoint) -> pd.DataFrame:
    """Run the points not already done with `executor`, calling `on_point(point, summary,
    finished, total, ran_before)` for each (the done ones first); return the table, one row per
    point in `points`' order: the experiment, one column per swept setting, its summary."""
    summaries: dict[Path, dict[str, Any]] = {}
    todo = []
    for p in points:
        if is_done(p):
            summaries[p.run_dir] = read_summary(p)
            on_point(p, summaries[p.run_dir], len(summaries), len(points), True)
        else:
            todo.append(p)
    for p, summary in executor(todo):
        summaries[p.run_dir] = summary
        on_point(p, summary, len(summaries), len(points), False)
    rows = [
        {
            "experiment": p.label,
            **{k: number_or_text(v) for k, v in p.settings},
            **_flat(summaries[p.run_dir]),
        }
        for p in points
    ]
    return pd.DataFrame(rows)


def number_or_text(value: str) -> float | str:
    """A swept value as the table keeps it: a number (plotted on a numeric axis) or the text
    of a choice (`--param transfer.handoff --values decode-first,parallel`)."""
    try:
        return float(value)
    except ValueError:
        return value


def _flat(summary: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """A summary as one table row: nested sections become `section.key` columns."""
    row: dict[str, Any] = {}
    for k, v in summary.items():
        if isinstance(v, dict):
            row |= _flat(v, f"{prefix}{k}.")
        else:
            row[f"{prefix}{k}"] = v
    return row


def headline(summary: dict[str, Any]) -> str:
    """A point's result in a few words: median TTFT and TPOT."""
    parts = []
    for name, digits in (("ttft", 0), ("tpot", 1)):
        ms = summary.get(f"median_{name}_ms", summary.get(f"{name}_s_p50", float("nan")) * 1e3)
        parts.append(f"{name.upper()} p50 {float(ms):.{digits}f} ms")
    return ", ".join(parts)

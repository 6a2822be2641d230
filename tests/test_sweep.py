"""Sweeps over a grid: one table in the grid's order, the same in parallel, on Ray and in one
process, resumed where it stopped, and every point checked before the first runs."""

from __future__ import annotations

import shutil
from pathlib import Path

import pandas as pd
import pytest
from typer.testing import CliRunner

from disagg import sweep
from disagg.cli import app
from disagg.errors import ConfigError
from disagg.plots import sweep_figure

EXPERIMENTS = Path(__file__).parents[1] / "experiments"
TINY = str(EXPERIMENTS / "tiny-disagg.toml")
GRID = ["--grid", "workload.rate_per_s=5,10", "--grid", "cluster.decode.nodes=1,2"]
runner = CliRunner()


def run_sweep(out: Path, *args: str) -> str:
    res = runner.invoke(app, ["sim", "sweep", TINY, *args, "--out", str(out)])
    assert res.exit_code == 0, res.output
    return res.output


def table(out: Path) -> pd.DataFrame:
    """sweep.csv without its wall-clock column (the one figure a rerun may change)."""
    return pd.read_csv(out / "sweep.csv").drop(columns="wall_s")


def test_a_grid_is_one_table_in_the_grids_order_the_same_in_parallel_as_in_sequence(
    tmp_path: Path,
) -> None:
    run_sweep(tmp_path / "seq", *GRID, "--jobs", "1")
    output = run_sweep(tmp_path / "par", *GRID, "--jobs", "2")
    df = table(tmp_path / "par")
    assert df[["workload.rate_per_s", "cluster.decode.nodes"]].values.tolist() == [
        [5, 1], [5, 2], [10, 1], [10, 2]  # the last setting varies fastest
    ]  # fmt: skip
    assert df.gpus.tolist() == [2, 3, 2, 3]  # 1 prefill GPU + 1 per decode node
    assert (df.experiment == "tiny-disagg").all() and (df.completed == 20).all()
    pd.testing.assert_frame_equal(df, table(tmp_path / "seq"), check_exact=True)
    for name in ("rate_per_s-5-nodes-1", "rate_per_s-10-nodes-2"):
        requests = [pd.read_parquet(tmp_path / d / f"tiny-disagg-{name}" / "requests.parquet")
                    for d in ("seq", "par")]  # fmt: skip
        pd.testing.assert_frame_equal(*requests, check_exact=True)
    lines = output.splitlines()
    assert sorted(line[:5] for line in lines[:4]) == ["[1/4]", "[2/4]", "[3/4]", "[4/4]"]
    assert "tiny-disagg workload.rate_per_s=10 cluster.decode.nodes=2: TTFT p50 " in output
    assert "ran 4 of 4 points in up to 2 processes, 0 done before" in output
    assert (tmp_path / "par" / "sweep.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_an_interrupted_sweep_reruns_only_the_points_without_a_result(tmp_path: Path) -> None:
    out = tmp_path / "s"
    run_sweep(out, *GRID, "--jobs", "1")
    first = table(out)
    (out / "tiny-disagg-rate_per_s-10-nodes-1" / "summary.json").unlink()
    output = run_sweep(out, *GRID, "--jobs", "2")
    assert "ran 1 of 4 points in up to 2 processes, 3 done before" in output
    ran = [line for line in output.splitlines() if line.startswith("[")]
    assert [line.endswith("(done before)") for line in ran] == [True, True, True, False]
    assert "workload.rate_per_s=10 cluster.decode.nodes=1: " in ran[-1]
    pd.testing.assert_frame_equal(table(out), first, check_exact=True)


def test_a_result_of_other_overrides_or_another_experiment_is_not_reused(
    tmp_path: Path,
) -> None:
    exp = tmp_path / "tiny-disagg.toml"
    shutil.copy(TINY, exp)
    out = tmp_path / "s"
    args = ["sim", "sweep", str(exp), "--values", "5,10", "--out", str(out), "--jobs", "1"]
    assert runner.invoke(app, args).exit_code == 0
    res = runner.invoke(app, [*args, "--set", "workload.num_requests=10"])
    assert "ran 2 of 2 points" in res.output, res.output
    assert (pd.read_csv(out / "sweep.csv").completed == 10).all()
    exp.write_text(exp.read_text().replace("num_requests = 20", "num_requests = 12"))
    res = runner.invoke(app, args)
    assert "ran 2 of 2 points" in res.output, res.output
    assert (pd.read_csv(out / "sweep.csv").completed == 12).all()
    assert "ran 0 of 2 points" in runner.invoke(app, args).output


def test_every_point_is_checked_before_the_first_runs(tmp_path: Path) -> None:
    out = tmp_path / "s"
    for args, message in (
        (["--grid", "workload.rate_per_s"], "--grid 'workload.rate_per_s': expected KEY=V1,V2"),
        (["--grid", "workload.rate_per_s= ,"], "--grid 'workload.rate_per_s= ,': no values to "
         "sweep workload.rate_per_s over"),
        (["--values", "1", "--grid", "workload.rate_per_s=2"],
         "--grid: workload.rate_per_s is swept twice"),
        (["--grid", "workload.rate_per_s=5", "--grid", "cluster.decode.nodes=1,0"],
         f"--grid: the point workload.rate_per_s=5, cluster.decode.nodes=0 of {Path(TINY)} is "
         "not valid: "),
        (["--grid", "cluster.decode.nodes=1,0"], "--grid: '0' is not a valid cluster.decode.nodes"),
        (["--jobs", "0"], "Invalid value for '--jobs'"),
    ):  # fmt: skip
        res = runner.invoke(app, ["sim", "sweep", TINY, *args, "--out", str(out)])
        assert res.exit_code == 2, (args, res.output)
        assert message in " ".join(res.output.split()), (args, res.output)
        assert not out.exists()  # not one point ran


def test_points_that_would_share_a_run_directory_are_refused(tmp_path: Path) -> None:
    other = tmp_path / "tiny-disagg.toml"
    shutil.copy(TINY, other)
    axes = sweep.parse_grid([], "workload.rate_per_s", "5")
    with pytest.raises(
        ConfigError, match=r"two points of the sweep would both write .*rate_per_s-5"
    ):
        sweep.plan([Path(TINY), other], axes, [], tmp_path / "s")


def test_run_directories_are_named_by_the_shortest_distinct_key_suffix() -> None:
    keys = ["workload.rate_per_s", "cluster.prefill.nodes", "cluster.decode.nodes"]
    assert sweep.short_names(keys) == ["rate_per_s", "prefill.nodes", "decode.nodes"]
    assert sweep.short_names(["a.x", "b.a.x"]) == ["a.x", "b.a.x"]


def test_param_and_values_come_first_and_are_the_default_sweep() -> None:
    assert sweep.parse_grid([]) == [sweep.Axis("workload.rate_per_s", ("3", "6", "9", "12"),
                                               "--values")]  # fmt: skip
    axes = sweep.parse_grid(["cluster.decode.nodes=1, 2"], "transfer.handoff", "parallel")
    assert [(a.param, a.values) for a in axes] == [
        ("transfer.handoff", ("parallel",)), ("cluster.decode.nodes", ("1", "2"))
    ]  # fmt: skip


def test_the_plot_has_one_line_per_experiment_and_other_settings() -> None:
    df = pd.DataFrame(
        {"experiment": ["a"] * 4 + ["b"] * 4, "rate": [1.0, 2.0] * 4,
         "nodes": [1.0, 1.0, 2.0, 2.0] * 2, "ttft_s_p50": range(8), "tpot_s_p50": range(8)}
    )  # fmt: skip
    fig = sweep_figure(df, ["rate", "nodes"])
    assert len(fig.axes) == 2  # the metrics the table has
    labels = [line.get_label() for line in fig.axes[0].get_lines()]
    assert labels == ["a, nodes=1", "a, nodes=2", "b, nodes=1", "b, nodes=2"]
    assert fig.axes[0].get_lines()[1].get_ydata().tolist() == [2e3, 3e3]  # ms
    one = sweep_figure(df[df.experiment == "a"], ["rate", "nodes"])
    assert [line.get_label() for line in one.axes[0].get_lines()] == ["nodes=1", "nodes=2"]


def test_an_unreachable_ray_address_is_an_error_naming_it(tmp_path: Path) -> None:
    for address, message in (
        ("127.0.0.1:1", "error: --ray 127.0.0.1:1: cannot reach 127.0.0.1:1 (Connection refused"),
        ("ray://127.0.0.1:1", "error: --ray ray://127.0.0.1:1: cannot reach 127.0.0.1:1"),
        ("nowhere", "error: --ray 'nowhere': not an address (auto, local, ray://HOST:PORT"),
    ):
        res = runner.invoke(app, ["sim", "sweep", TINY, "--ray", address, "--out",
                                  str(tmp_path / "s")])  # fmt: skip
        assert res.exit_code == 2, res.output
        assert message in res.output and "Traceback" not in res.output
        assert not list((tmp_path / "s").glob("*/summary.json"))


def test_a_sweep_on_a_local_ray_cluster_of_two_workers_equals_the_local_one(
    tmp_path: Path,
) -> None:
    pytest.importorskip("ray", reason="ray is not installed (pip install -e '.[ray]')")
    args = ["--values", "5,10", "--set", "workload.num_requests=10"]
    run_sweep(tmp_path / "local", *args, "--jobs", "1")
    output = run_sweep(tmp_path / "ray", *args, "--ray", "local", "--jobs", "2")
    assert "ran 2 of 2 points on Ray (local), 0 done before" in output
    pd.testing.assert_frame_equal(table(tmp_path / "ray"), table(tmp_path / "local"),
                                  check_exact=True)  # fmt: skip

"""The command line, run as a user would: real files out, clear errors, exit codes."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from typer.testing import CliRunner

from disagg.cli import app
from disagg.config import load_experiment
from disagg.core.metrics import STEP_COLUMNS, TRANSFER_COLUMNS
from disagg.core.workload import generate

runner = CliRunner()
EXPERIMENTS = Path(__file__).parent.parent / "experiments"


def test_sim_run_writes_the_tables_and_summary(tmp_path: Path) -> None:
    """The built-in R1 1P:3D experiment for 15 s: the tables hold the workload's requests, all
    finished with consistent timestamps, and the summary is computed from those tables."""
    out = tmp_path / "run"
    res = runner.invoke(app, ["sim", "run", "--out", str(out), "--set", "workload.duration_s=15"])
    assert res.exit_code == 0, res.output
    assert "TTFT p50" in res.output and "results in" in res.output
    exp = load_experiment(None, ["workload.duration_s=15"])
    arrivals = generate(exp.workload, exp.seed)
    assert len(arrivals) > 20  # about 3 per second
    req = pd.read_parquet(out / "requests.parquet")
    assert req.request_id.tolist() == [a.request_id for a in arrivals]
    assert req.arrival_s.tolist() == [a.arrival_s for a in arrivals]
    assert req.prompt_tokens.tolist() == [a.prompt_tokens for a in arrivals]
    assert req.output_tokens.tolist() == [a.output_tokens for a in arrivals]
    assert (req.status == "finished").all() and (req.attempts == 1).all()
    # one prefill node, three decode nodes; each stage after the one before
    assert set(req.prefill_node) == {0} and set(req.decode_node) <= {0, 1, 2}
    for earlier, later in (
        ("arrival_s", "prefill_start_s"),
        ("prefill_start_s", "prefill_end_s"),
        ("prefill_end_s", "ready_s"),
        ("ready_s", "first_token_s"),
        ("first_token_s", "finish_s"),
    ):
        assert (req[later] > req[earlier]).all(), (earlier, later)
    np.testing.assert_allclose(req.ttft_s, req.first_token_s - req.arrival_s, rtol=1e-12)
    tpot = (req.finish_s - req.first_token_s) / (req.output_tokens - 1)
    np.testing.assert_allclose(req.tpot_s, tpot, rtol=1e-12)

    steps = pd.read_parquet(out / "steps.parquet")
    assert list(steps.columns) == STEP_COLUMNS
    assert (steps.duration_s > 0).all() and (steps.steps >= 1).all()
    assert set(steps.node) == {"prefill0", "decode0", "decode1", "decode2"}
    # every prompt token but the last (the decoder's first pass) is prefilled once
    prefill = steps[steps.node == "prefill0"]
    assert (prefill.decode_seqs == 0).all()
    assert int((prefill.steps * prefill.prefill_tokens).sum()) == int((req.prompt_tokens - 1).sum())
    assert (steps[steps.node != "prefill0"].prefill_tokens == 0).all()

    xfers = pd.read_parquet(out / "transfers.parquet")
    assert list(xfers.columns) == TRANSFER_COLUMNS
    assert xfers.request_id.tolist() == req.request_id.tolist()  # one transfer per request
    assert (xfers.decode_node == req.decode_node).all()
    assert (xfers.bytes > 0).all() and (xfers.ops > 0).all()
    assert (xfers.start_s >= req.prefill_start_s).all()
    np.testing.assert_allclose(xfers.end_s, req.ready_s, rtol=1e-12)  # ready: all landed

    summary = json.loads((out / "summary.json").read_text())
    assert (summary["completed"], summary["failed"], summary["unfinished"]) == (len(req), 0, 0)
    assert summary["gpus"] == 4 * 8  # 1 + 3 nodes of TP 8
    assert summary["simulated_s"] == req.finish_s.max()
    assert summary["ttft_s_p50"] == pytest.approx(float(np.median(req.ttft_s)), rel=1e-12)
    assert summary["tpot_s_p50"] == pytest.approx(float(np.median(req.tpot_s)), rel=1e-12)
    tokens_per_gpu_s = req.output_tokens.sum() / req.finish_s.max() / 32
    assert summary["output_tps_per_gpu"] == pytest.approx(tokens_per_gpu_s, rel=1e-12)
    assert summary["transfer_bytes_per_request"] == pytest.approx(xfers.bytes.mean(), rel=1e-12)
    assert summary["itl_s_p50"] > 0 and summary["itl_s_p50"] <= summary["itl_s_p999"]


def test_compare_and_plot(tmp_path: Path) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    for d, f in ((a, "r1-colocated.toml"), (b, "r1-disagg-1p3d.toml")):
        res = runner.invoke(
            app,
            [
                "sim",
                "run",
                str(EXPERIMENTS / f),
                "--out",
                str(d),
                "--quiet",
                "--set",
                "workload.duration_s=15",
            ],
        )
        assert res.exit_code == 0, res.output
    res = runner.invoke(app, ["sim", "compare", str(a), str(b)])
    assert res.exit_code == 0 and "TPOT p50" in res.output
    png = tmp_path / "p.png"
    res = runner.invoke(app, ["plot", str(a), str(b), "--out", str(png)])
    assert res.exit_code == 0, res.output
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 20_000


def test_sim_run_of_a_run_directory_reruns_its_experiment(tmp_path: Path) -> None:
    """A run directory (the sim's or the hardware's) names the experiment it ran: simulating it
    again gives the same results, and overrides still apply on top."""
    first = tmp_path / "first"
    args = ["--set", "workload.duration_s=10", "--set", "cluster.decode.max_batch=32"]
    res = runner.invoke(
        app, ["sim", "run", str(EXPERIMENTS / "tiny-disagg.toml"), "--out", str(first), *args]
    )
    assert res.exit_code == 0, res.output
    again = tmp_path / "again"
    res = runner.invoke(app, ["sim", "run", str(first), "--out", str(again), "--quiet"])
    assert res.exit_code == 0, res.output
    a, b = (json.loads((d / "experiment.json").read_text()) for d in (first, again))
    assert a == b and a["cluster"]["decode"]["max_batch"] == 32
    pd.testing.assert_frame_equal(
        pd.read_parquet(first / "requests.parquet"), pd.read_parquet(again / "requests.parquet")
    )
    changed = tmp_path / "changed"
    rerun = ["sim", "run", str(first / "experiment.json"), "--out", str(changed), "--quiet"]
    res = runner.invoke(app, [*rerun, "--set", "workload.rate_per_s=1"])
    assert res.exit_code == 0, res.output
    fewer = pd.read_parquet(changed / "requests.parquet")
    assert 0 < len(fewer) < len(pd.read_parquet(first / "requests.parquet"))
    c = json.loads((changed / "experiment.json").read_text())
    assert c["workload"].pop("rate_per_s") == 1 and a["workload"].pop("rate_per_s") != 1
    assert c == a  # the run's other settings kept, the first run's overrides included


def test_user_errors_exit_2_without_a_traceback(tmp_path: Path) -> None:
    cases = [
        ["sim", "run", "--set", "workload.rate_per_s=-2"],
        ["sim", "run", str(tmp_path / "nope.toml")],
        ["sim", "compare", str(tmp_path)],
        ["sim", "run", "--set", "cluster.decode.tp=3"],
    ]
    for args in cases:
        proc = subprocess.run(
            [sys.executable, "-m", "disagg.cli", *args], capture_output=True, text=True, timeout=60
        )
        assert proc.returncode == 2, (args, proc.stdout, proc.stderr)
        assert "error:" in proc.stdout and "Traceback" not in proc.stdout + proc.stderr


def test_failed_requests_are_reported_with_their_reason(tmp_path: Path) -> None:
    res = runner.invoke(app, [
        "sim", "run", "--out", str(tmp_path / "f"), "--quiet",
        "--set", "workload.duration_s=5", "--set", "model.name=llama-3.1-8b",
        "--set", "model.weight_dtype=bf16", "--set", "cluster.prefill.tp=1",
        "--set", "cluster.decode.tp=1", "--set", "hardware.gpu=H100-SXM",
        "--set", "kv.memory_fraction=0.3", "--set", "kv.activation_reserve_gb=7.5",
        "--set", "workload.prompt_tokens.low=9000", "--set", "workload.prompt_tokens.high=9000",
    ])  # fmt: skip
    assert res.exit_code == 1, res.output  # a run with failed requests is not a success
    assert "12 of 12 requests failed" in res.output and "KV pages on decode node" in res.output
    assert "results in" in res.output and res.exception is not None  # SystemExit, no traceback
    assert (pd.read_parquet(tmp_path / "f" / "requests.parquet").status == "failed").all()


def test_sim_sweep_over_numbers_and_over_choices(tmp_path: Path) -> None:
    """One row per experiment and value in sweep.csv, numbers kept as numbers and choices
    (the handoff) as text, and the figure written."""
    args = ["sim", "sweep", str(EXPERIMENTS / "qwen3coder-disagg-1p3d.toml"), "--set"]
    short = [*args, "workload.duration_s=15", "--set", "transfer.control_latency_s=0.005"]
    res = runner.invoke(
        app, [*short, "--param", "transfer.handoff", "--values", "decode-first,parallel",
              "--out", str(tmp_path / "h")],
    )  # fmt: skip
    assert res.exit_code == 0, res.output
    df = pd.read_csv(tmp_path / "h" / "sweep.csv")
    assert df["transfer.handoff"].tolist() == ["decode-first", "parallel"]
    # parallel handoff takes the decoder's 5 ms control hop (and its wait for its pass in
    # flight) off the prefill's start: TTFT p50 gains (test_sim says by how much)
    assert df.ttft_s_p50[0] - df.ttft_s_p50[1] > 0.0005
    assert (tmp_path / "h" / "sweep.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    res = runner.invoke(
        app, [*short, "--param", "workload.rate_per_s", "--values", "1,2",
              "--out", str(tmp_path / "r")],
    )  # fmt: skip
    assert res.exit_code == 0, res.output
    rates = pd.read_csv(tmp_path / "r" / "sweep.csv", dtype=str)["workload.rate_per_s"]
    assert rates.tolist() == ["1.0", "2.0"]  # written as numbers, not the text given


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    """`disagg ARGS` in a fresh process, as a user runs it."""
    return subprocess.run(
        [sys.executable, "-m", "disagg.cli", *args], capture_output=True, text=True, timeout=120
    )


def test_error_text_is_printed_as_it_is_not_as_markup() -> None:
    for name in ("[/bold]", "x[hw]", "[red]x"):
        proc = cli("sim", "run", "--set", f"model.name={name}")
        assert proc.returncode == 2, (name, proc.stdout, proc.stderr)
        assert f"error: <built-in> with --set model.name={name}: invalid experiment" in proc.stdout
        assert f"unknown model {name!r}" in proc.stdout
        assert "Traceback" not in proc.stdout + proc.stderr


def test_the_hw_install_hint_keeps_its_brackets(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "zmq", None)  # `import zmq` raises ImportError
    res = runner.invoke(app, ["hw", "run"])
    assert res.exit_code == 2, res.output
    assert "pip install -e '.[hw]'" in res.output and "Traceback" not in res.output


def _no_simulation(*args: object, **kwargs: object) -> None:
    raise AssertionError("the simulation started")


@pytest.mark.parametrize("command", ["run", "sweep"])
def test_an_out_that_cannot_be_a_directory_is_refused_before_any_simulation(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, command: str
) -> None:
    monkeypatch.setattr("disagg.sim.cluster.Sim", _no_simulation)
    a_file = tmp_path / "a-file"
    a_file.write_text("")
    tiny = str(EXPERIMENTS / "tiny-disagg.toml")
    for out, message in (
        (a_file, f"error: --out {a_file}: a file, not a directory"),
        (a_file / "run", f"error: --out {a_file / 'run'}: cannot be made, {a_file} is a file"),
    ):
        res = runner.invoke(app, ["sim", command, tiny, "--out", str(out)])
        assert res.exit_code == 2, res.output
        assert message in res.output and "Traceback" not in res.output


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes to read-only directories")
def test_an_out_in_a_read_only_directory_is_refused(tmp_path: Path) -> None:
    ro = tmp_path / "ro"
    ro.mkdir(mode=0o500)
    res = runner.invoke(app, ["sim", "run", "--out", str(ro / "run")])
    assert res.exit_code == 2 and f"--out {ro / 'run'}: cannot be written" in res.output


def test_sweep_values_are_all_checked_before_the_first_point_runs(tmp_path: Path) -> None:
    sweep = ["sim", "sweep", str(EXPERIMENTS / "tiny-disagg.toml"), "--out", str(tmp_path / "s")]
    for values, message in (
        ("", "error: --values '': no values to sweep workload.rate_per_s over"),
        (" , ", "error: --values ' , ': no values to sweep workload.rate_per_s over"),
        ("1,abc", "error: --values: 'abc' is not a valid workload.rate_per_s: "),
        ("1,-2", "error: --values: '-2' is not a valid workload.rate_per_s: "),
    ):
        proc = cli(*sweep, "--values", values)
        assert proc.returncode == 2, (values, proc.stdout, proc.stderr)
        assert message in proc.stdout and "Traceback" not in proc.stdout + proc.stderr
        assert not (tmp_path / "s").exists()  # not one point ran
    proc = cli(*sweep, "--param", "transfer.handoff", "--values", "parallel,sideways")
    assert proc.returncode == 2 and "'sideways' is not a valid transfer.handoff" in proc.stdout
    assert "transfer.handoff: Input should be 'decode-first' or 'parallel'" in proc.stdout


def test_plot_reports_the_file_it_wrote(tmp_path: Path) -> None:
    run = tmp_path / "run"
    tiny = ["sim", "run", str(EXPERIMENTS / "tiny-disagg.toml"), "--quiet", "--out", str(run)]
    assert runner.invoke(app, tiny).exit_code == 0
    figures = tmp_path / "figs"
    figures.mkdir()
    for out, written in (
        (figures, figures / "plot.png"),  # a directory: DIR/plot.png
        (tmp_path / "cdf", tmp_path / "cdf.png"),  # no extension: .png, as matplotlib adds it
        (tmp_path / "new" / "p.svg", tmp_path / "new" / "p.svg"),
    ):
        res = runner.invoke(app, ["plot", str(run), "--out", str(out)])
        assert res.exit_code == 0, res.output
        assert res.output.strip() == f"wrote {written}" and written.stat().st_size > 10_000
    res = runner.invoke(app, ["plot", str(run), "--out", str(tmp_path / "p.xyz")])
    assert res.exit_code == 2 and "error: --out: figure" in res.output
    assert "'.xyz' is not a format matplotlib writes (use one of" in res.output


def test_a_request_longer_than_the_model_context_is_an_error_before_the_run(
    tmp_path: Path,
) -> None:
    trace = tmp_path / "long.jsonl"
    trace.write_text(
        '{"timestamp": 0, "input_length": 100, "output_length": 10}\n'
        '{"timestamp": 5, "input_length": 1000000, "output_length": 10}\n'
    )
    exp = tmp_path / "e.toml"
    exp.write_text('[model]\nname = "llama-3.1-8b"\n[workload]\ntrace = "long.jsonl"\n')
    proc = cli("sim", "run", str(exp), "--out", str(tmp_path / "run"))
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    assert (
        "error: workload.trace='long.jsonl': request 1 (1 of 2 too long): 1,000,000 prompt + 10 "
        "output = 1,000,010 tokens exceed llama-3.1-8b's context of 131,072 tokens"
    ) in proc.stdout
    assert "Traceback" not in proc.stdout + proc.stderr and not (tmp_path / "run").exists()
    proc = cli(
        "sim",
        "run",
        "--set",
        "model.name=llama-3.1-8b",
        "--set",
        "workload.prompt_tokens={dist='fixed', value=1000000}",
    )
    assert proc.returncode == 2 and "workload.prompt_tokens.value=1000000 + " in proc.stdout


def test_hw_run_exits_1_when_a_request_failed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The CLI's side of a hardware run (the run itself faked): tables first, then the failures
    and exit code 1."""
    pytest.importorskip("torch")
    pytest.importorskip("zmq")
    import disagg.hw.driver

    def fake_run_hw(exp: object, out: Path, *args: object, **kwargs: object) -> tuple:
        out.mkdir(parents=True)
        pd.DataFrame(
            {"status": ["finished", "failed"], "fail_reason": [None, "decoder died"]}
        ).to_parquet(out / "requests.parquet")
        return {"completed": 1, "failed": 1}, None

    monkeypatch.setattr(disagg.hw.driver, "run_hw", fake_run_hw)
    res = runner.invoke(
        app, ["hw", "run", str(EXPERIMENTS / "tiny-disagg.toml"), "--out", str(tmp_path / "hw")]
    )
    assert res.exit_code == 1, res.output
    assert "1 of 2 requests failed" in res.output and "1 x decoder died" in res.output


def test_the_command_list_joins_each_summary_into_one_paragraph() -> None:
    """A command's summary is its docstring's first paragraph, hard-wrapped in the source: the
    list of commands rewraps it to the terminal instead of breaking where the source does."""
    res = runner.invoke(app, ["--help"], env={"COLUMNS": "200"})
    assert res.exit_code == 0, res.output
    assert "transfers per NIC, a flow per request. Open it at" in res.output
    assert "under SLOs: bisect each configuration's highest rate that keeps up" in res.output

"""The GPU benchmark scripts' CPU dry runs: real processes over the tcp wire with a tiny model,
so a script that only runs on lent GPUs does not rot between device sessions."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pytest

from disagg.config import load_experiment
from disagg.core.metrics import requests_table
from disagg.sim.cluster import Sim

pytest.importorskip("torch")
pytest.importorskip("zmq")

ROOT = Path(__file__).resolve().parents[1]


def _script(
    name: str, *args: str, timeout: float = 300, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """Run benchmarks/NAME with `args` in a child Python (and extra environment `env`)."""
    return subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / name), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
    )


def test_gpu_tpot_dry_run_writes_its_table_and_figures(tmp_path: Path) -> None:
    args = ["--prefill-device", "cpu", "--decode-device", "cpu", "--wire", "tcp"]
    args += ["--model", "tiny-gqa", "--loads", "5", "--duration-s", "1.5", "--prompt", "96"]
    args += ["--output", "12", "--chunk", "32", "--out", str(tmp_path)]
    done = _script("gpu_tpot.py", *args)
    assert done.returncode == 0, done.stderr[-3000:]
    table = (tmp_path / "gpu_tpot.md").read_text().splitlines()
    assert len(table) == 4 and "colocated" in table[2] and "disagg" in table[3]
    assert (tmp_path / "gpu_tpot.png").stat().st_size > 10_000
    assert (tmp_path / "gpu_tpot_passes.png").stat().st_size > 10_000
    co = pd.read_parquet(tmp_path / "colocated-5rps" / "requests.parquet")
    dis = pd.read_parquet(tmp_path / "disagg-5rps" / "requests.parquet")
    cols = ["request_id", "arrival_s", "prompt_tokens", "output_tokens"]
    assert len(co) > 0
    pd.testing.assert_frame_equal(co[cols], dis[cols])  # the same seeded arrivals in both modes
    assert (co.status == "finished").all() and (dis.status == "finished").all()
    steps = pd.read_parquet(tmp_path / "disagg-5rps" / "steps.parquet")
    decode = steps[steps.node.str.startswith("decode")]
    assert len(decode) > 0 and (decode.prefill_tokens == 0).all()  # the decoder never prefills
    chunks = pd.read_parquet(tmp_path / "colocated-5rps" / "steps.parquet").prefill_tokens
    assert 0 < chunks.max() <= 32  # colocated prefills in chunks of the token budget
    # --replot redraws the same table from the run directories alone
    (tmp_path / "gpu_tpot.md").unlink()
    again = _script("gpu_tpot.py", *args, "--replot", timeout=120)
    assert again.returncode == 0, again.stderr[-3000:]
    assert (tmp_path / "gpu_tpot.md").read_text().splitlines() == table


def test_gpu_ttft_dry_run_writes_four_runs_and_the_bound_table(tmp_path: Path) -> None:
    args = ["--prefill-device", "cpu", "--decode-device", "cpu", "--wire", "tcp"]
    args += ["--model", "tiny-gqa", "--prompts", "64,128", "--spacing-s", "0.3"]
    env = {"DISAGG_LAYERS": "2", "DISAGG_REPEATS": "2"}
    done = _script("gpu_ttft.py", *args, "--out", str(tmp_path), env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    for run in ("colocated", "layerwise", "parallel", "whole"):
        req = pd.read_parquet(tmp_path / run / "requests.parquet")
        assert len(req) == 5 and (req.status == "finished").all()  # warm-up + 2 x 2 lengths
        assert sorted(req.prompt_tokens.tolist()) == [64, 64, 64, 128, 128]
    report = (tmp_path / "gpu_ttft.md").read_text()
    rows = [r for r in report.splitlines() if r.startswith("|") and r.split("|")[1].strip()]
    assert [r.split("|")[1].strip() for r in rows[2:4]] == ["64", "128"]  # the bound table
    assert all(f"\n{run} (ms, medians)" in report for run in ("layerwise", "parallel", "whole"))
    assert "queue: to_prefill" in report  # the queue split by the runs' hops tables
    assert "handoff: until_taken" in report  # and the handoff at the KV's landing
    summary = json.loads((tmp_path / "layerwise" / "summary.json").read_text())
    assert set(summary["queue_parts_ms"]) == {
        "late", "to_entry", "at_decoder", "to_prefill", "prefill_wait"
    }  # fmt: skip
    assert set(summary["handoff_parts_ms"]) == {"to_decoder", "until_taken"}
    # the trace stays beside the runs: the simulator replays a run from its directory alone
    exp = json.loads((tmp_path / "layerwise" / "experiment.json").read_text())
    assert Path(exp["workload"]["trace"]).parent == tmp_path.resolve()
    sim = Sim(load_experiment(tmp_path / "layerwise"))
    sim.run()
    replayed = requests_table(sim.requests.values())
    assert sorted(replayed.prompt_tokens.tolist()) == [64, 64, 64, 128, 128]
    assert (replayed.status == "finished").all()


def _module(name: str) -> Any:
    """benchmarks/NAME.py as a module (its functions, without running it)."""
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _gpu_ttft() -> Any:
    return _module("gpu_ttft")


def test_decode_pass_medians_by_length_are_nan_where_no_request_finished() -> None:
    """gpu_ttft's batch-1 decode pass per prompt length: the passes during each request's
    decoding; a length whose requests all failed is NaN (its bound then reads n/a), not a
    KeyError."""
    req = pd.DataFrame(
        {"prompt_tokens": [64, 64], "first_token_s": [1.0, 2.0], "finish_s": [1.5, 2.5]}
    )
    steps = pd.DataFrame(
        {
            "kind": ["decode", "decode", "decode", "prefill", "decode"],
            "decode_seqs": [1, 1, 1, 0, 2],
            "start_s": [1.1, 2.1, 2.2, 1.2, 1.3],
            "duration_s": [0.004, 0.006, 0.008, 0.05, 0.009],
        }
    )
    out = _gpu_ttft().decode_steps(req, steps, [64, 128])
    assert out[64] == 0.006 and math.isnan(out[128])


def test_first_decode_pass_is_told_apart_from_the_later_ones_wall_and_device() -> None:
    """gpu_ttft's first pass: a disaggregated request's starts at ready (before its first
    token), a colocated one's (no ready stamp) after its first token; passes of other
    requests, of other kinds and of larger batches are not counted."""
    req = pd.DataFrame(
        {
            "prompt_tokens": [64, 64, 128],
            "ready_s": [1.0, 2.0, math.nan],
            "first_token_s": [1.006, 2.006, 3.0],
            "finish_s": [1.5, 2.5, 3.5],
        }
    )
    steps = pd.DataFrame(
        {
            "kind": ["decode", "decode", "decode", "decode", "prefill", "decode", "decode"],
            "decode_seqs": [1, 1, 1, 1, 0, 1, 2],
            "start_s": [1.0001, 1.01, 2.0002, 2.01, 3.1, 3.01, 3.2],
            "duration_s": [0.007, 0.006, 0.009, 0.006, 0.05, 0.004, 0.01],
            "device_s": [0.005, 0.0055, 0.006, 0.0057, 0.04, 0.003, 0.009],
        }
    )
    ms = _gpu_ttft().first_passes(req, steps)
    assert ms.loc[64, "first"] == 8.0 and ms.loc[64, "first device"] == 5.5
    assert ms.loc[64, "later"] == 6.0 and ms.loc[64, "later device"] == 5.6
    assert ms.loc[128, "first"] == 4.0 and ms.loc[128, "first device"] == 3.0
    assert math.isnan(ms.loc[128, "later"])  # its only other pass carried two sequences


def test_ttft_stages_split_each_request_and_start_to_ready_spans_the_middle_two() -> None:
    """gpu_ttft's breakdown: per prompt length, the median of each stage; "start to ready" is
    each request's prefill plus end to ready, so moving the prefill's end stamp cannot change
    it."""
    req = pd.DataFrame(
        {
            "prompt_tokens": [64, 64, 64, 128],
            "arrival_s": [0.0, 1.0, 2.0, 3.0],
            "prefill_start_s": [0.001, 1.002, 2.001, 3.001],
            "prefill_end_s": [0.011, 1.010, 2.013, 3.021],  # the last 64 stamped 2 ms late
            "ready_s": [0.012, 1.012, 2.013, 3.022],
            "first_token_s": [0.015, 1.015, 2.016, 3.030],
        }
    )
    req["ttft_s"] = req.first_token_s - req.arrival_s
    ms = _gpu_ttft().breakdown(req)
    assert ms.loc[64, "queue"] == 1.0 and ms.loc[64, "prefill"] == 10.0
    assert ms.loc[64, "end to ready"] == 1.0 and ms.loc[64, "start to ready"] == 11.0
    assert ms.loc[64, "ttft"] == 15.0 and ms.loc[128, "start to ready"] == 21.0
    assert ms.loc[128, "ready to token"] == 8.0


def test_wire_latency_dry_run_times_posts_whose_immediates_all_land(tmp_path: Path) -> None:
    """Over the tcp wire between two processes: every immediate posted is seen, and a whole
    request's 32 layers (8 MiB) take longer to complete than one 64-byte unit."""
    done = _script("wire_latency.py", "--wire", "tcp", "--tokens", "64", "--repeats", "3",
                   "--out", str(tmp_path))  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    r = json.loads((tmp_path / "wire_latency.json").read_text())
    assert r["immediates_seen"] == r["immediates_posted"] == 5 * (1 + 1 + 32)
    posts = [v for v in r.values() if isinstance(v, dict)]
    assert len(posts) == 3 and all(p["post_ms"] > 0 for p in posts)
    unit, whole = r["one 64-byte unit"], r["64-token request, 32 layers"]
    assert whole["completed_ms"] > unit["completed_ms"]


def test_first_pass_dry_run_times_every_condition(tmp_path: Path) -> None:
    """first_pass.py on the CPU: every condition and the later passes have a wall time (the
    graph's parts are n/a without a GPU)."""
    done = _script("first_pass.py", "--device", "cpu", "--model", "tiny-gqa", "--prompt", "100",
                   "--idle-s", "0.01", "--repeats", "2", "--out", str(tmp_path))  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    ms = json.loads((tmp_path / "first_pass.json").read_text())["ms"]
    assert set(ms) == {*_module("first_pass").CONDITIONS, "later passes"}
    assert all(row["wall"] > 0 and row["tail and rest"] == row["wall"] for row in ms.values())


def test_prefill_pieces_dry_run_times_both_modes_at_every_size(tmp_path: Path) -> None:
    """prefill_pieces.py on the CPU: each pass of 16 and 64 tokens, with 0 and 3 decode rows,
    in both modes, with a launch and a wall time (no device time without a GPU); every pieces
    pass ran in pieces, and the two modes gave the same greedy tokens."""
    done = _script("prefill_pieces.py", "--device", "cpu", "--model", "tiny-gqa", "--tokens",
                   "16,64", "--decodes", "0,3", "--warmup", "1", "--repeats", "2", "--out",
                   str(tmp_path))  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads((tmp_path / "prefill_pieces.json").read_text())
    cells = {(r["mode"], r["tokens"], r["decodes"]) for r in got["rows"]}
    assert cells == {(m, n, d) for m in ("eager", "pieces") for n in (16, 64) for d in (0, 3)}
    assert all(r["launch"] > 0 and r["wall"] >= r["launch"] for r in got["rows"])
    assert all(math.isnan(r["device"]) for r in got["rows"])
    assert got["passes_in_pieces"] == 2 * 2 * 3 and got["differ"] == 0


def test_copy_ways_dry_run_checks_every_ways_bytes(tmp_path: Path) -> None:
    """On CPU tensors every torch way copies the run of every layer exactly; the driver's way
    needs a GPU and is recorded as failed, not skipped silently."""
    done = _script("copy_ways.py", "--src-device", "cpu", "--dst-device", "cpu", "--tokens",
                   "16", "--out", str(tmp_path))  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    (r,) = json.loads((tmp_path / "copy_ways.json").read_text())
    torch_ways = [v for k, v in r.items() if isinstance(v, dict) and not k.startswith("driver")]
    assert len(torch_ways) == 6 and all(v["bytes_ok"] for v in torch_ways)
    assert all("error" in r[k] for k in ("driver copy per layer", "driver 2D copy"))


def test_control_hop_dry_run_times_every_case_forward_in_time(tmp_path: Path) -> None:
    """Each case's messages arrive after they were stamped (a stamp taken before the read, or
    a message read twice, would show as a negative or missing time), over ZeroMQ and over a
    plain socket, pinned or not."""
    done = _script("control_hop.py", "--prompts", "64", "--count", "5", "--spacing-s", "0.01",
                   "--latency", "off", "--pin", "off,on", "--transports", "tcp,raw",
                   "--out", str(tmp_path))  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    rows = json.loads((tmp_path / "control_hop.json").read_text())
    cases = {(r["transport"], r["pinned"], r["receiver"]) for r in rows}
    assert len(rows) == len(cases) == 8
    assert all(0 < r["median (ms)"] <= r["p90 (ms)"] < 1000 for r in rows)


def test_hw_repeat_runs_a_run_again_as_it_ran_and_sets_each_metric_over_the_first(
    tmp_path: Path,
) -> None:
    """On the CPU: the second run is the first's experiment (seed, workload, settings), and
    each ratio is the second run's summary value over the first's."""
    from disagg.hw.driver import run_hw

    exp = load_experiment(ROOT / "experiments" / "tiny-disagg.toml", ["workload.num_requests=4"])
    run_hw(exp, tmp_path / "first")
    done = _script("hw_repeat.py", str(tmp_path / "first"), "--out", str(tmp_path / "out"))
    assert done.returncode == 0, done.stderr[-3000:]
    table = pd.read_csv(tmp_path / "out" / "hw_repeat.csv")
    first = json.loads((tmp_path / "first" / "summary.json").read_text())
    out = tmp_path / "out" / "first"  # the second run, under OUT/RUN
    again = json.loads((out / "summary.json").read_text())
    assert list(table.metric) == ["ttft_s_p50", "ttft_s_p90", "tpot_s_p50", "tpot_s_p90",
                                  "itl_s_p99", "output_throughput"]  # fmt: skip
    for row in table.itertuples():
        assert row.first == pytest.approx(first[row.metric])
        assert row.again == pytest.approx(again[row.metric])
        assert row.ratio == pytest.approx(again[row.metric] / first[row.metric])
    ran = [json.loads((d / "experiment.json").read_text()) for d in (tmp_path / "first", out)]
    assert ran[0]["seed"] == ran[1]["seed"] and ran[0]["workload"] == ran[1]["workload"]
    assert again["completed"] == first["completed"] == 4
    assert "| first |" in (tmp_path / "out" / "hw_repeat.md").read_text()


def test_hw_repeat_tells_runs_of_one_name_apart_by_their_parents() -> None:
    """Two runs of one name (a validate run and its calibration twin) get labels, and so
    second-run directories, of their own; a name alone where it is unique."""
    labels = _module("hw_repeat").labels
    runs = [Path("v/hw/disagg-10rps"), Path("v/calibration/disagg-10rps"), Path("v/hw/c-2rps")]
    assert labels(runs) == ["hw-disagg-10rps", "calibration-disagg-10rps", "hw-c-2rps"]
    assert labels(runs[2:]) == ["c-2rps"]
    with pytest.raises(SystemExit, match="given twice"):
        labels([runs[0], runs[0]])


def test_host_spread_runs_each_setting_each_round_and_profiles_before_the_round_asked(
    tmp_path: Path,
) -> None:
    """On the CPU: a row per run, in order (round, then setting), each on its round's seed, the
    profile written before the round asked for and the rows after it marked; the pinned runs'
    cores begin at the second (--first-core 1), the prefill server's, then the decode
    server's, refused where the host has too few; a CPU pass has no device time, so no host
    time is fitted, and its launch is the whole forward."""
    out = tmp_path / "spread"
    done = _script(
        "host_spread.py", str(ROOT / "experiments" / "tiny-disagg.toml"), "--device", "cpu",
        "--rounds", "2", "--requests", "3", "--rate", "50", "--cores", "0,1",
        "--first-core", "1", "--profile-before", "1", "--out", str(out),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    table = pd.read_csv(out / "host_spread.csv")
    assert list(zip(table["round"], table.cores_per_server, strict=True)) == [
        (0, 0), (0, 1), (1, 0), (1, 1)
    ]  # fmt: skip
    assert list(table.seed) == [10, 10, 11, 11] and list(table.profiled) == [0, 0, 1, 1]
    assert (out / "profile.csv").exists() and "profile before round 1" in done.stdout
    assert (
        list(table.pinned[table.cores_per_server == 0])
        == ["decode0:not pinned prefill0:not pinned"] * 2
    )
    allowed = sorted(os.sched_getaffinity(0))
    decode = (
        str(allowed[2])
        if len(allowed) > 2
        else f"refused: process 1 of 1 cores each after the first 1, {len(allowed)} cores"
    )
    pinned = table.pinned[table.cores_per_server == 1]
    assert list(pinned) == [f"decode0:{decode} prefill0:{allowed[1]}"] * 2
    assert (table.first_core == 1).all() and (table.chunk_launch_s > 0).all()
    assert (table.serving_s > 0).all() and (table.driver_cpu_s > 0).all()
    assert table.host_s.isna().all() and (table.driver == "not pinned").all()
    assert "Per round" in (out / "host_spread.md").read_text()


def test_pyspy_host_tables_a_servers_samples_per_pass_by_function_and_line(
    tmp_path: Path,
) -> None:
    """Two server stacks (3 + 1 samples) and the driver's (5, left out), over a run of 2
    passes sampled at 100/s: each sample is 10 ms, so the loop's 4 are 20 ms a pass."""
    start = 'process 7:"python3 -c spawn";<module> (<string>:1);serve (disagg/hw/serve.py:60)'
    run = f"{start};Server.run (disagg/hw/node.py:148);Server.tick (disagg/hw/node.py:258)"
    raw = tmp_path / "raw.txt"
    raw.write_text(
        f"{run};Runner._step (disagg/hw/runner.py:358) 3\n"
        f"{run};Control.recv (disagg/hw/control.py:90) 1\n"
        'process 6:"disagg hw run";Driver.run (disagg/hw/driver.py:400) 5\n'
    )
    steps = tmp_path / "run"
    steps.mkdir()
    pd.DataFrame({"node": ["colocated0"] * 2, "duration_s": [0.01, 0.01]}).to_parquet(
        steps / "steps.parquet"
    )
    done = _script("pyspy_host.py", str(raw), "--rate", "100", "--run", str(steps))
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    assert lines[0] == "# Server loop by py-spy: 4 samples at 100/s, 2 passes"
    assert "| `Server.tick (disagg/hw/node.py)` | 20.000 | 100.0% |" in lines
    assert "| `Runner._step (disagg/hw/runner.py)` | 15.000 | 75.0% |" in lines
    assert "| `Runner._step (disagg/hw/runner.py:358)` | 15.000 | 75.0% |" in lines
    assert "| `Control.recv (disagg/hw/control.py:90)` | 5.000 | 25.0% |" in lines
    assert not any("serve (" in line or "Driver" in line for line in lines)
    nothing = tmp_path / "none.txt"
    nothing.write_text('process 6:"disagg hw run";Driver.run (disagg/hw/driver.py:400) 5\n')
    done = _script("pyspy_host.py", str(nothing), "--rate", "100")
    assert done.returncode == 1 and "no samples of a server's loop" in done.stderr


def test_host_pass_times_each_batch_on_its_pages_and_plans_only_on_a_gpu(tmp_path: Path) -> None:
    """Contexts of 15 tokens: each row's 16th token fills one page of 16, so batches of 1 and
    3 are on 1 and 3 pages; on the CPU there is no plan to time."""
    done = _script(
        "host_pass.py", "--batches", "1,3", "--contexts", "15,15", "--repeats", "3",
        "--out", str(tmp_path),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    table = pd.read_csv(tmp_path / "host_pass.csv")
    assert list(table.columns) == ["batch", "pages", "host_us", "host_p90_us"]
    assert list(table.batch) == [1, 3] and list(table.pages) == [1, 3]
    assert (table.host_us > 0).all() and (table.host_p90_us >= table.host_us).all()


def test_shared_gpu_runs_each_variant_on_one_workload_and_reads_its_passes(
    tmp_path: Path,
) -> None:
    """On the CPU: each variant is the disaggregated twin with its own settings (eager or in
    pieces, KV layer by layer or whole) on the same arrivals, and the tables read every run.
    The overlap arithmetic: a 10 ms pass covered 4 ms by one pass and 2 by another is 0.6."""
    variants = "eager-layerwise,pieces-whole"
    done = _script("shared_gpu.py", "--run", str(ROOT / "experiments" / "tiny-disagg.toml"),
                   "--device", "cpu", "--requests", "6", "--rate", "20", "--pages", "256",
                   "--variants", variants, "--out", str(tmp_path))  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    runs = {
        v: json.loads((tmp_path / v / "experiment.json").read_text()) for v in variants.split(",")
    }
    assert [r["cluster"]["mode"] for r in runs.values()] == ["disagg", "disagg"]
    assert [r["transfer"]["policy"] for r in runs.values()] == ["layerwise", "whole"]
    assert runs["pieces-whole"]["hw"]["latency"]["prefill_graphs"] == [256, 512, 1024, 2048]
    assert runs["eager-layerwise"]["hw"]["latency"]["prefill_graphs"] == []
    arrivals = [pd.read_parquet(tmp_path / v / "requests.parquet").arrival_s for v in runs]
    pd.testing.assert_series_equal(*arrivals)
    table = (tmp_path / "shared_gpu.md").read_text()
    assert all(f"| {v} " in table for v in runs)

    by = pd.DataFrame({"start_s": [0.0, 0.008], "end": [0.004, 0.020]})
    covered = _module("shared_gpu").covered(np.array([0.0]), np.array([0.010]), by)
    assert covered.tolist() == pytest.approx([0.6])


def test_device_tree_leaves_the_records_tarballs_and_figures_out_and_puts_them_back(
    tmp_path: Path,
) -> None:
    """In a clone of this repository (the script run from this checkout): `slim` takes every
    record's tarball and figure out of the working tree (still tracked, the tree clean) and
    says less would travel; `full` puts each back as committed."""
    import subprocess

    root = Path(__file__).resolve().parents[1]
    clone = tmp_path / "clone"
    subprocess.run(["git", "clone", "-q", str(root), str(clone)], check=True)

    def tree(mode: str) -> float:
        out = subprocess.run(
            ["bash", str(root / "benchmarks" / "device_tree.sh"), mode],
            cwd=clone,
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        return float(out.split(" MiB")[0])

    def records(pattern: str) -> list[Path]:
        listed = subprocess.run(
            ["git", "ls-files", pattern], cwd=clone, capture_output=True, text=True, check=True
        )
        return [clone / f for f in listed.stdout.split()]

    tarballs, figures = records("benchmarks/results/*.xz"), records("benchmarks/results/*.png")
    assert tarballs and figures and all(f.exists() for f in [*tarballs, *figures])
    whole, gone = tree("size"), sum(f.stat().st_size for f in [*tarballs, *figures]) / 2**20
    slim = tree("slim")
    assert not any(f.exists() for f in [*tarballs, *figures])
    assert (clone / "disagg" / "cli.py").exists() and (clone / "benchmarks/gpu_session.sh").exists()
    status = subprocess.run(["git", "status", "--porcelain"], cwd=clone, capture_output=True)
    assert status.stdout == b""
    assert slim == pytest.approx(whole - gone, abs=0.1)
    assert tree("full") == whole
    assert all(f.exists() for f in [*tarballs, *figures])

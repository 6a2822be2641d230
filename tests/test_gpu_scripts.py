"""The GPU benchmark scripts' CPU dry runs: real processes over the tcp wire with a tiny model,
so a script that only runs on lent GPUs does not rot between device sessions."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

pytest.importorskip("torch")
pytest.importorskip("zmq")

ROOT = Path(__file__).resolve().parents[1]


def test_gpu_tpot_dry_run_writes_its_table_and_figures(tmp_path: Path) -> None:
    args = ["--prefill-device", "cpu", "--decode-device", "cpu", "--wire", "tcp"]
    args += ["--model", "tiny-gqa", "--loads", "5", "--duration-s", "1.5", "--prompt", "96"]
    args += ["--output", "12", "--chunk", "32", "--out", str(tmp_path)]
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "gpu_tpot.py"), *args],
        capture_output=True,
        text=True,
        timeout=300,
    )
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
    again = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "gpu_tpot.py"), *args, "--replot"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert again.returncode == 0, again.stderr[-3000:]
    assert (tmp_path / "gpu_tpot.md").read_text().splitlines() == table


def test_gpu_ttft_dry_run_writes_four_runs_and_the_bound_table(tmp_path: Path) -> None:
    args = ["--prefill-device", "cpu", "--decode-device", "cpu", "--wire", "tcp"]
    args += ["--model", "tiny-gqa", "--prompts", "64,128", "--spacing-s", "0.3"]
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "gpu_ttft.py"), *args, "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "DISAGG_LAYERS": "2", "DISAGG_REPEATS": "2"},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    for run in ("colocated", "layerwise", "parallel", "whole"):
        req = pd.read_parquet(tmp_path / run / "requests.parquet")
        assert len(req) == 5 and (req.status == "finished").all()  # warm-up + 2 x 2 lengths
        assert sorted(req.prompt_tokens.tolist()) == [64, 64, 64, 128, 128]
    report = (tmp_path / "gpu_ttft.md").read_text()
    rows = [r for r in report.splitlines() if r.startswith("|") and r.split("|")[1].strip()]
    assert [r.split("|")[1].strip() for r in rows[2:4]] == ["64", "128"]  # the bound table
    assert all(f"\n{run} (ms, medians)" in report for run in ("layerwise", "parallel", "whole"))

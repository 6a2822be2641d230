"""The Perfetto/Chrome trace of a run, read back as JSON: tracks, slices, lanes and flows."""

import json
import math
from pathlib import Path
from typing import Any

import pandas as pd
import pytest
from typer.testing import CliRunner

from disagg.cli import app
from disagg.core.metrics import STEP_COLUMNS, TRANSFER_COLUMNS
from disagg.trace import build_trace, link_label, write_trace
from disagg.trace_events import lanes

runner = CliRunner()
ROOT = Path(__file__).parent.parent
HW_RUNS = ROOT / "tests" / "data" / "hw-runs" / "gpu_tpot_2026-11-29d"

REQUEST = dict(prompt_tokens=100, output_tokens=12, prefill_node=0, decode_node=0, tpot_s=0.05)


def _request(i: int, times: tuple[float, ...]) -> dict[str, Any]:
    names = ("arrival_s", "prefill_start_s", "prefill_end_s", "ready_s", "first_token_s")
    row: dict[str, Any] = dict(zip(names, times[:5], strict=True)) | {"finish_s": times[5]}
    row |= dict(REQUEST, request_id=i, ttft_s=times[4] - times[0], status="finished")
    return row | {"attempts": 1, "fail_reason": ""}


def hand_run(tmp_path: Path, tp: int = 2) -> Path:
    """Two nodes, four passes (one of 10 coalesced decode passes), two requests whose
    transfers overlap; the prefill pool's `tp` GPUs of 8 use NICs 0..tp-1."""
    steps = [
        (
            "prefill0",
            "prefill",
            1.0,
            0.2,
            1,
            1,
            0,
            100,
            100,
            0.2,
            5050.0,
            0.0,
            math.nan,
            math.nan,
            0,
        ),
        ("prefill0", "prefill", 1.2, 0.1, 1, 1, 0, 50, 50, 0.1, 6275.0, 0.0, math.nan, math.nan, 0),
        ("decode0", "decode", 1.25, 0.05, 1, 1, 1, 1, 0, 0.05, 0.0, 100.0, math.nan, math.nan, 0),
        ("decode0", "decode", 1.3, 0.5, 10, 2, 2, 2, 0, 0.5, 0.0, 152.0, math.nan, math.nan, 0),
    ]
    requests = [
        _request(0, (0.9, 1.0, 1.2, 1.24, 1.3, 1.8)),
        _request(1, (1.1, 1.2, 1.3, 1.32, 1.35, 1.8)),
    ]
    transfers = [(0, 0, 0, 1e6, 10.0, 1.1, 1.24), (1, 0, 0, 2e6, 20.0, 1.2, 1.32)]
    run = tmp_path / "hand"
    run.mkdir()
    pd.DataFrame(steps, columns=STEP_COLUMNS).to_parquet(run / "steps.parquet")
    pd.DataFrame(requests).to_parquet(run / "requests.parquet")
    pd.DataFrame(transfers, columns=TRANSFER_COLUMNS).to_parquet(run / "transfers.parquet")
    (run / "summary.json").write_text(json.dumps({"experiment": "hand"}))
    exp = {
        "cluster": {"mode": "disagg", "prefill": {"tp": tp, "dp": 1}},
        "hardware": {"gpus_per_node": 8, "nics_per_node": 8},
    }
    (run / "experiment.json").write_text(json.dumps(exp))
    return run


def names(trace: dict[str, Any], kind: str) -> dict[tuple[int, int], str]:
    """(pid, tid) -> name of the `process_name` or `thread_name` metadata events."""
    ev = trace["traceEvents"]
    return {(e["pid"], e["tid"]): e["args"]["name"] for e in ev if e["name"] == kind}


def slices(trace: dict[str, Any], pid: int) -> list[dict[str, Any]]:
    return [e for e in trace["traceEvents"] if e["ph"] == "X" and e["pid"] == pid]


def flows(trace: dict[str, Any]) -> dict[int, list[tuple[str, int, int, float]]]:
    out: dict[int, list[tuple[str, int, int, float]]] = {}
    for e in trace["traceEvents"]:
        if e["ph"] in "stf":
            out.setdefault(e["id"], []).append((e["ph"], e["pid"], e["tid"], e["ts"]))
    return out


def test_lanes_take_the_lowest_free_lane() -> None:
    assert lanes([0, 1, 1, 2.5], [2, 2, 3, 3]) == [0, 1, 2, 0]
    assert lanes([0, 1], [1, 2]) == [0, 0]  # touching slices share a lane


def test_hand_built_run_gives_its_tracks_slices_and_flows(tmp_path: Path) -> None:
    trace = build_trace(hand_run(tmp_path))
    assert trace["displayTimeUnit"] == "ms"
    procs = names(trace, "process_name")
    assert procs == {
        (1, 0): "prefill0",
        (2, 0): "decode0",
        (3, 0): "prefill0 transfers",
        (4, 0): "requests",
    }
    threads = names(trace, "thread_name")
    assert threads[(3, 1000)] == "nics 0-1" and threads[(3, 1001)] == "nics 0-1 #2"
    assert threads[(4, 1000)] == "requests" and threads[(4, 1001)] == "requests #2"

    prefill = slices(trace, 1)
    assert [(e["name"], e["ts"], e["dur"]) for e in prefill] == [
        ("prefill", 1_000_000.0, 200_000.0),
        ("prefill", 1_200_000.0, 100_000.0),
    ]
    assert prefill[0]["args"] == {
        "steps": 1,
        "batch_size": 1,
        "decode_seqs": 0,
        "tokens": 100,
        "prefill_tokens": 100,
        "pass_ms": 200.0,
        "device_ms": 200.0,
        "prefill_attn_pairs": 5050.0,
        "decode_context": 0.0,
    }
    decode = slices(trace, 2)
    assert [(e["name"], e["ts"], e["dur"]) for e in decode] == [
        ("decode", 1_250_000.0, 50_000.0),
        ("decode x10", 1_300_000.0, 500_000.0),
    ]
    assert decode[1]["args"]["steps"] == 10 and decode[1]["args"]["decode_seqs"] == 2
    assert decode[1]["args"]["decode_context"] == 152.0
    assert decode[1]["args"]["pass_ms"] == pytest.approx(50.0)

    xfers = slices(trace, 3)
    assert [(e["name"], e["tid"], e["ts"], e["dur"]) for e in xfers] == [
        ("req 0 to decode0", 1000, 1_100_000.0, 140_000.0),
        ("req 1 to decode0", 1001, 1_200_000.0, 120_000.0),  # overlaps req 0: second lane
    ]
    assert xfers[0]["args"]["bytes"] == 1e6 and xfers[0]["args"]["landed"] is True
    assert xfers[0]["args"]["gbps"] == pytest.approx(1e6 * 8 / 0.14 / 1e9)

    req0 = [(e["name"], e["ts"], e["dur"]) for e in slices(trace, 4) if e["tid"] == 1000]
    assert req0 == [
        ("req 0", 900_000.0, 900_000.0),
        ("queued", 900_000.0, 100_000.0),
        ("prefill", 1_000_000.0, 200_000.0),
        ("transfer", 1_200_000.0, 40_000.0),
        ("to first token", 1_240_000.0, 60_000.0),
        ("decode", 1_300_000.0, 500_000.0),
    ]
    # arrival, the prefill pass, the transfer, first-token pass, last-token pass, finish; each
    # point inside its slice, in time order
    assert flows(trace) == {
        0: [
            ("s", 4, 1000, 900_000.0),
            ("t", 1, 1000, 1_100_000.0),
            ("t", 3, 1000, 1_170_000.0),
            ("t", 2, 1000, 1_275_000.0),
            ("t", 2, 1000, 1_550_000.0),
            ("f", 4, 1000, 1_799_100.0),
        ],
        1: [  # first and last tokens come out of the same coalesced slice: one point
            ("s", 4, 1001, 1_100_000.0),
            ("t", 1, 1000, 1_250_000.0),
            ("t", 3, 1001, 1_260_000.0),
            ("t", 2, 1000, 1_550_000.0),
            ("f", 4, 1001, 1_799_300.0),
        ],
    }


def test_one_nic_per_pool_gets_its_own_track(tmp_path: Path) -> None:
    trace = build_trace(hand_run(tmp_path, tp=1))
    assert set(names(trace, "thread_name").values()) >= {"nic0", "nic0 #2"}


def test_link_label_names_the_nic_only_where_the_experiment_fixes_it() -> None:
    def exp(tp: int, dp: int, gpus: int = 8, nics: int = 8) -> dict[str, Any]:
        pool = {"prefill": {"tp": tp, "dp": dp}}
        return {"cluster": pool, "hardware": {"gpus_per_node": gpus, "nics_per_node": nics}}

    sim = {"backend": "sim"}
    assert link_label(exp(1, 1), sim, 2) == "nic0"
    assert link_label(exp(8, 1), sim, 2) == "nics 0-7"
    assert link_label(exp(2, 2), sim, 2) == "nics 0-3"
    assert link_label(exp(8, 1, nics=1), sim, 2) == "nic0"
    assert link_label(exp(4, 1, nics=2), sim, 2) == "nic0"  # GPUs 0-3 are nearest NIC 0
    assert link_label(exp(8, 1, nics=2), sim, 2) == "nics 0-1"
    assert link_label({}, sim, 2) == "nics"
    assert link_label(exp(1, 1), {"backend": "hw", "wire": "cuda"}, 2) == "to decode2 (cuda)"
    assert link_label(exp(1, 1), {"backend": "hw", "wire": "tcp"}, 0) == "to decode0 (tcp)"
    assert link_label(exp(1, 1), {"backend": "hw", "wire": "verbs"}, 0) == "rdma nic"


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """experiments/tiny-disagg.toml simulated by the command line (20 requests)."""
    run = tmp_path_factory.mktemp("sim") / "tiny"
    toml = str(ROOT / "experiments" / "tiny-disagg.toml")
    res = runner.invoke(app, ["sim", "run", toml, "--out", str(run), "--quiet"])
    assert res.exit_code == 0, res.output
    return run


def test_requests_are_drawn_every_kth_by_id(tiny_run: Path) -> None:
    run = tiny_run
    trace = build_trace(run, max_requests=7)  # 20 requests: k = 3, ids 0, 3, ..., 18
    assert trace["otherData"]["request_stride"] == 3
    assert sorted(flows(trace)) == list(range(0, 20, 3))
    assert flows(build_trace(run, max_requests=0)) == {}


def test_a_simulated_run_writes_its_trace(tiny_run: Path) -> None:
    """tiny-disagg: every pass of the steps table is a slice at its time; all 20 requests
    have a flow from arrival through prefill, transfer and first token to finish."""
    run = tiny_run
    trace = json.loads((run / "trace.json").read_text())
    procs = {v: k[0] for k, v in names(trace, "process_name").items()}
    assert list(procs) == ["prefill0", "decode0", "prefill0 transfers", "requests"]
    assert names(trace, "thread_name")[(procs["prefill0 transfers"], 1000)] == "nic0"
    steps = pd.read_parquet(run / "steps.parquet")
    for node in ("prefill0", "decode0"):
        rows = steps[steps.node == node]
        got = [(e["ts"], e["dur"], e["args"]["steps"]) for e in slices(trace, procs[node])]
        assert got == [
            (round(s * 1e6, 3), pytest.approx(d * 1e6, abs=1e-3), n)
            for s, d, n in zip(rows.start_s, rows.duration_s, rows.steps, strict=True)
        ]
    fl = flows(trace)
    assert sorted(fl) == list(range(20))
    for points in fl.values():
        kinds, pids = [p[0] for p in points], [p[1] for p in points]
        assert kinds[0] == "s" and kinds[-1] == "f" and set(kinds[1:-1]) == {"t"}
        assert pids[0] == pids[-1] == procs["requests"]
        assert pids[1:4] == [procs["prefill0"], procs["prefill0 transfers"], procs["decode0"]]
        assert [p[3] for p in points] == sorted(p[3] for p in points)


@pytest.mark.parametrize("name", ["disagg-2rps", "colocated-2rps"])
def test_a_committed_hw_run_gets_a_trace_from_the_command(tmp_path: Path, name: str) -> None:
    out = tmp_path / "trace.json"
    res = runner.invoke(app, ["trace", str(HW_RUNS / name), "--out", str(out)])
    assert res.exit_code == 0, res.output
    assert f"wrote {out}" in res.output
    trace = json.loads(out.read_text())  # strict JSON: NaN timestamps became None or nothing
    procs = {v: k[0] for k, v in names(trace, "process_name").items()}
    requests = pd.read_parquet(HW_RUNS / name / "requests.parquet")
    fl = flows(trace)
    assert sorted(fl) == requests.request_id.tolist()
    if name.startswith("disagg"):
        assert list(procs) == ["prefill0", "decode0", "prefill0 transfers", "requests"]
        assert "to decode0 (cuda)" in names(trace, "thread_name").values()
        # hw tokens are stamped just after their pass's recorded end: still matched
        assert {len(points) for points in fl.values()} == {6}
    else:
        assert list(procs) == ["colocated0", "requests"]
        assert all(len(points) >= 4 for points in fl.values())
    ready = [e for e in slices(trace, procs["requests"]) if e["name"].startswith("req ")]
    assert all(math.isfinite(e["ts"]) and e["dur"] > 0 for e in ready)


def test_bad_input_is_named(tmp_path: Path) -> None:
    res = runner.invoke(app, ["trace", str(tmp_path)])
    assert res.exit_code == 2 and "requests.parquet is missing" in res.output
    run = hand_run(tmp_path)
    res = runner.invoke(app, ["trace", str(run), "--max-requests", "-1"])
    assert res.exit_code == 2 and "--max-requests -1" in res.output
    res = runner.invoke(app, ["trace", str(run), "--out", str(tmp_path)])
    assert res.exit_code == 2 and "is a directory" in res.output
    assert write_trace(run) == run / "trace.json"


def test_transfers_never_posted_or_never_landed_still_give_strict_json(tmp_path: Path) -> None:
    """A hw transfer given up before its first post has no start (inf or NaN); one given up in
    flight has no end. The first is left out, the second drawn at its start, not landed."""
    import math

    run = hand_run(tmp_path)
    odd = [(0, 0, 0, 0.0, 0.0, math.inf, math.nan), (1, 0, 0, 2e6, 20.0, 1.2, math.nan)]
    pd.DataFrame(odd, columns=TRANSFER_COLUMNS).to_parquet(run / "transfers.parquet")
    path = write_trace(run)
    trace = json.loads(path.read_text())  # strict: no NaN or Infinity in the file
    assert "NaN" not in path.read_text() and "Infinity" not in path.read_text()
    (pid,) = [p for (p, _), n in names(trace, "process_name").items() if "transfers" in n]
    (drawn,) = slices(trace, pid)
    assert drawn["name"] == "req 1 to decode0" and drawn["ts"] == 1.2e6 and drawn["dur"] == 0
    assert drawn["args"]["landed"] is False

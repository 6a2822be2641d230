"""Chaos on the real backend: servers stopped and resumed, or killed, at random times during
runs of a few hundred requests (CPU, tcp wire, real processes). Whatever happens, the run
ends in bounded time, writes every request with its final status, leaves no page reserved on
a server that ran to the end, and leaves no process behind."""

import json
import multiprocessing as mp
import random
from pathlib import Path
from typing import Any

import pandas as pd
import pytest

from disagg.config import build_experiment
from disagg.errors import ConfigError, TransportError

pytest.importorskip("torch")
pytest.importorskip("zmq")

SERVERS = ["prefill0", "decode0"]


def chaos_experiment(seed: int, faults: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "name": f"chaos-{seed}",
        "seed": seed,
        "model": {"name": "tiny-gqa", "weight_dtype": "bf16"},
        "cluster": {
            "mode": "disagg",
            "prefill": {"nodes": 1, "tp": 1, "token_budget": 64},
            "decode": {"nodes": 1, "tp": 1, "max_batch": 16},
        },
        "kv": {"page_size": 4, "pages": 2048},
        "transfer": {"timeout_s": 1.0, "max_attempts": 4},
        "hw": {"wire": "tcp", "dead_after_s": 1.0, "drain_timeout_s": 30.0},
        "workload": {
            "rate_per_s": 60,
            "num_requests": 200,
            "prompt_tokens": {"dist": "uniform", "low": 16, "high": 160},
            "output_tokens": {"dist": "uniform", "low": 4, "high": 24},
        },
        "faults": faults,
    }


def draw_faults(seed: int) -> list[dict[str, Any]]:
    """One or two stops of 0.5-2.5 s on random servers and up to three resets of the wire's
    connection; every third seed also kills the decoder."""
    rng = random.Random(seed)
    faults: list[dict[str, Any]] = [
        {
            "kind": "stop",
            "at_s": round(rng.uniform(0.3, 2.0), 2),
            "node": rng.choice(SERVERS),
            "for_s": round(rng.uniform(0.5, 2.5), 2),
        }
        for _ in range(rng.randint(1, 2))
    ]
    faults += [
        {
            "kind": "drop_connection",
            "at_s": round(rng.uniform(0.2, 3.0), 2),
            "node": "prefill0",
            "peer": "decode0",
        }
        for _ in range(rng.randint(0, 3))
    ]
    if seed % 3 == 0:
        faults.append({"kind": "kill", "at_s": round(rng.uniform(1.0, 3.0), 2), "node": "decode0"})
    return faults


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_chaos_runs_account_for_every_request(seed: int, tmp_path: Path) -> None:
    from disagg.hw.driver import run_hw

    faults = draw_faults(seed)
    out = tmp_path / "run"
    try:
        run_hw(build_experiment(chaos_experiment(seed, faults)), out)
        stopped = False
    except TransportError as e:  # a server was killed: the run stops, its tables written
        assert "died" in str(e) and str(out) in str(e)
        stopped = True
    assert stopped == any(f["kind"] == "kill" for f in faults)
    req = pd.read_parquet(out / "requests.parquet")
    summary = json.loads((out / "summary.json").read_text())
    assert len(req) == 200 and req.request_id.is_unique
    assert set(req.status) <= {"finished", "failed", "unfinished"}
    ended_badly = req[req.status != "finished"]
    assert (ended_badly.fail_reason != "").all()  # each says why
    assert summary["completed"] + summary["failed"] + summary.get("unfinished", 0) == 200
    labels = sorted((f["at_s"], f"{f['kind']} {f['node']} at {f['at_s']:g} s") for f in faults)
    assert [row["fault"] for row in summary["faults"]] == [label for _, label in labels]
    assert sum(row["requests_failed"] for row in summary["faults"]) <= len(ended_badly)
    if not stopped:  # every server ran to the end: no page is left reserved
        assert set(req.status) <= {"finished", "failed"}
        assert summary["pages_in_use"] == {"prefill0": 0, "decode0": 0}
    assert not mp.active_children()  # no server left behind


def run_with(tmp_path: Path, faults: list[dict[str, Any]], **transfer: float) -> tuple[dict, Any]:
    from disagg.hw.driver import run_hw

    data = chaos_experiment(7, faults)
    data["transfer"] |= transfer
    out = tmp_path / "run"
    summary, _ = run_hw(build_experiment(data), out)
    return summary, pd.read_parquet(out / "requests.parquet")


def test_a_nic_down_on_the_tcp_wire_times_transfers_out_and_they_are_retried(
    tmp_path: Path,
) -> None:
    down = {"kind": "nic_down", "at_s": 0.5, "node": "prefill0", "for_s": 2.5}
    summary, req = run_with(tmp_path, [down])
    assert summary["faults_injected"] == 1
    assert (req.attempts > 1).any()  # stuck for longer than transfer.timeout_s: retried
    assert set(req.status) <= {"finished", "failed"}
    assert (req[req.status == "failed"].fail_reason.str.startswith("transfer timed out")).all()
    assert summary["pages_in_use"] == {"prefill0": 0, "decode0": 0}


def test_dropped_connections_fail_only_writes_in_flight(tmp_path: Path) -> None:
    drops = [
        {"kind": "drop_connection", "at_s": 0.2 * i, "node": "prefill0", "peer": "decode0"}
        for i in range(1, 11)
    ]
    summary, req = run_with(tmp_path, drops)
    assert summary["faults_injected"] == 10  # each reset; the wire reconnected after each
    assert set(req.status) <= {"finished", "failed"}
    assert (req[req.status == "failed"].fail_reason != "").all()
    assert summary["completed"] >= 190  # retried: a reset costs the writes in flight only
    assert summary["pages_in_use"] == {"prefill0": 0, "decode0": 0}


def test_delayed_control_messages_delay_every_handoff(tmp_path: Path) -> None:
    delay = {"kind": "delay_control", "at_s": 0.0, "node": "decode0", "delay_s": 0.3, "for_s": 60}
    summary, req = run_with(tmp_path, [delay])
    assert summary["faults_injected"] == 1 and (req.status == "finished").all()
    assert (req.ttft_s > 0.3).all()  # the handoff left 0.3 s late, every time


@pytest.mark.parametrize(
    ("wire", "fault", "message"),
    [
        ("verbs", {"kind": "nic_down", "for_s": 1}, r"faults\[0\].kind='nic_down': the verbs"),
        ("cuda", {"kind": "nic_degrade", "for_s": 1, "gbps": 1}, r"paces the tcp wire only"),
        ("verbs", {"kind": "drop_connection", "peer": "decode0"}, r"the verbs wire's NICs"),
    ],
)
def test_a_fault_the_run_cannot_inject_is_a_config_error(
    wire: str, fault: dict[str, Any], message: str
) -> None:
    from disagg.hw.driver import fault_actions

    data = chaos_experiment(1, [{"at_s": 1, "node": "prefill0", **fault}])
    data["hw"]["wire"] = wire
    with pytest.raises(ConfigError, match=message):
        fault_actions(build_experiment(data), ())


def test_a_server_started_elsewhere_is_not_signalled() -> None:
    from disagg.hw.driver import fault_actions

    exp = build_experiment(chaos_experiment(1, [{"kind": "kill", "at_s": 1, "node": "decode0"}]))
    with pytest.raises(ConfigError, match=r"faults\[0\].node='decode0' is started elsewhere"):
        fault_actions(exp, ("decode0",))
